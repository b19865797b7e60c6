"""Sharded checkpoints (format version 3) on one process: the index, its shards, and every bad input.

The multi-rank side (every rank writes its own shard, resharding loads, a failing writer on one rank)
is tests/mpi/test_sharded_checkpoint.py; resuming across layouts is also covered by
tests/mpi/test_checkpoint_resharding.py and tests/mpi/test_zero.py.
"""

import dataclasses
import glob
import os
import shutil
import signal
import subprocess
import sys

import h5py
import numpy as np
import pytest

from helpers import config, folder_listing, make_classification, run_trainer as run
from hpctrain.checkpoint import format as fmt
from hpctrain.checkpoint import inspect, list_checkpoints, load_checkpoint, load_weights, save_checkpoint
from hpctrain.errors import CheckpointError
from hpctrain.nn import Layer
from hpctrain.train import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ADAMW = {"name": "adamw", "lr": 0.01}


def job(tmp_path, steps=6, **checkpoint):
    if not (tmp_path / "d.h5").exists():
        make_classification(tmp_path / "d.h5", n=96)
    return config(tmp_path / "d.h5", optim=ADAMW, train={"steps": steps},
                  checkpoint={"dir": str(tmp_path / "ck"), "every": 3, **checkpoint})


def shard_of(tmp_path, step):
    (path,) = glob.glob(str(tmp_path / "ck" / f"ckpt-{step:08d}.*.shards" / "rank-00000.h5"))
    return path


def test_a_checkpoint_is_an_index_and_a_folder_of_shards_that_plain_h5py_reads_as_full_tensors(tmp_path, mesh):
    t = run(job(tmp_path), mesh)
    names = folder_listing(tmp_path / "ck")
    assert names == ["ckpt-00000003.h5", "ckpt-00000003.shards", "ckpt-00000006.h5", "ckpt-00000006.shards"]
    index = str(tmp_path / "ck" / "ckpt-00000006.h5")
    params, slots = t.params.to_host_dict(), {k: v.to_host_dict() for k, v in t.optim.slots.items()}
    with h5py.File(index, "r") as f:  # nanoGPT's loading line, unchanged: virtual datasets over the shards
        assert f.attrs["version"] == 3 and list(f["params"]) == list(params)
        for name, arr in params.items():
            np.testing.assert_array_equal(f["params"][name][...], arr)
        for slot, tensors in slots.items():
            for name, arr in tensors.items():
                np.testing.assert_array_equal(f[f"optim/{slot}/{name}"][...], arr)
    state = load_checkpoint(index, t.model.layout)
    assert state.step == 6 and state.version == 3 and state.optim_step == 6
    for name, arr in params.items():
        np.testing.assert_array_equal(state.params[name], arr)
    np.testing.assert_array_equal(load_weights(index, t.model.layout)["0.weight"], params["0.weight"])
    text, ok = inspect(index)
    assert ok and "sharded: set" in text and "3 of 3 buffers" in text, text
    n = sum(a.size for a in params.values())  # one rank wrote everything: each tensor, each slot of it
    assert f"  rank-00000.h5: {3 * len(params)} piece(s), {4 * 3 * n / 1024:.1f} KiB (params, exp_avg, " \
           "exp_avg_sq)" in text, text


class Gains(Layer):
    """y = x · s + Σ t: a registered layer with a scalar and a 3-D parameter, both trained."""

    def __init__(self, dim: int):
        self.in_features = self.out_features = dim
        self.params = (("s", ()), ("t", (2, 3, dim)))

    def init(self, rng):
        return {"s": np.float32(1.0) + np.zeros((), np.float32),
                "t": (rng.standard_normal((2, 3, self.in_features)) * 0.1).astype(np.float32)}

    def forward(self, be, x):
        return x * self.w["s"] + self.w["t"].sum(axis=(0, 1)), x

    def backward(self, be, dout, x, accumulate=False, need_dinp=True):
        ds, dt = (dout * x).sum(), np.broadcast_to(dout.sum(axis=0), self.g["t"].shape)
        self.g["s"][...] = self.g["s"] + ds if accumulate else ds
        self.g["t"][...] = self.g["t"] + dt if accumulate else dt
        return dout * self.w["s"]


@pytest.mark.parametrize("shape", [(2, 3, 4), (3, 1, 5, 2), (4, 6), (7,)])
def test_any_run_of_a_whole_tensor_maps_to_its_own_dimensions_in_the_index(shape):
    """A ZeRO chunk may start and end anywhere in a tensor's C order: the index's hyperslabs (in the tensor's own
    dimensions, more than two for a registered layer's) put each value of the run where it belongs."""
    from hpctrain.checkpoint.pieces import Piece, segments
    from hpctrain.checkpoint.sharded import _virtual_boxes

    size = int(np.prod(shape))
    rng = np.random.default_rng(0)
    for lo, hi in [(0, size), (0, 1), (size - 1, size)] + [tuple(sorted(rng.integers(0, size + 1, 2))) for _ in
                                                           range(40)]:
        got = np.full(shape, np.nan)
        source = np.arange(lo, hi, dtype=np.float64)  # the piece's values, one after another as a shard holds them
        for segment in segments(Piece("t", shape, None, 0, 1, lo, hi)):
            for start, count, off, n in _virtual_boxes(shape, *segment):
                box = tuple(slice(a, a + c) for a, c in zip(start, count))
                assert np.isnan(got[box]).all(), (lo, hi, start, count)  # no value mapped twice
                got[box] = source[off : off + n].reshape(count)
        want = np.full(size, np.nan)
        want[lo:hi] = source
        np.testing.assert_array_equal(got.reshape(-1), want, err_msg=f"[{lo}, {hi})")


def test_a_column_split_needs_columns_for_every_rank_not_rows():
    """A row-parallel Linear with fewer outputs than tp ranks (3 classes at tp = 4) is split by its 12 columns:
    its checkpoint covers it; a split its shape cannot have is still refused."""
    from types import SimpleNamespace

    from hpctrain.checkpoint.pieces import Piece
    from hpctrain.checkpoint.sharded import _coverage_problem

    def split(shape, kind, tp, per):
        return [(Piece("w", shape, kind, r, tp, 0, per), r, 0, 0) for r in range(tp)]

    assert _coverage_problem(split((3, 12), "cols", 4, 9), SimpleNamespace(shape=(3, 12))) == ""
    assert "does not allow" in _coverage_problem(split((2, 6), "cols", 4, 2), SimpleNamespace(shape=(2, 6)))
    assert "does not allow" in _coverage_problem(split((3, 12), "rows", 4, 9), SimpleNamespace(shape=(3, 12)))


def test_a_registered_layers_scalar_and_many_dimensional_parameters_checkpoint_and_resume(tmp_path, mesh):
    """Shapes the built-in layers do not have: each is written whole, read back by plain h5py in its own shape,
    and the run resumes from it."""
    from hpctrain.layer_kinds import register_layer, registered

    if registered("test_gains") is None:
        register_layer("test_gains", Gains, keys={"dim": int}, required=("dim",))
    layers = [{"type": "linear", "in": 6, "out": 8}, {"type": "test_gains", "dim": 8},
              {"type": "linear", "in": 8, "out": 3}]
    make_classification(tmp_path / "d.h5", n=96)
    cfg = config(tmp_path / "d.h5", model={"layers": layers}, optim=ADAMW, train={"steps": 6},
                 checkpoint={"dir": str(tmp_path / "ck"), "every": 3})
    t = run(cfg, mesh)
    params = t.params.to_host_dict()
    assert params["1.s"].shape == () and params["1.s"] != 1.0 and params["1.t"].shape == (2, 3, 8)
    with h5py.File(tmp_path / "ck" / "ckpt-00000006.h5", "r") as f:
        for name, arr in params.items():
            assert f["params"][name].shape == arr.shape
            np.testing.assert_array_equal(f["params"][name][()], arr)
        np.testing.assert_array_equal(f["optim/exp_avg_sq/1.t"][()], t.optim.slots["exp_avg_sq"].to_host_dict()["1.t"])
    from hpctrain.export import export

    export(str(tmp_path / "ck" / "ckpt-00000006.h5"), str(tmp_path / "whole.h5"))  # the single-file format too
    state = load_checkpoint(str(tmp_path / "whole.h5"), t.model.layout)
    for name, arr in params.items():
        assert state.params[name].shape == arr.shape and state.slots["exp_avg"][name].shape == arr.shape
        np.testing.assert_array_equal(state.params[name], arr)
    longer = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=9))
    resumed = Trainer(longer, mesh=mesh, log=lambda *a: None)
    try:
        assert resumed.step == 6
        for name, arr in resumed.params.to_host_dict().items():
            np.testing.assert_array_equal(arr, params[name])
    finally:
        resumed.close()


def test_keep_removes_whole_sets_and_a_save_that_never_committed_is_cleared(tmp_path, mesh):
    run(job(tmp_path, steps=12, keep=2), mesh)
    assert folder_listing(tmp_path / "ck") == ["ckpt-00000009.h5", "ckpt-00000009.shards", "ckpt-00000012.h5",
                                               "ckpt-00000012.shards"]
    os.mkdir(tmp_path / "ck" / "ckpt-00000015.0123456789abcdef.shards")  # a killed save's shards, no index
    run(job(tmp_path, steps=15, keep=2), mesh)
    assert folder_listing(tmp_path / "ck") == ["ckpt-00000012.h5", "ckpt-00000012.shards", "ckpt-00000015.h5",
                                               "ckpt-00000015.shards"]


def _damage(kind, path):
    if kind == "missing":
        os.remove(path)
    elif kind == "zero-length":
        open(path, "w").close()
    elif kind == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
    elif kind == "flipped byte":
        with h5py.File(path, "r") as f:
            at = f["values"].id.get_offset() + 17
        with open(path, "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x40]))
    elif kind == "symlink":
        os.rename(path, path + ".real")
        os.symlink(path + ".real", path)
    elif kind == "fifo":
        os.remove(path)
        os.mkfifo(path)


EXPECTED = {"missing": "does not exist", "zero-length": "is not an HDF5 file", "truncated": "truncated",
            "flipped byte": "fails its sha256", "symlink": "is a symbolic link", "fifo": "not a regular file"}


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_a_damaged_shard_is_one_line_naming_it_and_auto_resumes_the_previous_set(tmp_path, mesh, kind):
    run(job(tmp_path), mesh)
    shard = shard_of(tmp_path, 6)
    _damage(kind, shard)
    index = str(tmp_path / "ck" / "ckpt-00000006.h5")
    from hpctrain.nn import make_model

    layout = make_model(job(tmp_path).model).layout
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(index, layout)
    assert EXPECTED[kind] in str(e.value) and "rank-00000.h5" in str(e.value) and "\n" not in str(e.value)
    text, ok = inspect(index)
    assert not ok and EXPECTED[kind] in text
    lines = []
    t = run(job(tmp_path, steps=6), mesh, lines.append)  # resume = "auto": step 6 fails, step 3 loads
    assert any(line.startswith("resume: skipping ckpt-00000006.h5:") and EXPECTED[kind] in line for line in lines)
    assert any("resuming from" in line and "ckpt-00000003.h5 at step 3" in line for line in lines), lines
    assert os.path.exists(index + ".skipped") and t.step == 6


def _forge_manifest(index, change):
    with h5py.File(index, "r+") as f:
        import hashlib
        import json

        m = json.loads(f["manifest"][()].tobytes())
        change(m)
        raw = np.frombuffer(json.dumps(m).encode(), dtype=np.uint8)
        del f["manifest"]
        ds = f.create_dataset("manifest", data=raw)
        fmt.set_attr(ds.attrs, "sha256", hashlib.sha256(raw.tobytes()).hexdigest())


@pytest.mark.parametrize("change,expected", [
    (lambda m: m.update(folder="../elsewhere.shards"), "may not point outside the checkpoint's folder"),
    (lambda m: m["shards"].__setitem__(0, "../../etc/passwd"), "may not point outside the set's folder"),
    (lambda m: m["pieces"].pop(), "is in no shard"),
    (lambda m: m.update(set_id="0" * 16), "names another set"),
], ids=["folder", "shard", "uncovered", "set-id"])
def test_a_forged_manifest_is_refused(tmp_path, mesh, change, expected):
    t = run(job(tmp_path, steps=3), mesh)
    index = str(tmp_path / "ck" / "ckpt-00000003.h5")
    _forge_manifest(index, change)
    with pytest.raises(CheckpointError, match=expected):
        load_checkpoint(index, t.model.layout)


def test_a_shard_from_another_checkpoint_is_refused(tmp_path, mesh):
    t = run(job(tmp_path), mesh)
    os.replace(shard_of(tmp_path, 3), shard_of(tmp_path, 6))  # step 3's shard in step 6's set
    with pytest.raises(CheckpointError, match=r"rank-00000.h5 belongs to another checkpoint \(set [0-9a-f]{16}, "
                                              r"the index names set [0-9a-f]{16}\)"):
        load_checkpoint(str(tmp_path / "ck" / "ckpt-00000006.h5"), t.model.layout)


def test_an_explicit_damaged_checkpoint_is_refused_by_the_command_with_exit_2(tmp_path):
    make_classification(tmp_path / "d.h5", n=96)
    (tmp_path / "job.toml").write_text(job_toml(tmp_path))
    assert subprocess.run([sys.executable, "-m", "hpctrain", "train", str(tmp_path / "job.toml")], cwd=ROOT,
                          capture_output=True, timeout=120).returncode == 0
    _damage("flipped byte", shard_of(tmp_path, 6))
    (tmp_path / "job.toml").write_text(job_toml(tmp_path, resume=str(tmp_path / "ck" / "ckpt-00000006.h5")))
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "train", str(tmp_path / "job.toml")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpctrain: error")]
    assert len(errors) == 1 and "fails its sha256" in errors[0] and "rank-00000.h5" in errors[0], proc.stderr


def job_toml(tmp_path, **checkpoint):
    from helpers import toml_job

    return toml_job(optim=ADAMW, train={"steps": 9}, checkpoint={"dir": "ck", "every": 3, **checkpoint})


def test_older_single_file_checkpoints_still_resume(tmp_path, mesh):
    t = run(job(tmp_path, steps=3), mesh)
    state = load_checkpoint(str(tmp_path / "ck" / "ckpt-00000003.h5"), t.model.layout)
    old = tmp_path / "old"
    save_checkpoint(str(old), state, keep=1)  # one file, format version 2
    with h5py.File(old / "ckpt-00000003.h5", "r") as f:
        assert f.attrs["version"] == 2
    lines = []
    resumed = run(job(tmp_path, steps=6, dir=str(old)), mesh, lines.append)
    straight = run(job(tmp_path, steps=6, dir=""), mesh)
    assert any("resuming from" in line and "at step 3" in line for line in lines)
    for name, arr in straight.params.to_host_dict().items():
        np.testing.assert_array_equal(resumed.params.to_host_dict()[name], arr, err_msg=name)


KILL_SCRIPT = """
import os, signal, sys
from mpi4py import MPI
import hpctrain.checkpoint.sharded as sharded
from hpctrain.cli import main
victim = int(sys.argv[2])
write = sharded.write_shard
def write_then_die(path, **kw):
    if kw["step"] == 6 and MPI.COMM_WORLD.rank == victim:  # the second checkpoint: its shard half written
        with open(path, "wb") as f:
            f.write(b"half")
        os.kill(os.getpid(), signal.SIGKILL)
    return write(path, **kw)
sharded.write_shard = write_then_die
sys.exit(main(["train", sys.argv[1]]))
"""


def test_kill_9_during_a_sharded_save_leaves_the_previous_set_newest_and_intact(tmp_path):
    make_classification(tmp_path / "d.h5", n=96)
    (tmp_path / "job.toml").write_text(job_toml(tmp_path))
    proc = subprocess.run([sys.executable, "-c", KILL_SCRIPT, str(tmp_path / "job.toml"), "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert [s for s, _ in list_checkpoints(str(tmp_path / "ck"))] == [3]
    assert folder_listing(tmp_path / "ck") == ["ckpt-00000003.h5", "ckpt-00000003.shards", "ckpt-00000006.shards",
                                               "hpctrain.lock"]
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "train", str(tmp_path / "job.toml")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ckpt-00000003.h5 at step 3" in proc.stdout, proc.stdout + proc.stderr
    assert [s for s, _ in list_checkpoints(str(tmp_path / "ck"))] == [3, 6, 9]
    assert len([n for n in folder_listing(tmp_path / "ck") if n.endswith(".shards")]) == 3  # the orphan is gone


def test_a_failing_writer_thread_ends_the_run_with_one_message_and_keeps_the_previous_checkpoint(tmp_path, mesh,
                                                                                                  monkeypatch):
    import errno

    from hpctrain.checkpoint import sharded

    write = sharded.write_shard

    def full_disk(path, **kw):
        if kw["step"] == 6:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(path, **kw)

    monkeypatch.setattr(sharded, "write_shard", full_disk)
    t = Trainer(job(tmp_path, steps=9), mesh=mesh, log=lambda *a: None)
    try:
        with pytest.raises(CheckpointError, match=r"^rank 0: cannot write checkpoint shard .*rank-00000.h5: "
                                                  r"\[Errno 28\] No space left on device"):
            t.run()
    finally:
        t.close()
    assert [s for s, _ in list_checkpoints(str(tmp_path / "ck"))] == [3]


def test_the_documented_sharded_snippet_runs(tmp_path, mesh):
    """docs/checkpoint-format.md's plain-h5py reader of a sharded checkpoint, run as written."""
    run(job(tmp_path, steps=3), mesh)
    doc = open(os.path.join(ROOT, "docs", "checkpoint-format.md")).read()
    code = doc.split("## Reading a checkpoint with plain h5py")[1].split("```python")[3].split("```")[0]
    code = code.replace('"ckpt-00001200.h5"', repr(str(tmp_path / "ck" / "ckpt-00000003.h5")))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("verified ['0.bias', '0.weight']"), proc.stdout


def test_a_shards_folder_that_is_a_symlink_is_refused(tmp_path, mesh):
    t = run(job(tmp_path, steps=3), mesh)
    folder = os.path.dirname(shard_of(tmp_path, 3))
    os.rename(folder, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", folder)
    with pytest.raises(CheckpointError, match=r"the shards' folder .* is a symbolic link"):
        load_checkpoint(str(tmp_path / "ck" / "ckpt-00000003.h5"), t.model.layout)


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found (pip install hpctrain[mpich])")
@pytest.mark.parametrize("background", [True, False], ids=["async", "sync"])
def test_kill_9_of_one_rank_during_a_sharded_save_keeps_the_previous_set(tmp_path, background):
    from launch import launcher_env, mpi_command

    make_classification(tmp_path / "d.h5", n=96)
    from helpers import toml_job

    (tmp_path / "job.toml").write_text(toml_job(  # zero = 1: every rank writes a shard, rank 1 too
        optim=ADAMW, train={"steps": 9}, parallel={"zero": 1},
        checkpoint={"dir": "ck", "every": 3, "async": background}))
    proc = subprocess.run(mpi_command(shutil.which("mpiexec"), 2, sys.executable, "-c", KILL_SCRIPT,
                                      str(tmp_path / "job.toml"), "1"), cwd=ROOT, env=launcher_env({"PYTHONPATH": ROOT}),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert [s for s, _ in list_checkpoints(str(tmp_path / "ck"))] == [3]
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "train", str(tmp_path / "job.toml")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # any layout resumes it: here one process
    assert proc.returncode == 0 and "ckpt-00000003.h5 at step 3" in proc.stdout, proc.stdout + proc.stderr
    assert [s for s, _ in list_checkpoints(str(tmp_path / "ck"))] == [3, 6, 9]


def test_a_background_save_is_committed_by_close(tmp_path):
    """``save_checkpoint(background=True)`` from a loop of one's own (train_step, no run()) and then close(): the
    set is committed, not left as shards without an index."""
    from hpctrain.checkpoint import list_checkpoints, load_checkpoint
    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer

    make_classification(tmp_path / "d.h5", n=96)
    mesh = Mesh()
    try:
        t = Trainer(config(tmp_path / "d.h5", checkpoint={"dir": str(tmp_path / "ck")}), mesh=mesh,
                    log=lambda *a: None)
        for step in range(3):
            t.train_step(step, 0.1)
        t.step = 3
        assert t.save_checkpoint(background=True) == ""  # written by a thread, not yet committed
        t.close()
    finally:
        mesh.free()
    found = list_checkpoints(str(tmp_path / "ck"))
    assert [step for step, _ in found] == [3], found
    assert load_checkpoint(found[-1][1], t.model.layout).step == 3
