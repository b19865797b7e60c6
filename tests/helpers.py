"""Small data files and configs for tests."""

import h5py
import numpy as np

from hpctrain.config import parse_config


def make_classification(path, n=96, features=6, classes=3, seed=0, nan_row=None):
    rng = np.random.default_rng(seed)
    centers = rng.standard_normal((classes, features)) * 2
    y = rng.integers(0, classes, n)
    x = (centers[y] + rng.standard_normal((n, features)) * 0.5).astype(np.float32)
    if nan_row is not None:
        x[nan_row, 0] = np.nan
    with h5py.File(path, "w") as f:
        f["x"] = x
        f["y"] = y.astype(np.int64)
    return x, y


def make_regression(path, n=64, features=5, outputs=2, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype(np.float32)
    y = (x @ rng.standard_normal((features, outputs))).astype(np.float32)
    with h5py.File(path, "w") as f:
        f["x"] = x
        f["y"] = y
    return x, y


def config(path, *, features=6, hidden=8, classes=3, loss="cross_entropy", **sections):
    data = {
        "model": {"layers": [{"type": "linear", "in": features, "out": hidden}, {"type": "tanh"},
                             {"type": "layernorm", "dim": hidden}, {"type": "gelu"},
                             {"type": "linear", "in": hidden, "out": hidden}, {"type": "relu"},
                             {"type": "linear", "in": hidden, "out": classes}]},
        "data": {"path": str(path), "inputs": "x", "targets": "y", "val_fraction": 0.25, "shuffle": False},
        "train": {"loss": loss, "batch_size": 8, "steps": 5, "backend": "cpu", "log_every": 1, "eval_every": 0},
        "optim": {"name": "sgd", "lr": 0.1},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return parse_config(data)


def train_params(cfg, comm, look=None):
    """Train ``cfg`` on a mesh over ``comm`` (collective) and return every rank the full final parameters by name;
    ``look(trainer)``, when given, runs on each rank after training."""
    import numpy as np

    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer

    p = cfg.parallel
    mesh = Mesh(comm=comm, dp=p.dp, pp=p.pp, tp=p.tp)
    try:
        t = Trainer(cfg, mesh=mesh, log=lambda *a: None)
        t.run()
        t.close()
        if look is not None:
            look(t)
        gathered = t.state_dict()
        flat = t.model.layout.pack(gathered[0] if gathered else None)
        mesh.world.Bcast(flat, root=0)
        return {name: np.array(arr) for name, arr in t.model.layout.unpack(flat).items()}
    finally:
        mesh.free()


def toml_job(hidden=8, **sections):
    """Config-file text of a 6 -> hidden -> 3 MLP on d.h5 (x, y) beside it, CPU backend, batch 8.

    ``sections`` add or replace keys: ``toml_job(train={"steps": 5}, checkpoint={"dir": "ck"})``.
    """
    layers = (f'[{{type = "linear", in = 6, out = {hidden}}}, {{type = "relu"}}, '
              f'{{type = "linear", in = {hidden}, out = 3}}]')
    tables = {"data": {"path": "d.h5", "inputs": "x", "targets": "y"},
              "train": {"batch_size": 8, "steps": 3, "backend": "cpu"}}
    for name, values in sections.items():
        tables.setdefault(name, {}).update(values)
    lines = ["[model]", f"layers = {layers}"]
    for name, values in tables.items():
        lines.append(f"[{name}]")
        lines += [f"{key} = {_toml(value)}" for key, value in values.items()]
    return "\n".join(lines) + "\n"


def _toml(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def make_tokens(path, n=2000, vocab="abcdefgh\n ", seed=0):
    """A token file (hpctrain.text format) of ``n`` characters of a small, learnable text."""
    from hpctrain.text import CharTokenizer, write_tokens

    rng = np.random.default_rng(seed)
    words = ["ab", "cab", "dead", "beef", "fade", "ace", "bad", "hg"]
    text = ""
    while len(text) < n:
        text += words[rng.integers(len(words))] + ("\n" if rng.random() < 0.2 else " ")
    tok = CharTokenizer("".join(sorted(set(vocab))))
    write_tokens(path, tok.encode(text[:n]), tok.vocabulary)
    return text[:n]


def gpt_config(path, **sections):
    """A tiny GPT (2 layers, 2 heads, width 8, context 8, vocabulary 12) on the token file ``path``."""
    data = {
        "model": {"kind": "gpt", "vocab_size": 12, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 8},
        "data": {"path": str(path), "tokens": "tokens", "val_fraction": 0.1, "shuffle": True},
        "train": {"batch_size": 4, "steps": 4, "backend": "cpu", "log_every": 1, "eval_every": 0},
        "optim": {"name": "adamw", "lr": 0.01},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return parse_config(data)


def folder_listing(folder) -> list[str]:
    """``sorted(os.listdir(folder))`` with each sharded checkpoint's folder of shards named ``ckpt-<step>.shards``
    (its set id left out), so a test can say exactly what a checkpoint folder holds."""
    import os
    import re

    return sorted(re.sub(r"^(ckpt-\d+)\.[0-9a-f]{16}\.shards$", r"\1.shards", n) for n in os.listdir(folder))


def copy_checkpoint(index, folder) -> None:
    """Copy a checkpoint into ``folder``: its index and, for a sharded one, the folder of shards beside it."""
    import glob
    import os
    import shutil

    shutil.copy(index, folder)
    for shards in glob.glob(f"{str(index)[:-3]}.*.shards"):
        shutil.copytree(shards, os.path.join(folder, os.path.basename(shards)))


def run_trainer(cfg, mesh, log=None):
    """Build a Trainer on ``mesh``, run it to the end and close it; the Trainer (its buffers stay readable)."""
    from hpctrain.train import Trainer

    t = Trainer(cfg, mesh=mesh, log=log or (lambda *a: None))
    t.run()
    t.close()
    return t
