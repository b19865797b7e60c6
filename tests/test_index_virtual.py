"""The index's own virtual datasets are checked (issue 52, build item 5 / fault 6).

hpctrain reads a sharded set's shards by the manifest, but a user following docs/checkpoint-format.md reads the
index with plain h5py and gets what its virtual datasets map. Before, an index re-pointed at a file outside the
set (an absolute path, ``../../../../../etc/passwd``), mapping other values of a shard, holding data of its own or
with a damaged mapping still inspected "OK, every checksum verifies", and resume, eval, export and predict used it.
Now ``inspect`` reports it and every reader refuses the index with one line.
"""

import os
import re
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from helpers import config, make_classification, run_trainer as run
from hpctrain.checkpoint import inspect, load_checkpoint, load_weights, sharded
from hpctrain.errors import CheckpointError

ADAMW = {"name": "adamw", "lr": 0.01}
WEIGHT = "params/0.weight"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, mesh):
    folder = tmp_path_factory.mktemp("pristine")
    make_classification(folder / "d.h5", n=32)
    cfg = config(folder / "d.h5", optim=ADAMW, train={"steps": 3}, checkpoint={"dir": str(folder / "ck"), "every": 3})
    t = run(cfg, mesh)
    return folder, t.model.layout


def _rebuild(index, *, source=None, shift=0, plain=False):
    """Replace the index's /params/0.weight: its mappings re-pointed at ``source``, its shard selections moved by
    ``shift`` values, or (``plain``) a dataset holding values of its own."""
    with h5py.File(index, "r+") as f:
        ds = f[WEIGHT]
        shape, maps = ds.shape, [(m.vspace, m.file_name, sharded._box(m.src_space)) for m in ds.virtual_sources()]
        del f[WEIGHT]
        if plain:
            f["params"].create_dataset("0.weight", data=np.full(shape, 7.0, dtype="<f4"))
            return
        dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
        for vspace, name, (start, count) in maps:
            src = h5py.h5s.create_simple((start[0] + count[0] + shift,))
            src.select_hyperslab((start[0] + shift,), count)
            dcpl.set_virtual(vspace, (source or name).encode(), b"values", src)
        h5py.h5d.create(f["params"].id, b"0.weight", h5py.h5t.IEEE_F32LE, h5py.h5s.create_simple(shape), dcpl=dcpl)


def _outside(tmp_path):
    other = tmp_path / "outside.h5"
    with h5py.File(other, "w") as f:
        f["values"] = np.full(10_000, 7.0, dtype="<f4")
    return str(other)


def _damaged_heap(index):
    """Flip a byte of every stored source name: HDF5 then finds its global heap block's checksum wrong."""
    raw = bytearray(open(index, "rb").read())
    folder = next(n for n in os.listdir(os.path.dirname(index)) if n.endswith(".shards"))
    for m in re.finditer(re.escape(folder.encode() + b"/rank"), bytes(raw)):
        raw[m.start() + 5] ^= 0x55
    with open(index, "wb") as f:
        f.write(raw)


CASES = {
    "absolute path": (lambda p, i: _rebuild(i, source=_outside(p)), "not /values of one of the set's own shards"),
    "../etc/passwd": (lambda p, i: _rebuild(i, source="../../../../../etc/passwd"),
                      "not /values of one of the set's own shards"),
    "other values": (lambda p, i: _rebuild(i, shift=1), "its virtual dataset's mappings are not those of the manifest"),
    "data of its own": (lambda p, i: _rebuild(i, plain=True), "is not a virtual dataset over the set's shards"),
    "damaged mapping": (lambda p, i: _damaged_heap(i), "the index is damaged"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_index_whose_virtual_datasets_are_not_the_manifests_is_refused_and_inspected(pristine, tmp_path, case):
    folder, layout = pristine
    shutil.copytree(folder / "ck", tmp_path / "ck")
    index = str(tmp_path / "ck" / "ckpt-00000003.h5")
    make, expected = CASES[case]
    make(tmp_path, index)
    text, ok = inspect(index)
    assert not ok and expected in text, text
    for load in (load_checkpoint, load_weights):
        with pytest.raises(CheckpointError, match=re.escape(expected)) as e:
            load(index, layout)
        assert "\n" not in str(e.value)


def test_resume_eval_export_and_predict_refuse_a_re_pointed_index_with_one_line(pristine, tmp_path):
    folder, _ = pristine
    shutil.copytree(folder / "ck", tmp_path / "ck")
    index = str(tmp_path / "ck" / "ckpt-00000003.h5")
    with h5py.File(index, "r") as f:
        good = f[WEIGHT][...]
    _rebuild(index, source=_outside(tmp_path))
    with h5py.File(index, "r") as f:  # what a reader with plain h5py would take for the weights
        assert (f[WEIGHT][...] == 7.0).all() and not (good == 7.0).all()
    expected = "not /values of one of the set's own shards"
    for args in (["export", index, str(tmp_path / "o.h5")],
                 ["predict", index, "--data", str(folder / "d.h5"), "--out", str(tmp_path / "p.h5")],
                 ["eval", index]):
        proc = subprocess.run([sys.executable, "-m", "hpctrain", *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], (args, proc.stderr[-2000:])
    assert not os.path.exists(tmp_path / "o.h5") and not os.path.exists(tmp_path / "p.h5")


def test_resume_auto_skips_a_re_pointed_index_and_takes_the_one_before(pristine, tmp_path, mesh):
    folder, _ = pristine
    make_classification(tmp_path / "d.h5", n=32)
    cfg = config(tmp_path / "d.h5", optim=ADAMW, train={"steps": 6}, checkpoint={"dir": str(tmp_path / "ck"),
                                                                                 "every": 3})
    run(cfg, mesh)
    _rebuild(str(tmp_path / "ck" / "ckpt-00000006.h5"), source="../../../../../etc/passwd")
    lines = []
    t = run(cfg, mesh, lines.append)
    assert any(line.startswith("resume: skipping ckpt-00000006.h5:") and "set's own shards" in line
               for line in lines), lines
    assert t.step == 6 and os.path.exists(tmp_path / "ck" / "ckpt-00000006.h5.skipped")


@pytest.mark.parametrize("case", ["good", "absolute path", "../etc/passwd", "data of its own"])
def test_the_documented_check_of_the_virtual_datasets_runs_and_catches_a_re_pointed_index(pristine, tmp_path, case):
    """docs/checkpoint-format.md's check for readers with plain h5py, run as written."""
    folder, _ = pristine
    shutil.copytree(folder / "ck", tmp_path / "ck")
    index = str(tmp_path / "ck" / "ckpt-00000003.h5")
    if case != "good":
        CASES[case][0](tmp_path, index)
    doc = open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "checkpoint-format.md")).read()
    code = doc.split("## Reading a checkpoint with plain h5py")[1].split("```python")[2].split("```")[0]
    assert "virtual_sources" in code
    code = code.replace('"ckpt-00001200.h5"', repr(index))
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (proc.returncode == 0) == (case == "good"), proc.stderr
    if case != "good":
        assert "AssertionError" in proc.stderr
