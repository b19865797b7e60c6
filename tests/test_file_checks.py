"""Hostile files and paths, one regression test per hole (docs/reliability.md, "Hostile files and paths").

Each input must give one HpctrainError line, never a traceback, a hang, an unbounded read or a
read outside the given file.
"""

import json
import os
import threading

import h5py
import numpy as np
import pytest
from helpers import config, make_classification
from test_checkpoint import SHAPES, make_state

from hpctrain.checkpoint import format as fmt
from hpctrain import data as data_module
from hpctrain.checkpoint import inspect, load_checkpoint, load_weights, read_meta, save_checkpoint
from hpctrain.config import load_config, parse_config
from hpctrain.data import Dataset, TokenDataset
from hpctrain.errors import CheckpointError, ConfigError, DataError, HpctrainError
from hpctrain.nn import CrossEntropyLoss
from hpctrain.params import ParamLayout
from hpctrain.text import read_vocabulary
from hpctrain.train.metrics import truncate_after

KW = {"val_fraction": 0.1, "loss": CrossEntropyLoss(), "in_features": 4, "out_features": 3}
LAYOUT = ParamLayout(SHAPES)


def one_line(excinfo):
    text = str(excinfo.value)
    assert "\n" not in text, text
    return text


def checkpoint(tmp_path, step=3, **edits):
    return save_checkpoint(str(tmp_path / "ck"), make_state(step, **edits), keep=5)


def redigest(f):
    fmt.set_attr(f.attrs, fmt.ATTRS_DIGEST, fmt.attrs_digest(f.attrs))


def weights_file(path, make=None):
    """A weights-only file for SHAPES; ``make(group, name, shape)`` makes 0.bias instead of real data."""
    with h5py.File(path, "w") as f:
        g = f.create_group("params")
        for name, shape in SHAPES:
            if name == "0.bias" and make is not None:
                make(g, name, shape)
            else:
                g[name] = np.ones(shape, np.float32)
    return str(path)


# --------------------------------------------------------------------------- A: digests and storage


def test_a_checkpoint_dataset_without_its_digest_is_refused_even_when_altered(tmp_path):
    path = checkpoint(tmp_path)
    with h5py.File(path, "r+") as f:
        del f["params/0.bias"].attrs["sha256"]
        f["params/0.bias"][0] = 42.0
    for load in (lambda: load_checkpoint(path, LAYOUT), lambda: load_weights(path, LAYOUT)):
        with pytest.raises(CheckpointError, match=r"/params/0.bias has no sha256 attribute") as e:
            load()
        one_line(e)
    text, ok = inspect(path)
    assert not ok and "/params/0.bias has no sha256 attribute" in text


def test_a_external_storage_in_a_checkpoint_is_never_read(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(np.arange(8, dtype="<f4").tobytes())
    path = checkpoint(tmp_path)
    with h5py.File(path, "r+") as f:
        del f["params/0.bias"]
        d = f.create_dataset("params/0.bias", shape=(8,), dtype="<f4", external=[(str(secret), 0, 32)])
        fmt.set_attr(d.attrs, "sha256", fmt.sha256_hex(np.arange(8, dtype="<f4")))  # a forged, matching digest
    for load in (lambda: load_checkpoint(path, LAYOUT), lambda: load_weights(path, LAYOUT)):
        with pytest.raises(CheckpointError, match=r"/params/0.bias keeps its data in another file .*secret") as e:
            load()
        one_line(e)
    text, ok = inspect(path)
    assert not ok and "keeps its data in another file" in text


def _virtual(group, name, shape, source):
    layout = h5py.VirtualLayout(shape=shape, dtype="<f4")
    layout[...] = h5py.VirtualSource(source, "x", shape=shape)
    group.create_virtual_dataset(name, layout)


def test_a_virtual_datasets_are_refused_in_weights_files(tmp_path):
    src = tmp_path / "src.h5"
    with h5py.File(src, "w") as f:
        f["x"] = np.ones(8, np.float32)
    path = weights_file(tmp_path / "w.h5", lambda g, n, s: _virtual(g, n, s, str(src)))
    with pytest.raises(CheckpointError, match=r"/params/0.bias is a virtual dataset") as e:
        load_weights(path, LAYOUT)
    one_line(e)
    assert "is a virtual dataset" in inspect(path)[0]


def test_a_unallocated_storage_is_refused(tmp_path):
    path = weights_file(tmp_path / "w.h5", lambda g, n, s: g.create_dataset(n, shape=s, dtype="<f4", fillvalue=7))
    with pytest.raises(CheckpointError, match=r"/params/0.bias is declared \(shape \(8,\)\) but never written") as e:
        load_weights(path, LAYOUT)
    one_line(e)
    data = tmp_path / "d.h5"
    with h5py.File(data, "w") as f:
        f["x"] = np.zeros((8, 4), np.float32)
        f.create_dataset("y", shape=(8,), dtype=np.int64, chunks=(4,), compression="gzip")
    with pytest.raises(DataError, match=r"dataset 'y' \(data.targets\) is declared \(shape \(8,\)\) but never written"):
        Dataset(str(data), "x", "y", **KW)


def test_a_data_files_refuse_external_and_virtual_storage_unless_allowed(tmp_path):
    raw = tmp_path / "x.bin"
    x = np.arange(32, dtype="<f4").reshape(8, 4)
    raw.write_bytes(x.tobytes())
    ext, virt, linked = tmp_path / "e.h5", tmp_path / "v.h5", tmp_path / "l.h5"
    with h5py.File(ext, "w") as f:
        f.create_dataset("x", shape=(8, 4), dtype="<f4", external=[(str(raw), 0, x.nbytes)])
        f["y"] = np.zeros(8, np.int64)
    with h5py.File(virt, "w") as f:
        layout = h5py.VirtualLayout(shape=(8, 4), dtype="<f4")
        layout[...] = h5py.VirtualSource(str(ext), "x", shape=(8, 4))
        f.create_virtual_dataset("x", layout)
        f["y"] = np.zeros(8, np.int64)
    with h5py.File(linked, "w") as f:
        f["x"] = h5py.ExternalLink(str(ext), "/x")
        f["y"] = np.zeros(8, np.int64)
    for path, what in ((ext, "keeps its data in another file"), (virt, "is a virtual dataset"),
                       (linked, "is an external link to /x in")):
        with pytest.raises(DataError, match=rf"dataset 'x' \(data.inputs\) {what}.*data.allow_external = true") as e:
            Dataset(str(path), "x", "y", **KW)
        one_line(e)
        d = Dataset(str(path), "x", "y", **KW, allow_external=True)
        np.testing.assert_array_equal(d.read(np.arange(8))[0], x)
        d.close()


def test_a_allow_external_is_a_checked_config_key():
    base = {"model": {"layers": [{"type": "linear", "in": 4, "out": 3}]},
            "data": {"path": "d.h5", "inputs": "x", "targets": "y"}}
    assert parse_config(base).data.allow_external is False
    base["data"]["allow_external"] = True
    assert parse_config(base).data.allow_external is True
    base["data"]["allow_external"] = "yes"
    with pytest.raises(ConfigError, match="data.allow_external: expected bool, got string 'yes'"):
        parse_config(base)


# --------------------------------------------------------------------------- B: declared sizes, rows


@pytest.mark.parametrize("rows", [10**9, 10**12])
def test_b_a_huge_declared_dataset_is_refused_at_once(tmp_path, rows):
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        x = f.create_dataset("x", shape=(rows, 4), dtype="<f4", chunks=(1024, 4), compression="gzip")
        x[:1024] = 1.0
        y = f.create_dataset("y", shape=(rows,), dtype="<i8", chunks=(1024,), compression="gzip")
        y[:1024] = 0
        t = f.create_dataset("tokens", shape=(rows * 4,), dtype="<u2", chunks=(4096,), compression="gzip")
        t[:4096] = 1
    assert os.path.getsize(path) < 1 << 20
    with pytest.raises(DataError, match=rf"dataset 'x' \(data.inputs\) declares shape \({rows}, 4\) of float32") as e:
        Dataset(str(path), "x", "y", **KW)
    one_line(e)
    with pytest.raises(DataError, match=r"dataset 'tokens' \(data.tokens\) declares shape"):
        TokenDataset(str(path), "tokens", block_size=8, val_fraction=0.1, vocab_size=4)


def test_b_scan_problems_name_the_row_in_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(data_module, "SCAN_BYTES", 64)  # a few rows per read: the rows lie in later reads
    path = tmp_path / "d.h5"
    make_classification(path, n=40, features=4, nan_row=29)
    with h5py.File(path, "r+") as f:
        f["y"][33] = 7
    d = Dataset(str(path), "x", "y", **KW)
    assert "inputs contain NaN or Inf (first in row 29)" in d.scan(20, 40)  # a rank whose share starts at 20
    assert "target 7 in row 33 is not a class index in [0, 3)" in d.scan(30, 40)
    d.close()


# --------------------------------------------------------------------------- C: paths


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "pipe"
    os.mkfifo(path)
    yield str(path)
    try:  # a reader left blocked by a failing test is released
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def within(seconds, fn):
    """``fn()``'s exception (or None); fails the test when it has not returned within ``seconds``."""
    out = {}

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "blocked"
    return out.get("error")


def test_c_a_fifo_is_never_opened(tmp_path, fifo):
    calls = [
        (lambda: load_config(fifo), ConfigError),
        (lambda: Dataset(fifo, "x", "y", **KW), DataError),
        (lambda: TokenDataset(fifo, "t", block_size=4, val_fraction=0.1, vocab_size=4), DataError),
        (lambda: load_weights(fifo, LAYOUT), CheckpointError),
        (lambda: load_checkpoint(fifo, LAYOUT), CheckpointError),
        (lambda: read_meta(fifo), CheckpointError),
        (lambda: read_vocabulary(fifo), DataError),
        (lambda: truncate_after(fifo, 3), ConfigError),
    ]
    for call, kind in calls:
        error = within(10, call)
        assert isinstance(error, kind), error
        assert "is a FIFO (named pipe), not a regular file" in str(error) and "\n" not in str(error)
    text, ok = within(10, lambda: None) or inspect(fifo)
    assert not ok and "is a FIFO (named pipe)" in text


def test_c_a_fifo_as_an_output_is_refused_before_it_is_opened(tmp_path, fifo):
    from helpers import config

    from hpctrain.train.startup import check_outputs

    for key in ("metrics", "trace"):
        cfg = config(str(tmp_path / "d.h5"), train={key: fifo})
        error = within(10, lambda: check_outputs(cfg))
        assert isinstance(error, ConfigError) and f"train.{key}: {fifo} is not a regular file" in str(error), error


def test_c_config_reads_are_capped(tmp_path):
    with pytest.raises(ConfigError, match="is a character device, not a regular file"):
        load_config("/dev/zero")
    big = tmp_path / "big.toml"
    with open(big, "wb") as f:
        f.truncate(17 << 20)  # sparse: nothing written
    with pytest.raises(ConfigError, match="is larger than 16 MiB"):
        load_config(str(big))


def test_c_a_folder_as_data_path_is_one_line(tmp_path):
    with pytest.raises(DataError, match=r"data file .* is a directory, not a file$") as e:
        Dataset(str(tmp_path), "x", "y", **KW)
    one_line(e)


def test_c_metrics_lines_that_are_not_json_records_survive_resume(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n' + "[" * 100000 + "\n" + '{"step": 5}\n')
    truncate_after(str(path), 3)
    assert path.read_text() == '{"step": 1}\n' + "[" * 100000 + "\n"


# --------------------------------------------------------------------------- D: odd content


def test_d_odd_names_links_and_dataspaces_are_one_line(tmp_path):
    makers = {
        "non-UTF-8 name": (lambda g, n, s: (g.create_dataset(n, data=np.ones(s, np.float32)),
                                            g.create_dataset(b"\xff\xfe", data=np.ones(1, np.float32))),
                           r"/params/\\xff\\xfe has a name that is not UTF-8"),
        "empty dataspace": (lambda g, n, s: g.create_dataset(n, data=h5py.Empty("<f4")),
                            r"/params/0.bias holds no data \(an empty dataspace\)"),
        "dangling": (lambda g, n, s: g.__setitem__(n, h5py.SoftLink("/nowhere")),
                     r"/params/0.bias is a soft link to /nowhere that leads nowhere"),
        "cycle": (lambda g, n, s: g.__setitem__(n, h5py.SoftLink("/params/0.bias")),
                  r"/params/0.bias is a soft link to /params/0.bias that leads nowhere"),
    }
    for label, (make, message) in makers.items():
        path = weights_file(tmp_path / f"{label}.h5", make)
        with pytest.raises(CheckpointError, match=message) as e:
            load_weights(path, LAYOUT)
        one_line(e)
        text, ok = inspect(path)
        assert not ok and message.replace("\\", "").replace("(", "").replace(")", "")[:20] in \
            text.replace("\\", "").replace("(", "").replace(")", ""), (label, text)


def test_d_a_broken_link_in_a_data_file_is_not_a_missing_dataset(tmp_path):
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["inputs"] = h5py.SoftLink("/gone")
        f["loop"] = h5py.SoftLink("/loop")
        f["y"] = np.zeros(8, np.int64)
        f.create_dataset(b"\xff", data=np.zeros(2))
    with pytest.raises(DataError, match=r"dataset 'inputs' \(data.inputs\) is a soft link to /gone that leads nowhere"):
        Dataset(str(path), "inputs", "y", **KW)
    with pytest.raises(DataError, match=r"dataset 'loop' \(data.inputs\) is a soft link to /loop"):
        Dataset(str(path), "loop", "y", **KW)
    with pytest.raises(DataError, match=r"no dataset 'z' \(data.inputs\); it has: inputs, loop, y, \\xff") as e:
        Dataset(str(path), "z", "y", **KW)
    one_line(e)


def test_d_non_utf8_root_attribute_names_are_refused(tmp_path):
    path = checkpoint(tmp_path)
    with h5py.File(path, "r+") as f:
        f.attrs.create(b"\xff", 1)
    with pytest.raises(CheckpointError, match=r"root attribute name\(s\) \\xff are not UTF-8") as e:
        load_checkpoint(path, LAYOUT)
    one_line(e)
    assert not inspect(path)[1]


def test_d_a_damaged_root_group_is_one_line(tmp_path):
    path = checkpoint(tmp_path)
    with h5py.File(path, "r") as f:
        root = h5py.h5o.get_info(f.id).addr
    with open(path, "r+b") as fh:  # the root group's object header, checksummed by HDF5
        fh.seek(root + 8)
        byte = fh.read(1)
        fh.seek(root + 8)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, LAYOUT)
    one_line(e)
    assert not inspect(path)[1]


@pytest.mark.parametrize("key,value,message", [
    ("optimizer_step", 2**63 - 1, r"'optimizer_step' = 9223372036854775807 is beyond any run"),
    ("step", 2**62 + 1, r"'step' = 4611686018427387905 is beyond any run"),
    ("epoch", 4, r"'epoch' = 4 is larger than step = 3"),
])
def test_d_step_counters_a_run_cannot_continue_from_are_refused(tmp_path, key, value, message):
    path = checkpoint(tmp_path)
    with h5py.File(path, "r+") as f:
        fmt.set_attr(f.attrs, key, value)
        redigest(f)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, LAYOUT)
    assert not inspect(path)[1]


def _rewrite(path, dataset, arr):
    with h5py.File(path, "r+") as f:
        del f[dataset]
        d = f.create_dataset(dataset, data=arr)
        fmt.set_attr(d.attrs, "sha256", fmt.sha256_hex(np.ascontiguousarray(arr)))


@pytest.mark.parametrize("dataset,arr,message", [
    ("optim/exp_avg_sq/0.bias", -np.ones(8, np.float32), r"/optim/exp_avg_sq/0.bias: 8 negative value\(s\)"),
    ("optim/exp_avg/0.bias", np.full(8, np.nan, np.float32), r"/optim/exp_avg/0.bias: 8 non-finite value\(s\)"),
    ("params/0.bias", np.ones(8, np.int32), r"0.bias has dtype int32, expected little-endian float32"),
])
def test_d_bad_optimizer_state_and_integer_parameters_are_refused_and_inspected(tmp_path, dataset, arr, message):
    path = checkpoint(tmp_path)
    _rewrite(path, dataset, arr)
    with pytest.raises(CheckpointError, match=message) as e:
        load_checkpoint(path, LAYOUT)
    one_line(e)
    text, ok = inspect(path)
    assert not ok and message.replace("\\", "").split(": ")[-1][:20] in text.replace("\\", ""), text


def test_d_resume_falls_back_past_a_checkpoint_of_another_dtype(tmp_path):
    """Names and shapes fit, one tensor is int32: not another model's file (resume = "auto" would stop there)
    but one hpctrain did not write as it stands, so the search goes on to the older checkpoint."""
    from hpctrain.checkpoint import find_resume
    from hpctrain.errors import ModelMismatchError

    checkpoint(tmp_path, step=3)
    newest = checkpoint(tmp_path, step=4)
    _rewrite(newest, "params/0.bias", np.ones(8, np.int32))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(newest, LAYOUT)
    assert not isinstance(e.value, ModelMismatchError) and "another dtype than hpctrain writes" in str(e.value)
    logs = []
    state = find_resume(str(tmp_path / "ck"), LAYOUT, logs.append)
    assert state.step == 3 and any("skipping ckpt-00000004.h5" in line for line in logs), logs


def test_d_save_refuses_optimizer_state_the_loaders_refuse(tmp_path):
    state = make_state(3)
    state.slots["exp_avg_sq"]["0.bias"][0] = -1.0
    with pytest.raises(CheckpointError, match=r"optimizer slot exp_avg_sq of 0.bias has 1 negative value"):
        save_checkpoint(str(tmp_path), state, keep=1)
    assert os.listdir(tmp_path) == []


def test_every_error_here_is_an_hpctrain_error():
    assert issubclass(CheckpointError, HpctrainError) and issubclass(DataError, HpctrainError)


def test_c_a_config_key_holding_a_newline_is_named_on_one_line(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[train]\n"steps\\nx" = 1\n')
    with pytest.raises(ConfigError, match=r"train.steps\\nx: unknown key") as e:
        load_config(str(path))
    one_line(e)


# --------------------------------------------------------------------------- a data file changed under a running job


def _data_file(path, n=32):
    with h5py.File(path, "w") as f:
        f["x"] = np.random.default_rng(0).standard_normal((n, 4)).astype(np.float32)
        f["y"] = np.arange(n) % 3
    return str(path)


@pytest.mark.parametrize("change, message", [
    ("truncate", "changed size from"),
    ("append", "changed size from"),
    ("rewrite", "was rewritten while training"),
    ("replace", "was replaced by another file while training"),
    ("delete", "disappeared while training"),
])
def test_a_data_file_changed_while_training_stops_the_next_read(tmp_path, change, message):
    path = _data_file(tmp_path / "d.h5")
    ds = Dataset(path, "x", "y", **KW)
    ds.PATH_CHECK_SECONDS = 0.0  # the path too at every read (by default at most once a minute)
    try:
        ds.read(np.arange(8))
        if change == "truncate":
            os.truncate(path, os.path.getsize(path) // 2)  # HDF5 would read the lost rows as zeros
        elif change == "append":
            with open(path, "ab") as f:
                f.write(b"\0" * 4096)
        elif change == "rewrite":  # same size, same inode: other bytes in place
            st = os.stat(path)
            with open(path, "r+b") as f:
                f.seek(st.st_size - 64)
                f.write(b"\x7f" * 16)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # a coarse clock may not have moved
        elif change == "replace":
            os.replace(_data_file(tmp_path / "other.h5"), path)
        else:
            os.unlink(path)
        with pytest.raises(DataError) as excinfo:
            ds.read(np.arange(8))
        text = one_line(excinfo)
        assert f"data file {path} " in text and message in text, text
    finally:
        ds.close()


def test_reads_check_the_open_file_every_time_and_the_path_once_a_minute(tmp_path, monkeypatch):
    """A read costs an fstat of the open file, not a path lookup (a metadata server round trip on a parallel
    file system): 50 reads look the path up once at most; a truncation is still caught by the next read."""
    path = _data_file(tmp_path / "d.h5")
    ds = Dataset(path, "x", "y", **KW)
    lookups = []
    real_stat = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: (lookups.append(p), real_stat(p, *a, **k))[1])
    try:
        for _ in range(50):
            ds.read(np.arange(8))
        assert [p for p in lookups if str(p) == path] == []
        os.truncate(path, os.path.getsize(path) // 2)
        with pytest.raises(DataError, match="changed size from .* while training"):
            ds.read(np.arange(8))
    finally:
        ds.close()


def test_a_token_file_truncated_while_training_stops_the_next_read(tmp_path):
    from helpers import make_tokens

    make_tokens(tmp_path / "t.h5")
    ds = TokenDataset(str(tmp_path / "t.h5"), "tokens", block_size=8, val_fraction=0.1, vocab_size=16)
    try:
        ds.read(np.arange(4))
        os.truncate(tmp_path / "t.h5", os.path.getsize(tmp_path / "t.h5") - 512)
        with pytest.raises(DataError, match="changed size from .* while training"):
            ds.read(np.arange(4))
    finally:
        ds.close()


# --------------------------------------------------------------------------- odd values and failing writes: one line


def test_absurd_bucket_sizes_nul_characters_and_overlong_paths_are_one_line(tmp_path):
    from helpers import config

    from hpctrain.train.startup import check_outputs

    with pytest.raises(ConfigError, match=r"parallel.bucket_mb: must be > 0 and at most 1e6"):
        config("d.h5", parallel={"bucket_mb": 1e303})  # had overflowed in make_buckets
    with pytest.raises(ConfigError, match="train.metrics: must not contain a NUL character"):
        config("d.h5", train={"metrics": "a\0b"})
    for long in ("x" * 300, "/".join(["y" * 200] * 25)):
        with pytest.raises(ConfigError, match=r"train.metrics: the path is too long") as excinfo:
            check_outputs(config(str(tmp_path / "d.h5"), train={"metrics": str(tmp_path / long)}))
        one_line(excinfo)


def test_a_checkpoint_folder_that_cannot_be_made_and_a_failing_metrics_write_are_one_line(tmp_path):
    from hpctrain.checkpoint.lock import FolderLock
    from hpctrain.train.metrics import MetricsFile

    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match=r"checkpoint.dir .*/file/ck cannot be created: Not a directory"):
        FolderLock.take(str(tmp_path / "file" / "ck"), log=print)
    # a device is not a metrics file (a full disk is test_a_full_disk_under_the_metrics_file_is_one_line_...)
    with pytest.raises(ConfigError, match="train.metrics: /dev/full is a character device, not a regular file; "
                                          "hpctrain writes only regular files"):
        MetricsFile("/dev/full")


def test_an_error_line_is_one_write(monkeypatch):
    import sys

    from hpctrain import cli

    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())
    cli._say("hpctrain: error [rank 1/2]: something")
    assert writes == ["hpctrain: error [rank 1/2]: something\n"]  # print() had written the newline apart


# --------------------------------------------------------------------------- metrics and trace: links, full disks


def _metrics_job(tmp_path, **train):
    make_classification(tmp_path / "d.h5", n=64)
    return config(tmp_path / "d.h5", train={"steps": 4, **train}, checkpoint={"dir": str(tmp_path / "ck"), "every": 2})


def _run_raising(cfg, mesh, match):
    """Build and run a Trainer that must end with a ConfigError matching ``match``; closed either way."""
    from hpctrain.train import Trainer

    t = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    try:
        with pytest.raises(ConfigError, match=match):
            t.run()
    finally:
        t.close()


def test_a_metrics_file_that_is_a_symlink_is_refused_and_its_target_untouched(tmp_path, mesh):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    os.symlink(victim, tmp_path / "metrics.jsonl")
    _run_raising(_metrics_job(tmp_path, metrics=str(tmp_path / "metrics.jsonl")), mesh,
                 r"^train.metrics: .*metrics.jsonl is a symbolic link")
    assert victim.read_text() == "precious\n"


def test_links_planted_at_the_old_temp_names_are_never_written_through(tmp_path, mesh):
    """A resumed run rewrites its metrics file and writes its trace through temporaries: a link planted at
    ``<metrics>.tmp`` or ``<trace>.tmp`` (the names they had) changes nothing it points to."""
    from helpers import run_trainer

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    metrics, trace = tmp_path / "metrics.jsonl", tmp_path / "trace.json"
    for steps in (4, 6):  # the second run resumes from step 4 after a kill at 5: metrics lines of step 5 go
        run_trainer(_metrics_job(tmp_path, metrics=str(metrics), trace=str(trace), steps=steps), mesh)
        if steps == 4:
            with open(metrics, "a") as f:
                f.write('{"step": 5, "loss": 1.0}\n')
            for name in (f"{metrics}.tmp", f"{trace}.tmp"):
                os.symlink(victim, name)
    assert victim.read_text() == "precious\n"
    assert not os.path.islink(metrics) and not os.path.islink(trace)
    assert '{"step": 5, "loss": 1.0}' not in metrics.read_text()  # the resume dropped it, through no link
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".tmp")) == ["metrics.jsonl.tmp", "trace.json.tmp"]


def test_a_full_disk_under_the_metrics_file_is_one_line_and_close_does_not_fail_again(tmp_path):
    import errno

    from hpctrain.train.metrics import MetricsFile

    m = MetricsFile(str(tmp_path / "metrics.jsonl"))

    class Full:
        name = m.f.name

        def write(self, text):
            pass

        def flush(self):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    m.f.close()
    m.f = Full()
    with pytest.raises(ConfigError) as e:
        m.write({"step": 1, "loss": 0.5})
    assert str(e.value) == f"train.metrics: cannot write {tmp_path / 'metrics.jsonl'}: No space left on device (ENOSPC)"
    m.write({"step": 2})  # nothing more is tried once a write failed
    m.close()  # the failed buffer is dropped: no second error


def test_a_full_disk_under_the_trace_is_one_line_and_leaves_no_temporary(tmp_path, mesh, monkeypatch):
    import errno

    import hpctrain.train.trace as trace

    def full(f, heads, blocks):
        f.write('{"traceEvents": [')  # the disk fills after the first bytes
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(trace, "_write_events", full)
    _run_raising(_metrics_job(tmp_path, trace=str(tmp_path / "trace.json")), mesh,
                 r"^train.trace: cannot write .*trace.json: No space left on device \(ENOSPC\)$")
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_a_metrics_file_another_live_run_writes_is_refused_untouched(tmp_path):
    import fcntl

    from hpctrain.train.metrics import MetricsFile

    path = tmp_path / "metrics.jsonl"
    first = MetricsFile(str(path))
    first.write({"step": 1, "loss": 0.5})
    for resume_step in (0, 1):  # a fresh run would truncate it, a resumed one rewrite it: neither gets that far
        with pytest.raises(ConfigError, match=r"^train.metrics: .*metrics.jsonl is being written by another running "
                                              r"job \(it holds the file's lock\); give each run its own"):
            MetricsFile(str(path), resume_step=resume_step)
    first.write({"step": 2, "loss": 0.4})
    first.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]
    again = MetricsFile(str(path), resume_step=2)  # the first run ended: its lock went with it
    again.close()
    with open(path) as f:  # nothing of ours holds it now
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
