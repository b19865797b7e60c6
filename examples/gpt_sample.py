"""A library user's run: a config built from a dict, a mesh of your own, a few steps, evaluation, then text.

    mpiexec -n 2 python examples/gpt_sample.py                      # 2 data-parallel ranks, 300 steps
    python examples/gpt_sample.py --steps 20 --out /tmp/gpt         # one process, a few seconds

A small character-level GPT (nanoGPT's model) on the English text of Python's documentation,
which every Python carries (written to ``--out``/pydoc-chars.h5 on first use). Every rank runs the
whole script: building the Mesh and the Trainer, ``run()``, ``evaluate()``, ``close()`` and
``Mesh.free()`` are collective over the mesh's communicator. Sampling reads the final checkpoint
and runs in one process, so only rank 0 does it.
"""

import argparse
import os

from mpi4py import MPI

from hpctrain.config import parse_config
from hpctrain.parallel.mesh import Mesh
from hpctrain.sample import sample
from hpctrain.train import Trainer


def make_config(steps: int, out: str):
    """The config as a dict, with the sections and keys of a TOML file (docs/config.md)."""
    data = {
        "model": {"kind": "gpt", "vocab_size": 128, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 64},
        "data": {"path": "pydoc-chars.h5", "corpus": "pydoc", "tokens": "tokens", "val_fraction": 0.1},
        "train": {"batch_size": 16, "steps": steps, "log_every": max(1, steps // 4), "eval_every": 0,
                  "metrics": "metrics.jsonl", "grad_clip": 1.0, "seed": 1337},
        "optim": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.1, "schedule": "cosine",
                  "warmup_steps": min(20, steps // 10)},
        "checkpoint": {"dir": "."},
    }
    return parse_config(data, base_dir=out, source="examples/gpt_sample.py")  # relative paths: under out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--out", default="runs/examples/gpt", help="folder for the token file, checkpoints, metrics")
    p.add_argument("--prompt", default="The ")
    p.add_argument("--tokens", type=int, default=200, help="characters to generate (default 200)")
    args = p.parse_args()
    out = os.path.abspath(args.out)
    if MPI.COMM_WORLD.rank == 0:
        os.makedirs(out, exist_ok=True)
    MPI.COMM_WORLD.Barrier()

    cfg = make_config(args.steps, out)
    mesh = Mesh(dp="auto", pp=1, tp=1)  # collective: a Dup of COMM_WORLD split into dp x pp x tp
    trainer = Trainer(cfg, mesh=mesh)  # collective over mesh.world
    try:
        trainer.run()  # collective: trains to train.steps (or resumes and finds it done), writes the final checkpoint
        ev = trainer.evaluate()  # collective: loss over the validation split
    finally:
        trainer.close()  # collective; the mesh is ours, so the Trainer leaves it to us
    mesh.free()  # collective
    if mesh.rank == 0:
        print(f"gpt: step {trainer.step}, validation loss {ev['val_loss']:.3f} nats per character")
        checkpoint = os.path.join(cfg.checkpoint.dir, f"ckpt-{trainer.step:08d}.h5")
        print(sample(checkpoint, args.prompt, args.tokens, temperature=0.8, top_k=20, seed=0))


if __name__ == "__main__":
    main()
