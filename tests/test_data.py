"""Data order, sharding, reading and bad data."""

import re
import warnings

import h5py
import numpy as np
import pytest
from helpers import make_classification

from hpctrain.checkpoint import load_weights
from hpctrain.data import Dataset
from hpctrain.sampling import Sampler, continue_order
from hpctrain.errors import DataError
from hpctrain.nn import CrossEntropyLoss, MSELoss
from hpctrain.params import ParamLayout


def test_unshuffled_order_is_file_order_and_wraps():
    s = Sampler(10, 3, shuffle=False, seed=0)
    assert s.steps_per_epoch == 3
    assert s.global_rows(0).tolist() == [0, 1, 2]
    assert s.global_rows(2).tolist() == [6, 7, 8]
    assert s.global_rows(3).tolist() == [0, 1, 2]  # floor(10/3) = 3 steps an epoch, then wrap


def test_shuffled_epochs_are_seeded_permutations():
    a, b = Sampler(12, 4, shuffle=True, seed=5), Sampler(12, 4, shuffle=True, seed=5)
    epoch0 = np.concatenate([a.global_rows(s) for s in range(3)])
    assert sorted(epoch0.tolist()) == list(range(12))
    assert epoch0.tolist() == np.random.default_rng([5, 0]).permutation(12).tolist()
    assert np.concatenate([b.global_rows(s) for s in range(3, 6)]).tolist() == \
        np.random.default_rng([5, 1]).permutation(12).tolist()
    assert not np.array_equal(epoch0, np.concatenate([a.global_rows(s) for s in range(3, 6)]))


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_rank_shares_tile_the_global_batch(dp):
    samplers = [Sampler(40, 8, shuffle=True, seed=1, dp_rank=r, dp_size=dp) for r in range(dp)]
    for step in range(7):
        joined = np.concatenate([s.local_rows(step) for s in samplers])
        assert joined.tolist() == samplers[0].global_rows(step).tolist()


def test_a_rank_keeps_only_its_own_positions_of_the_epoch_order():
    """1/dp of the shuffled order, as int32: 4 bytes x steps x share, where the whole order is 8 bytes x n."""
    n, batch, dp = 10_000, 64, 4
    samplers = [Sampler(n, batch, shuffle=True, seed=3, dp_rank=r, dp_size=dp) for r in range(dp)]
    for step in (0, 155, 156, 400):  # 156 steps an epoch: the second and third epochs too
        joined = np.concatenate([s.local_rows(step) for s in samplers])
        assert joined.dtype == np.int64 and joined.tolist() == samplers[0].global_rows(step).tolist()
    assert all(s.order_bytes == 4 * (n // batch) * (batch // dp) for s in samplers)


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_changed_batch_size_goes_on_from_the_samples_consumed(shuffle):
    """Resumed with another batch size, the order goes on from the samples the checkpoint's run took in its
    epoch (rounded up to a whole new batch): nothing twice, fewer than a batch left out; unchanged: offset 0."""
    n = 100
    old = Sampler(n, 10, shuffle=shuffle, seed=2)  # 10 steps an epoch
    assert continue_order(23, *old.position(23), 10, 10, old.steps_per_epoch) == (0, 0)
    taken = np.concatenate([old.global_rows(s) for s in range(20, 23)])  # epoch 2: 30 samples
    for batch, skipped in ((5, 0), (20, 10), (40, 10), (7, 5)):
        new = Sampler(n, batch, shuffle=shuffle, seed=2)
        offset, left_out = continue_order(23, *old.position(23), 10, batch, new.steps_per_epoch)
        new.offset = offset
        assert left_out == skipped
        rest = [new.global_rows(s) for s in range(23, 23 + 100) if new.epoch_of(s) == 2]
        rest = np.concatenate(rest) if rest else np.zeros(0, dtype=np.int64)
        epoch = np.random.default_rng([2, 2]).permutation(n) if shuffle else np.arange(n)
        assert not set(rest.tolist()) & set(taken.tolist())  # nothing of epoch 2 seen twice
        usable = new.steps_per_epoch * batch
        assert rest.tolist() == epoch[30 + skipped : usable].tolist()
        assert new.position(23 + len(rest) // batch) == (3, 0)  # then epoch 3 from its start
    # the batch that is left: none in this epoch once rounded up; the next epoch starts at the resumed step
    offset, left_out = continue_order(23, 2, 3, 10, 40, 2)  # 30 taken of 80 usable: one batch of 40 at 40
    assert (offset, left_out) == (23 - (2 * 2 + 1), 10)
    offset, left_out = continue_order(23, 2, 9, 10, 40, 2)  # 90 taken, 80 usable: epoch 3 from its start
    assert (offset, left_out) == (23 - 3 * 2, 0)


def test_sampler_errors():
    with pytest.raises(DataError, match="batch_size = 11 is larger than the training split"):
        Sampler(10, 11, shuffle=False, seed=0)
    with pytest.raises(DataError, match="not divisible by the data-parallel size 2"):
        Sampler(10, 3, shuffle=False, seed=0, dp_size=2)


def test_read_returns_rows_in_the_asked_order(tmp_path):
    x, y = make_classification(tmp_path / "d.h5", n=20, features=4)
    d = Dataset(str(tmp_path / "d.h5"), "x", "y", val_fraction=0.25, loss=CrossEntropyLoss(), in_features=4,
                out_features=3)
    assert (d.n_train, d.n_val) == (15, 5)
    rows = np.array([7, 2, 11, 3])
    xs, ys = d.read(rows)
    np.testing.assert_array_equal(xs, x[rows])
    np.testing.assert_array_equal(ys, y[rows])
    xs, _ = d.read(np.arange(4, 9))
    np.testing.assert_array_equal(xs, x[4:9])
    assert d.scan(0, 20) == ""


def test_rows_far_apart_are_read_one_by_one_and_near_ones_as_one_slice(tmp_path, monkeypatch):
    """A batch's rows come out of the slice that covers them when it is small (data.SLICE_READ_BYTES), else h5py
    reads the rows themselves; either way in the order asked."""
    import hpctrain.data as data

    x, y = make_classification(tmp_path / "d.h5", n=200, features=4)
    d = Dataset(str(tmp_path / "d.h5"), "x", "y", val_fraction=0.0, loss=CrossEntropyLoss(), in_features=4,
                out_features=3)
    fetched = []
    fetch = d._fetch
    monkeypatch.setattr(d, "_fetch", lambda rows: fetched.append(rows) or fetch(rows))
    rows = np.array([190, 5, 77, 6])
    for limit, kind in ((1 << 20, slice), (0, np.ndarray)):
        monkeypatch.setattr(data, "SLICE_READ_BYTES", limit)
        xs, ys = d.read(rows)
        np.testing.assert_array_equal(xs, x[rows])
        np.testing.assert_array_equal(ys, y[rows])
        assert isinstance(fetched[-1], kind)
    d.close()


def test_bad_data(tmp_path):
    make_classification(tmp_path / "d.h5", n=20, features=4, nan_row=13)
    kw = {"val_fraction": 0.1, "loss": CrossEntropyLoss(), "in_features": 4, "out_features": 3}
    d = Dataset(str(tmp_path / "d.h5"), "x", "y", **kw)
    assert "inputs contain NaN or Inf (first in row 13)" in d.scan(0, 20)
    with pytest.raises(DataError, match="does not exist"):
        Dataset(str(tmp_path / "missing.h5"), "x", "y", **kw)
    with pytest.raises(DataError, match="no dataset 'z'"):
        Dataset(str(tmp_path / "d.h5"), "z", "y", **kw)
    with pytest.raises(DataError, match="the model's first layer takes 5"):
        Dataset(str(tmp_path / "d.h5"), "x", "y", **dict(kw, in_features=5))
    with pytest.raises(DataError, match=r"mse needs targets of shape \(N, 3\)"):
        Dataset(str(tmp_path / "d.h5"), "x", "y", **dict(kw, loss=MSELoss()))
    (tmp_path / "text.h5").write_text("not hdf5")
    with pytest.raises(DataError, match="not a readable HDF5 file"):
        Dataset(str(tmp_path / "text.h5"), "x", "y", **kw)
    with h5py.File(tmp_path / "t.h5", "w") as f:
        f["x"] = np.zeros((4, 4), np.float32)
        f["y"] = np.array([0, 1, 5, 2])
    assert "target 5 in row 2 is not a class index in [0, 3)" in Dataset(str(tmp_path / "t.h5"), "x", "y", **kw).scan(0, 4)


KW = {"val_fraction": 0.1, "loss": CrossEntropyLoss(), "in_features": 4, "out_features": 3}


def _chunked(path, **create):
    """x (40, 4) in chunks of 10 rows, y (40,) int64; returns the byte offset of x's chunk 1 (rows 10-19)."""
    with h5py.File(path, "w") as f:
        x = f.create_dataset("x", data=np.ones((40, 4), np.float32), chunks=(10, 4), **create)
        f["y"] = np.zeros(40, np.int64)
        return x.id.get_chunk_info(1).byte_offset


@pytest.mark.parametrize("create", [{"compression": "gzip"}, {"fletcher32": True}], ids=["gzip", "fletcher32"])
def test_corrupt_chunk_is_a_data_error_naming_file_dataset_and_rows(tmp_path, create):
    path = tmp_path / "d.h5"
    offset = _chunked(path, **create)
    with open(path, "r+b") as fh:  # flip the chunk's first 8 bytes (not all: fletcher32 of the complement matches)
        fh.seek(offset)
        data = fh.read(8)
        fh.seek(offset)
        fh.write(bytes(255 - b for b in data))
    d = Dataset(str(path), "x", "y", **KW)
    where = re.escape(f"{path}: cannot read rows ")
    with pytest.raises(DataError, match=where + r"10 to 19 of dataset 'x' \(data.inputs\)"):
        d.scan(0, 40)
    assert d.scan(20, 40) == ""
    with pytest.raises(DataError, match=where + r"12 to 14 of dataset 'x'"):
        d.read(np.arange(12, 15))
    with pytest.raises(DataError, match=where + r"3, 15, 30 of dataset 'x'"):
        d.read(np.array([30, 3, 15]))
    xs, _ = d.read(np.array([30, 3]))  # the slice covering them holds the bad chunk; the rows themselves do not
    np.testing.assert_array_equal(xs, np.ones((2, 4), np.float32))
    d.close()


def test_missing_external_storage_is_a_data_error(tmp_path):
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros((8, 4), np.float32)
        f.create_dataset("y", shape=(8,), dtype=np.int64, external=[(str(tmp_path / "y.bin"), 0, 8 * 8)])
    d = Dataset(str(path), "x", "y", **KW, allow_external=True)  # refused without (tests/test_file_checks.py)
    with pytest.raises(DataError, match=r"cannot read rows 0 to 7 of dataset 'y' \(data.targets\).*external"):
        d.scan(0, 8)
    d.close()


def test_float64_beyond_float32_is_reported_without_warnings(tmp_path):
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        x = np.zeros((6, 4))
        x[4, 2] = -1e300
        f["x"] = x
        f["y"] = np.zeros(6, np.int64)
    d = Dataset(str(path), "x", "y", **KW)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "inputs contain a value beyond the float32 range (-1e+300 in row 4)" in d.scan(0, 6)
        xs, _ = d.read(np.arange(6))  # training reads convert quietly too; the start-up scan reports the row
    assert np.isinf(xs[4, 2])
    d.close()


def test_scalar_and_empty_datasets(tmp_path):
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["scalar"] = 3.0
        f["empty"] = np.zeros((0, 4), np.float32)
        f["null"] = h5py.Empty("f4")
        f["x"] = np.zeros((4, 4), np.float32)
        f["y"] = np.zeros(4, np.int64)
    with pytest.raises(DataError, match=r"'scalar' \(data.inputs\) is a scalar; expected one row per sample, "
                                        r"shape \(N, \.\.\.\) with 4 features per row"):
        Dataset(str(path), "scalar", "y", **KW)
    with pytest.raises(DataError, match=r"'scalar' \(data.targets\) is a scalar; .* shape \(N,\)"):
        Dataset(str(path), "x", "scalar", **KW)
    with pytest.raises(DataError, match=r"'empty' \(data.inputs\) is empty \(shape \(0, 4\)\)"):
        Dataset(str(path), "empty", "y", **KW)
    with pytest.raises(DataError, match=r"'null' \(data.inputs\) holds no data"):
        Dataset(str(path), "null", "y", **KW)


def test_uint64_target_reports_the_real_value(tmp_path):
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros((4, 4), np.float32)
        f["y"] = np.array([0, 1, 2**64 - 1, 2], np.uint64)
    d = Dataset(str(path), "x", "y", **KW)
    assert f"target {2**64 - 1} in row 2 is not a class index in [0, 3)" in d.scan(0, 4)
    d.close()


def test_data_file_can_also_be_checkpoint_init(tmp_path, monkeypatch):
    """One file with x, y and /params: the data reader must not lock it, or load_weights cannot open it too."""
    monkeypatch.delenv("HDF5_USE_FILE_LOCKING", raising=False)
    path = tmp_path / "d.h5"
    make_classification(path, n=20, features=4)
    layout = ParamLayout([("0.weight", (3, 4)), ("0.bias", (3,))])
    weights = {s.name: np.full(s.shape, i + 1, np.float32) for i, s in enumerate(layout)}
    with h5py.File(path, "a") as f:
        for name, value in weights.items():
            f[f"params/{name}"] = value
    d = Dataset(str(path), "x", "y", **KW)
    assert d.file.mode == "r"
    loaded = load_weights(str(path), layout)
    for name, value in weights.items():
        np.testing.assert_array_equal(loaded[name], value)
    assert d.scan(0, 20) == ""
    d.close()


def test_the_validation_split_is_floor_of_the_fraction_as_written():
    from hpctrain.data import validation_count

    assert validation_count(100, 0.29) == 29  # int(100 * 0.29) is 28
    assert validation_count(1797, 0.1) == 179
    assert validation_count(7, 0.0) == 0 and validation_count(3, 0.5) == 1


def test_the_fingerprint_sees_any_edit_of_a_small_file_and_not_a_copy(tmp_path):
    """Every value of a dataset up to 32 MiB is hashed (an edit of 2% of the rows between sampled slices went
    unseen); a copy, or the same values written again (another chunking), gives the same fingerprint."""
    from hpctrain.data import fingerprint

    x, y = make_classification(tmp_path / "a.h5", n=3000, features=64)

    def of(path):
        with h5py.File(path, "r") as f:
            return fingerprint(str(path), [f["x"], f["y"]])

    with h5py.File(tmp_path / "b.h5", "w") as f:
        f.create_dataset("x", data=x, chunks=(7, 64))
        f["y"] = y.astype(np.int64)
    assert of(tmp_path / "a.h5") == of(tmp_path / "b.h5")
    with h5py.File(tmp_path / "b.h5", "r+") as f:
        f["x"][70:110] = 16.0
    assert of(tmp_path / "a.h5") != of(tmp_path / "b.h5")
