"""Nothing pruned that is not ours (issue 52, item 2): pruning and every other removal act only on a set whose
index name, ``step`` attribute, ``set_id`` and shards' folder agree; anything else stays, with one log line."""

import glob
import os
import shutil

import numpy as np
import pytest

from helpers import config, folder_listing, make_classification, run_trainer as run
from hpctrain.checkpoint import load_checkpoint, sets

ADAMW = {"name": "adamw", "lr": 0.01}


def job(tmp_path, steps, **checkpoint):
    if not (tmp_path / "d.h5").exists():
        make_classification(tmp_path / "d.h5", n=32)
    return config(tmp_path / "d.h5", optim=ADAMW, train={"steps": steps},
                  checkpoint={"dir": str(tmp_path / "ck"), "every": 3, **checkpoint})


def test_pruning_leaves_a_renamed_copy_of_another_steps_index_and_that_steps_shards(tmp_path, mesh):
    """A copy of ckpt-00000006.h5 saved as ckpt-00000001.h5: pruning "step 1" used to take step 6's shards."""
    t = run(job(tmp_path, 6, keep=5), mesh)
    ck = tmp_path / "ck"
    shutil.copy(ck / "ckpt-00000006.h5", ck / "ckpt-00000001.h5")
    (six,) = glob.glob(str(ck / "ckpt-00000006.*.shards"))
    lines = []
    run(job(tmp_path, 12, keep=2), mesh, lines.append)  # prunes everything below step 9
    notes = [line for line in lines if "left" in line and "ckpt-00000001.h5" in line]
    assert len(notes) >= 1 and all("its step attribute is 6, not the 1 of its name" in n for n in notes), lines
    assert folder_listing(ck) == ["ckpt-00000001.h5", "ckpt-00000009.h5", "ckpt-00000009.shards",
                                  "ckpt-00000012.h5", "ckpt-00000012.shards"]
    assert not os.path.exists(six)  # step 6 itself was ours: pruned whole
    _ = t


def test_a_copy_under_another_name_keeps_the_original_loadable(tmp_path, mesh):
    t = run(job(tmp_path, 6, keep=5), mesh)
    ck = tmp_path / "ck"
    shutil.copy(ck / "ckpt-00000006.h5", ck / "ckpt-00000003.h5")  # over step 3's own index
    lines = []
    run(job(tmp_path, 9, keep=1), mesh, lines.append)
    assert any("left" in line and "ckpt-00000003.h5" in line for line in lines), lines
    # step 6 was pruned whole (ours); the copy named 3 stays, and step 3's own folder is named by no index
    assert "ckpt-00000003.h5" in os.listdir(ck)
    state = load_checkpoint(str(ck / "ckpt-00000009.h5"), t.model.layout)
    assert state.step == 9


def test_export_over_a_copied_index_removes_no_shards(tmp_path, mesh):
    """``export --format h5 --force`` over a file that is a copy of an index: the file is replaced, and the set it
    copied keeps its shards (before: the shards' folder its attributes name was removed)."""
    from hpctrain.export import export

    t = run(job(tmp_path, 6, keep=5), mesh)
    ck = tmp_path / "ck"
    out = ck / "ckpt-00000001.h5"
    shutil.copy(ck / "ckpt-00000006.h5", out)
    export(str(ck / "ckpt-00000003.h5"), str(out), "h5", force=True)
    six = load_checkpoint(str(ck / "ckpt-00000006.h5"), t.model.layout)
    assert six.step == 6 and load_checkpoint(str(out), t.model.layout).step == 3
    other = tmp_path / "copy.h5"
    shutil.copy(ck / "ckpt-00000006.h5", other)  # a copy outside the folder, under any name
    export(str(ck / "ckpt-00000003.h5"), str(other), "h5", force=True)
    assert load_checkpoint(str(ck / "ckpt-00000006.h5"), t.model.layout).step == 6


@pytest.mark.parametrize("case", ["set-id", "manifest-folder", "foreign-file", "folder-link", "not-hdf5"])
def test_remove_set_acts_only_when_name_step_set_id_and_folder_agree(tmp_path, mesh, case):
    run(job(tmp_path, 3), mesh)
    ck = tmp_path / "ck"
    index = str(ck / "ckpt-00000003.h5")
    (folder,) = glob.glob(str(ck / "ckpt-00000003.*.shards"))
    if case == "set-id":
        import h5py

        with h5py.File(index, "r+") as f:
            f.attrs["set_id"] = "0" * 16
    elif case == "manifest-folder":
        from test_sharded_checkpoint import _forge_manifest

        _forge_manifest(index, lambda m: m.update(folder="ckpt-00000003.0000000000000000.shards"))
    elif case == "foreign-file":
        (ck / os.path.basename(folder) / "notes.txt").write_text("mine")
    elif case == "folder-link":
        os.rename(folder, folder + ".real")
        os.symlink(folder + ".real", folder)
    else:
        with open(index, "wb") as f:
            f.write(b"not hdf5")
    before = folder_listing(ck)
    lines = []
    assert sets.remove_set(index, lines.append) is False
    assert len(lines) == 1 and lines[0].startswith(f"checkpoint: left {index} in place, not removed: "), lines
    assert folder_listing(ck) == before


def test_a_folder_of_a_never_committed_save_is_cleared_only_when_it_holds_shards_alone(tmp_path, mesh):
    run(job(tmp_path, 3), mesh)
    ck = tmp_path / "ck"
    theirs = ck / "ckpt-00000015.0123456789abcdef.shards"
    theirs.mkdir()
    (theirs / "results.csv").write_text("someone's")
    killed = ck / "ckpt-00000016.0123456789abcdef.shards"
    killed.mkdir()
    (killed / "rank-00000.h5").write_bytes(b"half")
    assert sets.clean_orphans(str(ck)) == [str(killed)]
    assert (theirs / "results.csv").read_text() == "someone's"
    _ = np
