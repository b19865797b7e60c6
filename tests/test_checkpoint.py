"""Checkpoints: round trip, integrity checks, retention, resume, crash safety, inspect (one process)."""

import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from hpctrain import checkpoint as ckpt
from hpctrain.checkpoint import format as fmt
from hpctrain.checkpoint import CheckpointState, find_resume, inspect, load_checkpoint, load_weights, save_checkpoint
from hpctrain.errors import CheckpointError, NewerFormatError
from hpctrain.params import ParamLayout

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

SHAPES = [("0.weight", (8, 4)), ("0.bias", (8,)), ("2.weight", (3, 8)), ("2.bias", (3,))]
SLOTS = {"sgd": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq"), "adamw": ("exp_avg", "exp_avg_sq")}


def make_state(step, *, optim="adam", shapes=SHAPES, slots=None):
    """A deterministic state for ``step``: the arrays depend on the step, so files can be told apart."""
    rng = np.random.default_rng(step)
    layout = ParamLayout(shapes)

    def tensors():
        return {s.name: rng.standard_normal(s.shape, dtype=np.float32) for s in layout}

    slot_names = SLOTS[optim] if slots is None else slots
    state = CheckpointState(step=step, epoch=step // 10, data_position=step % 10,
                            config_text=f"[train]\nsteps = 100\n# step {step}\n",
                            layout=dict(world_size=2, dp=2, pp=1, tp=1), params=tensors(), optim_name=optim,
                            optim_step=max(0, step - 1), slots={k: tensors() for k in slot_names},
                            rng=dict(data_seed=7, shuffle=True, train_seed=3, sampler="epoch-permutation"))
    for arr in state.slots.get("exp_avg_sq", {}).values():  # a mean of squares: the loaders refuse negative values
        np.abs(arr, out=arr)
    return state


@pytest.fixture
def layout():
    return ParamLayout(SHAPES)


def assert_same_state(got, want):
    for key in ("step", "epoch", "data_position", "config_text", "layout", "optim_name", "optim_step", "rng"):
        assert getattr(got, key) == getattr(want, key), key
    assert list(got.params) == list(want.params)
    assert set(got.slots) == set(want.slots)
    for name, arr in want.params.items():
        assert got.params[name].dtype == np.float32 and got.params[name].shape == arr.shape
        assert np.array_equal(got.params[name].view(np.uint32), arr.view(np.uint32)), name
    for slot, tensors in want.slots.items():
        for name, arr in tensors.items():
            assert np.array_equal(got.slots[slot][name].view(np.uint32), arr.view(np.uint32)), (slot, name)


def snapshot(directory):
    """Name -> (sha256, mtime_ns) of every file: what 'nothing on disk changed' compares."""
    out = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        with open(path, "rb") as f:
            out[name] = (hashlib.sha256(f.read()).hexdigest(), os.stat(path).st_mtime_ns)
    return out


def flip_in_dataset(path, dataset, *, where=0.5):
    """Flip one byte inside ``dataset``'s stored data (not its metadata)."""
    with h5py.File(path, "r") as f:
        ds = f[dataset]
        offset, size = ds.id.get_offset(), ds.id.get_storage_size()
    at = offset + int(size * where)
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x5A]))


# --------------------------------------------------------------------------- round trip and format


def test_round_trip_is_bit_exact(tmp_path, layout):
    state = make_state(7)
    w = state.params["0.weight"]
    w[0, :3] = np.array([0x80000000, 0x00000001, 0x7F7FFFFF], dtype=np.uint32).view(np.float32)  # -0, denormal, max
    m = state.slots["exp_avg"]["0.weight"]
    m[0, :2] = np.array([0x80000001, 0xFF7FFFFF], dtype=np.uint32).view(np.float32)  # -denormal, -max (NaN is refused)
    path = save_checkpoint(str(tmp_path), state, keep=3)
    assert os.path.basename(path) == "ckpt-00000007.h5"
    assert os.listdir(tmp_path) == ["ckpt-00000007.h5"]
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~umask  # like any new file, not a temp file's 0600
    got = load_checkpoint(path, layout, optim_name="adam")
    assert_same_state(got, state)
    assert got.path == path
    assert isinstance(got.rng["shuffle"], bool) and isinstance(got.rng["data_seed"], int)


@pytest.mark.parametrize("optim,slots", [("sgd", ("momentum_buffer",)), ("sgd", ()), ("adamw", None)])
def test_round_trip_other_optimizers(tmp_path, layout, optim, slots):
    state = make_state(3, optim=optim, slots=slots)
    got = load_checkpoint(save_checkpoint(str(tmp_path), state, keep=1), layout, optim_name=optim)
    assert_same_state(got, state)


def test_plain_h5py_reads_the_documented_layout(tmp_path):
    """What docs/checkpoint-format.md promises a reader without hpctrain."""
    state = make_state(12)
    path = save_checkpoint(str(tmp_path), state, keep=1)
    with h5py.File(path, "r") as f:
        # strings are fixed-length UTF-8: h5py gives bytes
        a = {k: v.decode("utf-8") if isinstance(v, bytes) else v.item() for k, v in f.attrs.items()}
        assert a["format"] == "hpctrain-checkpoint" and a["version"] == 2 and a["checksum"] == "sha256"
        assert (a["step"], a["epoch"], a["data_position"]) == (12, 1, 2)
        assert (a["world_size"], a["dp"], a["pp"], a["tp"]) == (2, 2, 1, 1)
        assert a["optimizer"] == "adam" and a["optimizer_step"] == 11
        assert a["config"] == state.config_text and a["rng_data_seed"] == 7 and a["rng_shuffle"] is True
        meta = {k: v for k, v in a.items() if k != "attrs_sha256"}
        text = json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        assert hashlib.sha256(text.encode("utf-8")).hexdigest() == a["attrs_sha256"]
        assert b"GCOL" not in open(path, "rb").read()  # no global heap: HDF5 does not checksum one
        assert list(f["params"]) == [n for n, _ in SHAPES]  # forward order, like state_dict()
        assert sorted(f["optim"]) == ["exp_avg", "exp_avg_sq"]
        for group, tensors in [("params", state.params), ("optim/exp_avg", state.slots["exp_avg"])]:
            for name, ds in f[group].items():
                assert ds.dtype == np.dtype("<f4") and ds.chunks is None and ds.compression is None
                data = ds[()]
                assert hashlib.sha256(data.tobytes()).hexdigest() == ds.attrs["sha256"].decode()
                assert np.array_equal(data, tensors[name])


def test_save_rejects_bad_states_before_writing(tmp_path):
    bad = make_state(1)
    bad.params["0.bias"] = bad.params["0.bias"].astype(np.float64)
    with pytest.raises(TypeError, match=r"params\['0.bias'\] must be float32"):
        save_checkpoint(str(tmp_path), bad, keep=1)
    bad = make_state(1)
    del bad.slots["exp_avg"]["2.bias"]
    with pytest.raises(ValueError, match="2.bias"):
        save_checkpoint(str(tmp_path), bad, keep=1)
    bad = make_state(1)
    bad.slots = {"exp_avg": bad.slots["exp_avg"]}
    with pytest.raises(ValueError, match="missing exp_avg_sq"):
        save_checkpoint(str(tmp_path), bad, keep=1)
    bad = make_state(1)
    bad.layout = dict(world_size=4, dp=2, pp=1, tp=1)
    with pytest.raises(ValueError, match="world_size"):
        save_checkpoint(str(tmp_path), bad, keep=1)
    with pytest.raises(ValueError, match="keep"):
        save_checkpoint(str(tmp_path), make_state(1), keep=0)
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------- integrity


def test_flipped_bytes_in_data_are_detected(tmp_path, layout):
    path = save_checkpoint(str(tmp_path / "good"), make_state(5), keep=1)
    for dataset in ("params/2.weight", "optim/exp_avg_sq/0.bias"):
        bad = str(tmp_path / f"bad-{dataset.replace('/', '_')}.h5")
        shutil.copy(path, bad)
        flip_in_dataset(bad, dataset)
        with pytest.raises(CheckpointError) as e:
            load_checkpoint(bad, layout)
        assert bad in str(e.value) and f"/{dataset}: sha256 mismatch" in str(e.value)
        if dataset.startswith("params"):  # load_weights reads /params only
            with pytest.raises(CheckpointError, match="sha256 mismatch"):
                load_weights(bad, layout)
        text, ok = inspect(bad)
        assert not ok and f"/{dataset}: sha256 mismatch" in text


def test_random_byte_flips_never_load_wrong_data(tmp_path, layout):
    """Anywhere in the file, a flipped byte is either harmless (unused bytes) or a CheckpointError."""
    state = make_state(9)
    path = save_checkpoint(str(tmp_path / "good"), state, keep=1)
    size = os.path.getsize(path)
    bad = str(tmp_path / "bad.h5")
    rnd = random.Random(1234)
    outcomes = {"error": 0, "same": 0}
    for trial in range(60):
        shutil.copy(path, bad)
        at = rnd.randrange(size)
        with open(bad, "r+b") as f:
            f.seek(at)
            byte = f.read(1)[0]
            f.seek(at)
            f.write(bytes([byte ^ (1 << rnd.randrange(8))]))
        try:
            got = load_checkpoint(bad, layout)
        except CheckpointError:
            outcomes["error"] += 1
            continue
        assert_same_state(got, state)  # flip landed in padding or an unused field
        outcomes["same"] += 1
    assert outcomes["error"] > 0


@pytest.mark.parametrize("keep_fraction", [0.5, 0.98])
def test_truncated_file_is_rejected(tmp_path, layout, keep_fraction):
    path = save_checkpoint(str(tmp_path), make_state(4), keep=1)
    bad = str(tmp_path / "truncated.h5")
    with open(path, "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read(int(os.path.getsize(path) * keep_fraction)))
    with pytest.raises(CheckpointError, match="truncated") as e:
        load_checkpoint(bad, layout)
    assert bad in str(e.value)
    assert inspect(bad)[1] is False


def test_missing_and_non_hdf5_files(tmp_path, layout):
    with pytest.raises(CheckpointError, match=r"checkpoint .*nope.h5 does not exist"):
        load_checkpoint(str(tmp_path / "nope.h5"), layout)
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"this is not HDF5 at all\n" * 100)
    with pytest.raises(CheckpointError, match=r"junk.h5 is not an HDF5 file"):
        load_checkpoint(str(junk), layout)
    with pytest.raises(CheckpointError, match="is not an HDF5 file"):
        load_weights(str(junk), layout)
    text, ok = inspect(str(tmp_path / "nope.h5"))
    assert not ok and "does not exist" in text


def _edit_attr(path, key, value):
    with h5py.File(path, "r+") as f:
        f.attrs[key] = value


@pytest.mark.parametrize("key", ["step", "optimizer_step"])
def test_counters_beyond_int64_are_refused(tmp_path, layout, key):
    path = save_checkpoint(str(tmp_path), make_state(2), keep=1)
    with h5py.File(path, "r+") as f:
        f.attrs[key] = np.uint64(2**63 + 5)
        f.attrs["attrs_sha256"] = fmt.attrs_digest(f.attrs)  # a consistent file, just out of range
    with pytest.raises(CheckpointError, match=rf"root attribute '{key}' = .*expected an integer in \[0, 2\*\*63 - 1\]"):
        load_checkpoint(path, layout)


def test_wrong_format_attribute(tmp_path, layout):
    path = save_checkpoint(str(tmp_path), make_state(2), keep=1)
    _edit_attr(path, "format", "someone-elses-format")
    with pytest.raises(CheckpointError, match=r"format attribute .*someone-elses-format.*expected 'hpctrain-checkpoint'"):
        load_checkpoint(path, layout)
    with pytest.raises(CheckpointError, match="format attribute"):
        load_weights(path, layout)
    assert inspect(path)[1] is False


def test_newer_version_is_refused(tmp_path, layout):
    path = save_checkpoint(str(tmp_path), make_state(2), keep=1)
    _edit_attr(path, "version", np.int64(fmt.VERSION + 1))
    with pytest.raises(CheckpointError, match=rf"written by a newer hpctrain \(format version {fmt.VERSION + 1}"):
        load_checkpoint(path, layout)
    with pytest.raises(CheckpointError, match="written by a newer hpctrain"):
        load_weights(path, layout)
    text, ok = inspect(path)
    assert not ok and "newer hpctrain" in text


def test_damaged_root_attribute_text_is_detected(tmp_path, layout):
    """Strings live in the object header, which HDF5 checksums; attrs_sha256 covers them besides."""
    path = save_checkpoint(str(tmp_path), make_state(12), keep=1)
    data = bytearray(open(path, "rb").read())
    at = data.index(b"# step 12")
    data[at + 7] = ord("3")  # the config now reads "# step 13"
    open(path, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="is damaged: .*checksum"):
        load_checkpoint(path, layout)
    text, ok = inspect(path)
    assert not ok and "checksum" in text


def make_version_1(path):
    """Rewrite a checkpoint as format 1 wrote it: every string attribute variable-length (h5py's default)."""
    with h5py.File(path, "r+") as f:
        for obj in [f] + [ds for g in ("params", "optim/exp_avg", "optim/exp_avg_sq") for ds in f[g].values()]:
            for key, value in list(obj.attrs.items()):
                if isinstance(value, bytes):
                    obj.attrs[key] = value.decode()
        f.attrs["version"] = np.int64(1)
        f.attrs["attrs_sha256"] = fmt.attrs_digest(f.attrs)
        assert isinstance(f.attrs["config"], str)


def test_version_1_files_with_variable_length_strings_still_load(tmp_path, layout):
    path = save_checkpoint(str(tmp_path), make_state(9), keep=1)
    make_version_1(path)
    assert_same_state(load_checkpoint(path, layout), make_state(9))
    text, ok = inspect(path)
    assert ok and "format version 1" in text, text


@pytest.mark.parametrize("version", [1, 2])
def test_the_documented_h5py_snippet_runs(tmp_path, version):
    """docs/checkpoint-format.md's plain-h5py reader, run as written, on both format versions."""
    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "checkpoint-format.md")).read()
    code = doc.split("## Reading a checkpoint with plain h5py")[1].split("```python")[1].split("```")[0]
    path = save_checkpoint(str(tmp_path), make_state(1200), keep=1)
    if version == 1:
        make_version_1(path)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("1200 adam 1199"), proc.stdout


def test_rewritten_root_attribute_fails_attrs_sha256(tmp_path, layout):
    """An attribute changed through HDF5 itself (valid metadata, stale digest) is caught by attrs_sha256."""
    path = save_checkpoint(str(tmp_path), make_state(12), keep=1)
    with h5py.File(path, "r+") as f:
        f.attrs["epoch"] = np.int64(5)
    with pytest.raises(CheckpointError, match="root attributes fail their checksum"):
        load_checkpoint(path, layout)
    text, ok = inspect(path)
    assert not ok and "attrs_sha256" in text


@pytest.mark.parametrize("edit, problem", [
    (lambda f: f.__delitem__("optim/exp_avg_sq"), "missing exp_avg_sq"),
    (lambda f: f.__delitem__("optim"), "missing exp_avg, exp_avg_sq"),
    (lambda f: f.copy("optim/exp_avg", "optim/bogus"), "unexpected bogus"),
])
def test_inspect_checks_the_slots_against_the_optimizer(tmp_path, edit, problem):
    path = save_checkpoint(str(tmp_path), make_state(4), keep=1)
    with h5py.File(path, "r+") as f:
        edit(f)
    text, ok = inspect(path)
    assert not ok and problem in text, text


def test_non_finite_weights_are_refused(tmp_path, layout):
    """Loaders, inspect and the writer agree: weights with NaN or Inf are no starting point."""
    state = make_state(4)
    state.params["2.weight"][0, 0] = np.nan
    ckpt.save_weights(str(tmp_path / "w.h5"), state.params)
    with pytest.raises(CheckpointError, match=r"/params/2.weight: 1 non-finite value"):
        load_weights(str(tmp_path / "w.h5"), layout)
    text, ok = inspect(str(tmp_path / "w.h5"))
    assert not ok and "/params/2.weight: 1 non-finite value" in text
    with pytest.raises(CheckpointError, match=r"step 4: parameter 2.weight has 1 non-finite value.*no checkpoint written"):
        save_checkpoint(str(tmp_path / "ck"), state, keep=1)
    assert not os.path.exists(tmp_path / "ck") or os.listdir(tmp_path / "ck") == []


def test_missing_root_attribute(tmp_path, layout):
    path = save_checkpoint(str(tmp_path), make_state(2), keep=1)
    with h5py.File(path, "r+") as f:
        del f.attrs["data_position"]
    with pytest.raises(CheckpointError, match="no root attribute 'data_position'"):
        load_checkpoint(path, layout)


def test_checkpoint_of_a_different_model_lists_the_differences(tmp_path):
    path = save_checkpoint(str(tmp_path), make_state(2), keep=1)
    other = ParamLayout([("0.weight", (16, 4)), ("0.bias", (16,)), ("2.weight", (3, 16)), ("2.bias", (3,)),
                         ("4.weight", (2, 3)), ("4.bias", (2,))])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, other)
    msg = str(e.value)
    assert path in msg and "does not fit the model" in msg
    assert "missing 4.weight, 4.bias" in msg
    assert "0.weight has shape (8, 4), the model needs (16, 4)" in msg
    assert "2.weight has shape (3, 8), the model needs (3, 16)" in msg
    assert "/optim/exp_avg" in msg  # the slots differ the same way, said once
    fewer = ParamLayout(SHAPES[:2])
    with pytest.raises(CheckpointError, match="unexpected 2.bias, 2.weight"):
        load_checkpoint(path, fewer)
    with pytest.raises(CheckpointError, match="missing 4.weight, 4.bias"):
        load_weights(path, other)


def test_optimizer_mismatch(tmp_path, layout):
    path = save_checkpoint(str(tmp_path), make_state(2, optim="adam"), keep=1)
    with pytest.raises(CheckpointError, match="holds adam optimizer state but the optimizer is sgd.*checkpoint.init"):
        load_checkpoint(path, layout, optim_name="sgd")


def test_failing_loads_change_nothing_on_disk(tmp_path, layout):
    save_checkpoint(str(tmp_path), make_state(1), keep=5)
    bad = save_checkpoint(str(tmp_path), make_state(2), keep=5)
    flip_in_dataset(bad, "params/0.weight")
    shutil.copy(bad, tmp_path / "copy.h5")
    with h5py.File(tmp_path / "copy.h5", "r+") as f:
        f.attrs["version"] = np.int64(9)
    before = snapshot(tmp_path)
    time.sleep(0.01)
    for path, lay in [(bad, layout), (str(tmp_path / "copy.h5"), layout), (bad, ParamLayout(SHAPES[:1]))]:
        with pytest.raises(CheckpointError):
            load_checkpoint(path, lay)
        with pytest.raises(CheckpointError):
            load_weights(path, lay)
        inspect(path)
    assert snapshot(tmp_path) == before
    # resume = "auto" sets the damaged newer file aside, under another name, byte for byte
    assert find_resume(str(tmp_path), layout, lambda msg: None).step == 1
    before["ckpt-00000002.h5.skipped"] = before.pop("ckpt-00000002.h5")
    assert snapshot(tmp_path) == before


# --------------------------------------------------------------------------- retention and resume


def test_keep_retains_the_newest(tmp_path, layout):
    for step in (10, 20, 30, 40, 50):
        save_checkpoint(str(tmp_path), make_state(step), keep=2)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000040.h5", "ckpt-00000050.h5"]
    save_checkpoint(str(tmp_path), make_state(60), keep=1)
    assert os.listdir(tmp_path) == ["ckpt-00000060.h5"]
    # a run resumed from an older step prunes only below its own step: newer files are never deleted
    save_checkpoint(str(tmp_path), make_state(5), keep=1)
    save_checkpoint(str(tmp_path), make_state(6), keep=1)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000006.h5", "ckpt-00000060.h5"]
    path = save_checkpoint(str(tmp_path), make_state(6), keep=3)  # same step again: replaced in place
    assert_same_state(load_checkpoint(path, layout), make_state(6))
    assert ckpt.list_checkpoints(str(tmp_path))[0] == (6, path)


def test_find_resume_takes_the_newest(tmp_path, layout):
    logs = []
    assert find_resume(str(tmp_path / "missing"), layout, logs.append) is None
    assert find_resume(str(tmp_path), layout, logs.append) is None
    for step in (100, 200, 300):
        save_checkpoint(str(tmp_path), make_state(step), keep=5)
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    (tmp_path / "ckpt-latest.h5").write_bytes(b"")  # does not match ckpt-<digits>.h5: ignored
    got = find_resume(str(tmp_path), layout, logs.append)
    assert_same_state(got, make_state(300))
    assert logs == []


def test_find_resume_falls_back_past_a_corrupt_newest_file(tmp_path, layout):
    for step in (100, 200, 300):
        save_checkpoint(str(tmp_path), make_state(step), keep=5)
    flip_in_dataset(str(tmp_path / "ckpt-00000300.h5"), "optim/exp_avg/2.weight")
    with open(tmp_path / "ckpt-00000400.h5", "wb") as f:  # a newer file that is not even HDF5
        f.write(b"\0" * 1000)
    before = snapshot(tmp_path)
    logs = []
    got = find_resume(str(tmp_path), layout, logs.append)
    assert_same_state(got, make_state(200))
    assert len(logs) == 3
    assert "skipping ckpt-00000400.h5" in logs[0] and "not an HDF5 file" in logs[0]
    assert "skipping ckpt-00000300.h5" in logs[1] and "/optim/exp_avg/2.weight: sha256 mismatch" in logs[1]
    assert "using ckpt-00000200.h5 (step 200)" in logs[2] and "ckpt-00000400.h5, ckpt-00000300.h5" in logs[2]
    for name in ("ckpt-00000300.h5", "ckpt-00000400.h5"):  # kept byte for byte, out of the resumed run's way
        before[name + ".skipped"] = before.pop(name)
    assert snapshot(tmp_path) == before
    assert [step for step, _ in ckpt.list_checkpoints(str(tmp_path))] == [100, 200]


def test_find_resume_stops_at_a_checkpoint_from_a_newer_hpctrain(tmp_path, layout):
    """A newer format is probably a good file: falling back past it would later overwrite it."""
    save_checkpoint(str(tmp_path), make_state(1), keep=5)
    newer = save_checkpoint(str(tmp_path), make_state(2), keep=5)
    with h5py.File(newer, "r+") as f:
        f.attrs["version"] = np.int64(9)
    before = snapshot(tmp_path)
    with pytest.raises(NewerFormatError, match=r"newer hpctrain .* does not fall back past it"):
        find_resume(str(tmp_path), layout, lambda msg: None)
    assert snapshot(tmp_path) == before


def test_find_resume_refuses_when_nothing_verifies(tmp_path, layout):
    path = save_checkpoint(str(tmp_path), make_state(100), keep=5)
    flip_in_dataset(path, "params/0.bias")
    logs = []
    with pytest.raises(CheckpointError, match=r"no checkpoint in .* verifies \(ckpt-00000100.h5"):
        find_resume(str(tmp_path), layout, logs.append)
    assert "skipping ckpt-00000100.h5" in logs[0]


# --------------------------------------------------------------------------- crash safety

_KILL_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from hpctrain import checkpoint
from hpctrain.checkpoint import format as checkpoint_format
from test_checkpoint import make_state
directory = sys.argv[1]
checkpoint.save_checkpoint(directory, make_state(1), keep=3)
written = []
real_write = checkpoint_format.write_dataset
def write_then_die(f, path, arr):
    real_write(f, path, arr)
    written.append(path)
    if len(written) == 5:  # half-way through the second checkpoint's datasets
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint_format.write_dataset = write_then_die
checkpoint.save_checkpoint(directory, make_state(2), keep=3)
print("not killed")
"""


def test_sigkill_mid_write_keeps_the_previous_checkpoint(tmp_path, layout):
    script = _KILL_SCRIPT.format(tests=HERE)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    names = sorted(os.listdir(tmp_path))
    temps = [n for n in names if n.endswith(".tmp")]
    assert len(temps) == 1 and temps[0].startswith(".ckpt-00000002.h5."), names  # the half-written file
    assert os.path.getsize(tmp_path / temps[0]) > 0
    assert ckpt.list_checkpoints(str(tmp_path)) == [(1, str(tmp_path / "ckpt-00000001.h5"))]
    logs = []
    got = find_resume(str(tmp_path), layout, logs.append)
    assert_same_state(got, make_state(1))
    assert logs == []  # the temp file is not a checkpoint: nothing to skip
    save_checkpoint(str(tmp_path), make_state(3), keep=3)  # the next save removes the dead writer's temp file
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000001.h5", "ckpt-00000003.h5"]


_LOOP_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from hpctrain import checkpoint
from test_checkpoint import BIG, make_state
state = make_state(1, shapes=BIG)
step = 0
while True:
    step += 1
    state.step = step
    state.params["0.bias"][:] = step  # tells the files apart at no cost, so nearly all the time goes to writing
    checkpoint.save_checkpoint(sys.argv[1], state, keep=2)
    print(step, flush=True)
"""
BIG = [("0.weight", (512, 1024)), ("0.bias", (512,)), ("2.weight", (1024, 512)), ("2.bias", (1024,))]  # 12 MiB a file


def test_sigkill_at_random_moments(tmp_path):
    """A writer looping over checkpoints, killed at random moments: every visible file is whole, resume finds the newest."""
    layout, rnd, mid_write = ParamLayout(BIG), random.Random(2024), 0
    for round_ in range(12):
        directory = tmp_path / f"round{round_}"
        proc = subprocess.Popen([sys.executable, "-c", _LOOP_SCRIPT.format(tests=HERE), str(directory)], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            first = proc.stdout.readline()  # one checkpoint is complete
            assert first.strip() == "1", proc.stderr.read() if proc.poll() is not None else first
            time.sleep(rnd.uniform(0.0, 0.4))
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=30)
            proc.stdout.close()
            proc.stderr.close()
        mid_write += any(name.endswith(".tmp") for name in os.listdir(directory))
        found = ckpt.list_checkpoints(str(directory))
        assert 1 <= len(found) <= 3  # keep=2, plus one if killed between the rename and the pruning
        for step, path in found:
            want = make_state(1, shapes=BIG)
            want.step = step
            want.params["0.bias"][:] = step
            assert_same_state(load_checkpoint(path, layout), want)
        assert find_resume(str(directory), layout, pytest.fail).step == found[-1][0]
        if mid_write >= 3:
            break
    assert mid_write >= 1, "no kill landed in the middle of a write"


# --------------------------------------------------------------------------- inspect and weights files


def test_inspect_reports_everything(tmp_path):
    state = make_state(42)
    path = save_checkpoint(str(tmp_path), state, keep=1)
    text, ok = inspect(path)
    assert ok
    for expected in ["hpctrain checkpoint, format version 2", "step 42, epoch 4, data position 2",
                     "world_size 2 = dp 2 x pp 1 x tp 1", "optimizer: adam, 41 optimizer steps",
                     "data_seed=7", "shuffle=True", "parameters: 4 tensors, 67 values",
                     "optimizer slot exp_avg: same names and shapes", "optimizer slot exp_avg_sq",
                     "checksums: 12 of 12 datasets verify (12 sha256)", "result: OK", "  steps = 100"]:
        assert expected in text, (expected, text)
    lines = text.splitlines()
    for name, shape in SHAPES:
        assert any(line.split()[:2] == [name, "x".join(map(str, shape))] for line in lines), name
    flip_in_dataset(path, "params/0.weight")
    text, ok = inspect(path)
    assert not ok
    assert "checksums: 11 of 12 datasets verify" in text and "/params/0.weight: sha256 mismatch" in text
    assert "result: FAILED" in text


def test_cli_inspect_exit_status(tmp_path, capsys):
    from hpctrain.cli import main

    path = save_checkpoint(str(tmp_path), make_state(1), keep=1)
    assert main(["inspect", path]) == 0
    assert "result: OK" in capsys.readouterr().out
    flip_in_dataset(path, "params/2.bias")
    assert main(["inspect", path]) == 1
    assert "sha256 mismatch" in capsys.readouterr().out


def test_weights_only_files(tmp_path, layout):
    state = make_state(3)
    weights = str(tmp_path / "w" / "final.h5")
    ckpt.save_weights(weights, state.params)
    got = load_weights(weights, layout)
    assert list(got) == list(state.params)
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(weights).st_mode & 0o777 == 0o666 & ~umask
    assert os.listdir(tmp_path / "w") == ["final.h5"]
    assert all(np.array_equal(got[k], v) for k, v in state.params.items())
    text, ok = inspect(weights)
    assert ok and "weights-only file" in text and "4 fletcher32" in text
    with pytest.raises(CheckpointError, match="weights-only file .*checkpoint.init"):
        load_checkpoint(weights, layout)
    assert find_resume(str(tmp_path / "w"), layout, print) is None  # final.h5 is not a ckpt-*.h5
    # a plain h5py weights file (any float type, no checksum) still loads
    plain = str(tmp_path / "plain.h5")
    with h5py.File(plain, "w") as f:
        for name, arr in state.params.items():
            f[f"params/{name}"] = arr.astype(np.float64)
    got = load_weights(plain, layout)
    assert all(got[k].dtype == np.float32 and np.array_equal(got[k], v) for k, v in state.params.items())
    text, ok = inspect(plain)
    assert ok and "4 none" in text


def test_load_weights_reads_a_full_checkpoint(tmp_path, layout):
    state = make_state(8)
    path = save_checkpoint(str(tmp_path), state, keep=1)
    got = load_weights(path, layout)
    assert list(got) == list(state.params)
    assert all(np.array_equal(got[k], v) for k, v in state.params.items())
    flip_in_dataset(path, "params/0.bias")
    with pytest.raises(CheckpointError, match=r"/params/0.bias: sha256 mismatch"):
        load_weights(path, layout)


def test_stale_temp_files_are_ignored_and_cleaned(tmp_path, layout, monkeypatch):
    save_checkpoint(str(tmp_path), make_state(1), keep=3)
    dead = tmp_path / f".ckpt-00000002.h5.{'otherhost'}.12345.abcdef.tmp"
    dead.write_bytes(b"\x89HDF half written")
    fresh = tmp_path / ".ckpt-00000002.h5.otherhost.12346.abcdeg.tmp"
    fresh.write_bytes(b"\x89HDF being written right now")
    old = time.time() - fmt.STALE_SECONDS - 60
    os.utime(dead, (old, old))
    assert find_resume(str(tmp_path), layout, pytest.fail).step == 1
    save_checkpoint(str(tmp_path), make_state(3), keep=3)
    assert sorted(os.listdir(tmp_path)) == [fresh.name, "ckpt-00000001.h5", "ckpt-00000003.h5"]


@pytest.mark.parametrize("name,momentum", [("adam", 0.0), ("sgd", 0.9)])
def test_optimizer_resumed_from_a_checkpoint_continues_exactly(tmp_path, layout, name, momentum):
    """Save an Optimizer's slots and step mid-run, restore them into a fresh one: the next steps match bit for bit."""
    from hpctrain.backend.cpu import CpuBackend
    from hpctrain.config import OptimConfig
    from hpctrain.optim import make_optimizer
    from hpctrain.params import FlatBuffer

    be, cfg = CpuBackend(), OptimConfig(name=name, lr=0.01, momentum=momentum)
    rng = np.random.default_rng(0)
    grads_seq = [rng.standard_normal(layout.size, dtype=np.float32) for _ in range(6)]

    def fresh():
        params, grads = FlatBuffer(be, layout), FlatBuffer(be, layout)
        params.load_host_dict(make_state(0).params)
        return make_optimizer(cfg, be, params, grads)

    def run(opt, steps):
        for g in steps:
            be.copy_(opt.grads.data, be.asarray(g))
            opt.step(0.01)

    straight = fresh()
    run(straight, grads_seq)

    first = fresh()
    run(first, grads_seq[:3])
    state = CheckpointState(step=3, epoch=0, data_position=3, config_text="", layout=dict(world_size=1, dp=1, pp=1, tp=1),
                            params=first.params.to_host_dict(), optim_name=first.name, optim_step=first.step_count,
                            slots={k: buf.to_host_dict() for k, buf in first.slots.items()})
    got = load_checkpoint(save_checkpoint(str(tmp_path), state, keep=1), layout, optim_name=name)
    second = fresh()
    second.params.load_host_dict(got.params)
    second.step_count = got.optim_step
    for slot, tensors in got.slots.items():
        second.slots[slot].load_host_dict(tensors)
    run(second, grads_seq[3:])
    assert np.array_equal(be.to_host(second.params.data), be.to_host(straight.params.data))
