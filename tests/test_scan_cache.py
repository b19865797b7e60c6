"""The start-up scan runs once per data file: a second start of an unchanged file skips it, and any change to the
file (or to what is checked) scans it again (hpctrain/scan_cache.py)."""

import json
import os

import h5py
import numpy as np
import pytest

from helpers import config, make_classification, run_trainer
from hpctrain import scan_cache
from hpctrain.data import Dataset
from hpctrain.errors import DataError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    monkeypatch.setenv("HPCTRAIN_CACHE_DIR", str(folder))
    return folder


@pytest.fixture
def scans(monkeypatch):
    """How many times a rank scanned its share of the data file."""
    count = []
    real = Dataset.scan
    monkeypatch.setattr(Dataset, "scan", lambda self, a, b: count.append((a, b)) or real(self, a, b))
    return count


def start(path, mesh, **sections):
    lines = []
    run_trainer(config(path, train={"steps": 1}, **sections), mesh, log=lines.append)
    return lines


def test_a_second_start_of_an_unchanged_file_skips_the_scan(tmp_path, mesh, cache, scans):
    path = tmp_path / "d.h5"
    make_classification(path)
    start(path, mesh)
    assert len(scans) == 1 and len(os.listdir(cache)) == 1
    lines = start(path, mesh)
    assert len(scans) == 1
    assert f"data: {path} is unchanged since a clean start-up scan; not scanned again" in lines
    record = json.load(open(cache / os.listdir(cache)[0]))
    assert record["clean"] is True and record["size"] == os.path.getsize(path) and record["path"] == str(path)


def test_a_file_rewritten_in_place_is_scanned_again_and_its_bad_row_found(tmp_path, mesh, cache, scans):
    path = tmp_path / "d.h5"
    make_classification(path)
    start(path, mesh)
    with h5py.File(path, "r+") as f:
        f["x"][5, 0] = np.nan
    with pytest.raises(DataError, match="inputs contain NaN or Inf .first in row 5"):
        start(path, mesh)
    assert len(scans) == 2


def test_the_same_size_and_time_with_other_bytes_is_scanned_again(tmp_path, mesh, cache, scans):
    """The sampled digest catches a change that keeps the size and the modification time (a copy with -p)."""
    path = tmp_path / "d.h5"
    make_classification(path)
    start(path, mesh)
    st = os.stat(path)
    with h5py.File(path, "r+") as f:
        f["x"][7, 1] = np.inf
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.path.getsize(path) == st.st_size
    with pytest.raises(DataError, match="inputs contain NaN or Inf .first in row 7"):
        start(path, mesh)


def test_a_change_the_sampled_blocks_miss_is_scanned_again_though_the_time_was_kept(tmp_path, mesh, cache, scans,
                                                                                   monkeypatch):
    """A large file's digest samples part of it; a change elsewhere, its modification time put back (a copy with
    -p, rsync -a), still moves the change time, which no one can set back."""
    monkeypatch.setattr(scan_cache, "BLOCKS", 2)  # the first and the last 64 KiB only
    path = tmp_path / "d.h5"
    make_classification(path, n=20000)  # 480 kB of inputs: row 10000 lies in neither sampled block
    start(path, mesh)
    st = os.stat(path)
    with h5py.File(path, "r+") as f:
        f["x"][10000, 1] = np.inf
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    key = scan_cache.scan_key(str(path), "x")
    assert key["mtime_ns"] == st.st_mtime_ns and key["size"] == st.st_size
    with pytest.raises(DataError, match="inputs contain NaN or Inf .first in row 10000"):
        start(path, mesh)


def test_a_token_files_record_holds_for_its_block_size_only(tmp_path, mesh, cache):
    """A window of block_size + 1 tokens: the scan reads the tokens whole windows reach, so another block size
    (reaching a bad id the first never read) scans again."""
    from helpers import gpt_config, make_tokens

    path = tmp_path / "t.h5"
    make_tokens(path, n=100)
    with h5py.File(path, "r+") as f:
        f["tokens"][98] = 50  # outside the vocabulary; windows of 8 reach token 96, windows of 9 token 99

    def run(block):
        cfg = gpt_config(path, model={"block_size": block, "n_embd": 4}, data={"val_fraction": 0.0},
                         train={"steps": 1, "batch_size": 2})
        run_trainer(cfg, mesh)

    run(8)
    with pytest.raises(DataError, match="token id 50 at position 98"):
        run(9)


def test_random_windows_scan_the_tail_fixed_windows_never_reach(tmp_path, mesh, cache):
    """data.sampling = "random" starts a window at any token: the ids past the last whole fixed window are read too."""
    from helpers import gpt_config, make_tokens

    path = tmp_path / "t.h5"
    make_tokens(path, n=100)
    with h5py.File(path, "r+") as f:
        f["tokens"][98] = 50  # fixed windows of 8 reach token 96 only

    def run(sampling):
        cfg = gpt_config(path, model={"block_size": 8, "n_embd": 4}, data={"val_fraction": 0.0, "sampling": sampling},
                         train={"steps": 1, "batch_size": 2})
        run_trainer(cfg, mesh)

    run("windows")
    with pytest.raises(DataError, match="token id 50 at position 98"):
        run("random")


def test_other_checks_on_the_same_file_scan_again(tmp_path, mesh, cache, scans):
    path = tmp_path / "d.h5"
    make_classification(path, classes=3)
    start(path, mesh)
    start(path, mesh, classes=4)  # another model: targets are checked against 4 classes
    assert len(scans) == 2
    start(path, mesh, classes=4)
    assert len(scans) == 2


@pytest.mark.parametrize("record", ["{not json", '{"clean": true}', ""])
def test_a_damaged_record_is_as_if_absent(tmp_path, mesh, cache, scans, record):
    path = tmp_path / "d.h5"
    make_classification(path)
    start(path, mesh)
    (name,) = os.listdir(cache)
    (cache / name).write_text(record)
    start(path, mesh)
    assert len(scans) == 2


def test_off_records_nothing(tmp_path, mesh, monkeypatch, scans):
    monkeypatch.setenv("HPCTRAIN_CACHE_DIR", "off")
    assert scan_cache.cache_dir() is None
    path = tmp_path / "d.h5"
    make_classification(path)
    start(path, mesh)
    start(path, mesh)
    assert len(scans) == 2


def test_a_folder_that_cannot_be_written_only_costs_the_scan(tmp_path, mesh, monkeypatch, scans):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("HPCTRAIN_CACHE_DIR", str(blocker / "cache"))  # under a regular file: makedirs fails
    path = tmp_path / "d.h5"
    make_classification(path)
    start(path, mesh)
    start(path, mesh)
    assert len(scans) == 2
