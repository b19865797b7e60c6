"""``hpctrain inspect`` reports, never raises, for every damaged set the resume tests build (issue 52, item 3).

Each damage below is one that ``load_checkpoint`` / ``resume = "auto"`` already refuses with one line
(tests/test_sharded_checkpoint.py); ``inspect`` must say the same and return ``ok = False``, and the command exit 1.
Before, a shard from another step or run gave ``AttributeError: 'NoneType' object has no attribute 'shape'``:
the shard cache kept ``(file, None, None)`` from the first refusal and the next buffer read used it.
"""

import os
import shutil
import subprocess
import sys

import h5py
import pytest

from helpers import config, make_classification, run_trainer as run
from hpctrain.checkpoint import format as fmt
from hpctrain.checkpoint import inspect, load_checkpoint
from hpctrain.errors import CheckpointError
from test_sharded_checkpoint import EXPECTED, _damage, _forge_manifest, shard_of

ADAMW = {"name": "adamw", "lr": 0.01}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory, mesh):
    folder = tmp_path_factory.mktemp("pristine")
    make_classification(folder / "d.h5", n=32)
    t = run(config(folder / "d.h5", optim=ADAMW, train={"steps": 6},
                   checkpoint={"dir": str(folder / "ck"), "every": 3}), mesh)
    return folder, t.model.layout


def _forge_attrs(index, **values):
    with h5py.File(index, "r+") as f:
        for key, value in values.items():
            fmt.set_attr(f.attrs, key, value)
        fmt.set_attr(f.attrs, fmt.ATTRS_DIGEST, fmt.attrs_digest(f.attrs))


def _other_step(tmp_path):
    os.replace(shard_of(tmp_path, 3), shard_of(tmp_path, 6))  # step 3's shard in step 6's set


def _other_run(tmp_path):
    other = tmp_path / "other"
    make_classification(other / "d.h5", n=32) if other.mkdir() is None else None
    from hpctrain.parallel.mesh import Mesh

    m = Mesh()
    try:
        run(config(other / "d.h5", optim=ADAMW, train={"steps": 6, "seed": 7},
                   checkpoint={"dir": str(other / "ck"), "every": 3}), m)
    finally:
        m.free()
    shutil.copy(shard_of(other, 6), shard_of(tmp_path, 6))


DAMAGES = {
    **{kind: (lambda p, kind=kind: _damage(kind, shard_of(p, 6)), EXPECTED[kind]) for kind in EXPECTED},
    "shard from another step": (_other_step, "belongs to another checkpoint"),
    "shard from another run": (_other_run, "belongs to another checkpoint"),
    "manifest folder outside": (lambda p: _forge_manifest(str(p / "ck" / "ckpt-00000006.h5"),
                                                          lambda m: m.update(folder="../elsewhere.shards")),
                                "may not point outside the checkpoint's folder"),
    "manifest shard outside": (lambda p: _forge_manifest(str(p / "ck" / "ckpt-00000006.h5"),
                                                         lambda m: m["shards"].__setitem__(0, "../../etc/passwd")),
                               "may not point outside the set's folder"),
    "manifest uncovered": (lambda p: _forge_manifest(str(p / "ck" / "ckpt-00000006.h5"), lambda m: m["pieces"].pop()),
                           "is in no shard"),
    "shards attribute": (lambda p: _forge_attrs(str(p / "ck" / "ckpt-00000006.h5"), shards=3),
                         "its shards attribute says 3 shard(s), its manifest lists 1"),
    "world_size attribute": (lambda p: _forge_attrs(str(p / "ck" / "ckpt-00000006.h5"), world_size=0),
                             "world_size"),
    "index truncated": (lambda p: os.truncate(p / "ck" / "ckpt-00000006.h5", 2000), "ckpt-00000006.h5"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_inspect_reports_every_damaged_set_that_resume_refuses(pristine, tmp_path, damage):
    folder, layout = pristine
    shutil.copytree(folder / "ck", tmp_path / "ck")
    make, expected = DAMAGES[damage]
    make(tmp_path)
    index = str(tmp_path / "ck" / "ckpt-00000006.h5")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(index, layout)
    assert expected in str(e.value) and "\n" not in str(e.value)
    text, ok = inspect(index)  # never raises
    assert not ok and expected in text and "result: FAILED" in text, text
    problems = [line for line in text.splitlines() if line.startswith("  problem:")]
    assert len(problems) == len(set(problems)), text  # a shard refused for every buffer is said once
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "inspect", index], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and expected in proc.stdout, proc.stderr


def test_an_index_whose_world_size_leaves_out_a_listed_shard_is_refused(pristine, tmp_path):
    """A manifest that lists rank-00001.h5 under an index written by a world of 1: the attributes and the
    manifest disagree, and the set is refused before a shard is opened."""
    folder, layout = pristine
    shutil.copytree(folder / "ck", tmp_path / "ck")
    index = str(tmp_path / "ck" / "ckpt-00000006.h5")
    _forge_manifest(index, lambda m: m["shards"].__setitem__(0, "rank-00001.h5"))
    with pytest.raises(CheckpointError, match="which are not distinct ranks of its world_size 1"):
        load_checkpoint(index, layout)
    text, ok = inspect(index)
    assert not ok and "not distinct ranks of its world_size 1" in text
