"""``hpctrain export``: a sharded checkpoint to safetensors (the parameters, PyTorch names) or one HDF5 file."""

import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from helpers import make_classification, toml_job
from hpctrain.checkpoint import inspect, list_checkpoints, load_checkpoint, read_meta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hpctrain(*args, cwd):
    return subprocess.run([sys.executable, "-m", "hpctrain", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("export")
    make_classification(folder / "d.h5", n=64)
    (folder / "job.toml").write_text(toml_job(train={"steps": 4}, optim={"name": "adamw", "lr": 0.01},
                                              checkpoint={"dir": "ck"}))
    proc = hpctrain("train", "job.toml", cwd=folder)
    assert proc.returncode == 0, proc.stderr
    (_, path), = list_checkpoints(str(folder / "ck"))
    return path


def _layout(path):
    import tomllib

    from hpctrain.config import parse_config
    from hpctrain.nn import make_model

    return make_model(parse_config(tomllib.loads(read_meta(path).config_text)).model).layout


def test_export_h5_is_one_self_contained_checkpoint(checkpoint, tmp_path):
    out = tmp_path / "whole.h5"
    proc = hpctrain("export", checkpoint, str(out), cwd=tmp_path)
    assert proc.returncode == 0 and "format version 2" in proc.stdout, proc.stderr
    with h5py.File(out, "r") as f:
        assert f.attrs["version"] == 2 and not f["params/0.weight"].is_virtual
    layout = _layout(checkpoint)
    a, b = load_checkpoint(checkpoint, layout), load_checkpoint(str(out), layout)
    assert a.step == b.step == 4 and a.optim_step == b.optim_step
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name])
        for slot in a.slots:
            np.testing.assert_array_equal(a.slots[slot][name], b.slots[slot][name])
    text, ok = inspect(str(out))
    assert ok, text


def test_export_safetensors_holds_the_parameters_under_their_pytorch_names(checkpoint, tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.numpy import load_file

    out = tmp_path / "model.safetensors"
    proc = hpctrain("export", checkpoint, str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    got = load_file(str(out))
    want = load_checkpoint(checkpoint, _layout(checkpoint)).params
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == np.float32 and got[name].shape == want[name].shape
        np.testing.assert_array_equal(got[name], want[name])
    assert os.listdir(tmp_path) == ["model.safetensors"]  # no temp file left
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(out).st_mode & 0o777 == 0o666 & ~umask  # a new file's mode, not safetensors' own 0600


@pytest.mark.parametrize("args,message", [
    (["model.bin"], "cannot tell the format of model.bin"),
    (["x/model.h5"], "the folder of x/model.h5 does not exist (make it first: mkdir -p x)"),
], ids=["extension", "folder"])
def test_export_refuses_bad_outputs_with_one_line_and_exit_2(checkpoint, tmp_path, args, message):
    proc = hpctrain("export", checkpoint, *args, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_export_of_a_damaged_checkpoint_is_refused(checkpoint, tmp_path):
    import glob
    import shutil

    from helpers import copy_checkpoint

    copy_checkpoint(checkpoint, str(tmp_path))
    (shard,) = glob.glob(str(tmp_path / "*.shards" / "rank-00000.h5"))
    os.truncate(shard, 100)
    proc = hpctrain("export", str(tmp_path / os.path.basename(checkpoint)), "out.h5", cwd=tmp_path)
    assert proc.returncode == 2 and "rank-00000.h5" in proc.stderr, proc.stderr
    assert not os.path.exists(tmp_path / "out.h5")
    shutil.rmtree(os.path.dirname(shard))


def test_export_refuses_an_existing_output_without_force(checkpoint, tmp_path):
    (tmp_path / "whole.h5").write_text("mine")
    proc = hpctrain("export", checkpoint, "whole.h5", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip() == \
        "hpctrain: error: export: whole.h5 exists; pass --force to replace it", proc.stderr
    assert (tmp_path / "whole.h5").read_text() == "mine"
    proc = hpctrain("export", checkpoint, "whole.h5", "--force", cwd=tmp_path)
    assert proc.returncode == 0 and h5py.is_hdf5(tmp_path / "whole.h5"), proc.stderr


@pytest.fixture(scope="module")
def gpt_checkpoint(tmp_path_factory):
    from helpers import make_tokens

    folder = tmp_path_factory.mktemp("export-gpt")
    make_tokens(folder / "t.h5", n=400)
    (folder / "gpt.toml").write_text("\n".join([
        "[model]", 'kind = "gpt"', "vocab_size = 12", "block_size = 8", "n_layer = 2", "n_head = 2", "n_embd = 8",
        "bias = false", "dropout = 0.1",
        "[data]", 'path = "t.h5"', 'tokens = "tokens"',
        "[train]", "batch_size = 4", "steps = 3", 'backend = "cpu"', "eval_every = 0",
        "[checkpoint]", 'dir = "ck"']))
    proc = hpctrain("train", "gpt.toml", cwd=folder)
    assert proc.returncode == 0, proc.stderr
    (_, path), = list_checkpoints(str(folder / "ck"))
    return path


class FakeTorch:
    """torch as export uses it: from_numpy and save, recording what nanoGPT's torch.load would get back."""

    def __init__(self):
        self.saved = []

    def from_numpy(self, arr):
        return ("tensor", arr)

    def save(self, obj, f):
        self.saved.append(obj)
        f.write(b"torch zip")  # export serialises to memory, then writes the bytes itself


def test_export_to_nanogpt_is_train_py_s_checkpoint_less_the_optimizer(gpt_checkpoint, tmp_path, monkeypatch):
    """What sample.py reads: model_args for GPTConfig(**model_args) and a state dict load_state_dict takes whole
    (strict: the tied lm_head.weight included, bias = False's names)."""
    from hpctrain.export import export

    fake = FakeTorch()
    monkeypatch.setitem(sys.modules, "torch", fake)
    line = export(gpt_checkpoint, str(tmp_path / "ckpt.pt"))
    assert "iter_num 3" in line and (tmp_path / "ckpt.pt").read_bytes() == b"torch zip"
    (saved,) = fake.saved
    assert saved["model_args"] == dict(n_layer=2, n_head=2, n_embd=8, block_size=8, bias=False, vocab_size=12,
                                       dropout=0.1)
    assert saved["iter_num"] == 3 and "optimizer" not in saved
    params = load_checkpoint(gpt_checkpoint, _layout(gpt_checkpoint)).params
    model = saved["model"]
    assert list(model) == list(params) + ["lm_head.weight"]  # nanoGPT's state_dict order, then the head
    assert not any(name.endswith(".bias") for name in model)
    for name, arr in params.items():
        np.testing.assert_array_equal(model[name][1], arr)
    assert model["lm_head.weight"] is model["transformer.wte.weight"]


def test_export_to_nanogpt_refuses_an_mlp_and_a_missing_torch(checkpoint, gpt_checkpoint, tmp_path):
    proc = hpctrain("export", checkpoint, "ckpt.pt", cwd=tmp_path)
    assert proc.returncode == 2 and "nanoGPT's ckpt.pt holds a GPT" in proc.stderr, proc.stderr
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        proc = hpctrain("export", gpt_checkpoint, "ckpt.pt", cwd=tmp_path)
        assert proc.returncode == 2 and "needs torch importable" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "ckpt.pt")


def test_under_mpiexec_an_export_that_finds_its_file_says_every_rank_ran_it(checkpoint, tmp_path):
    """``mpiexec -n 2 hpctrain export``: both ranks run it (export is one process's work, and srun's tasks may each
    convert a file of their own); the file is whole, and a rank that finds it written says why."""
    import shutil

    from launch import launcher_env, mpi_command

    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("mpiexec not found")
    env = launcher_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      env.get("PYTHONPATH")]))
    proc = subprocess.run(mpi_command(mpiexec, 2, sys.executable, "-m", "hpctrain", "export", checkpoint, "out.h5"),
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert h5py.is_hdf5(tmp_path / "out.h5")
    if proc.returncode != 0:  # the usual case: one rank wrote it first
        assert "exists; pass --force to replace it (hpctrain export runs in one process; the launcher started 2, " \
               "and each ran it)" in proc.stderr, proc.stderr


def test_a_one_process_command_in_a_task_of_its_own_does_its_work(tmp_path):
    """A task of ``srun -n 4`` converting its own file (SLURM_PROCID 1 of 4) converts it."""
    (tmp_path / "part1.txt").write_text("hello world\n" * 20)
    env = {**os.environ, "SLURM_PROCID": "1", "SLURM_NTASKS": "4"}
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "data", "text2h5", "part1.txt", "part1.h5"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and h5py.is_hdf5(tmp_path / "part1.h5"), proc.stderr


def test_export_bf16_rounds_the_master_copy_to_nearest_even_in_half_the_bytes(checkpoint, tmp_path):
    """--dtype bf16: each parameter is the float32 master value rounded to bfloat16 (ml_dtypes' cast, to nearest
    even: the same rounding train.precision = "bf16" uses), stored as safetensors' BF16; the file is about half
    the float32 one's size; hpctrain's reader widens it back exactly."""
    pytest.importorskip("safetensors")
    import json

    import ml_dtypes

    from hpctrain.hf import read_widened

    full, half = tmp_path / "f.safetensors", tmp_path / "h.safetensors"
    for out, extra in ((full, []), (half, ["--dtype", "bf16"])):
        proc = hpctrain("export", checkpoint, str(out), *extra, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    assert "in bfloat16" in proc.stdout
    n = int.from_bytes(half.read_bytes()[:8], "little")
    header = json.loads(half.read_bytes()[8 : 8 + n])
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    want = load_checkpoint(checkpoint, _layout(checkpoint)).params
    got = read_widened(str(half))
    for name, arr in want.items():
        rounded = arr.astype(ml_dtypes.bfloat16)
        np.testing.assert_array_equal(got[name], rounded.astype(np.float32))
        assert np.abs(got[name] - arr).max() <= np.abs(arr).max() * 2.0**-8  # a half-ulp of bfloat16 at most
        assert not np.array_equal(got[name], arr) or arr.size < 4  # it really rounds
    payload = sum(a.size for a in want.values())
    assert os.path.getsize(full) - os.path.getsize(half) >= 2 * payload - 64


@pytest.mark.parametrize("args,message", [
    (["whole.h5", "--dtype", "bf16"], "the h5 format is the whole checkpoint"),
    (["m.safetensors", "--dtype", "fp16"], "invalid choice: 'fp16'"),
], ids=["h5", "fp16"])
def test_export_dtype_refusals_are_one_line(checkpoint, tmp_path, args, message):
    proc = hpctrain("export", checkpoint, *args, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not any(p.name != "d.h5" for p in tmp_path.iterdir())


def test_export_to_nanogpt_in_bf16_casts_each_tensor(gpt_checkpoint, tmp_path, monkeypatch):
    from hpctrain.export import export

    class Tensor:
        def __init__(self, arr, kind="float32"):
            self.arr, self.kind = arr, kind

        def to(self, kind):
            return Tensor(self.arr, kind)

    fake = FakeTorch()
    fake.from_numpy, fake.bfloat16, fake.float32 = Tensor, "bfloat16", "float32"
    monkeypatch.setitem(sys.modules, "torch", fake)
    line = export(gpt_checkpoint, str(tmp_path / "ckpt.pt"), dtype="bf16")
    assert "in bfloat16" in line
    (saved,) = fake.saved
    assert {t.kind for t in saved["model"].values()} == {"bfloat16"}
