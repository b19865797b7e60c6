"""Data order, sharding, reading and bad data."""

import h5py
import numpy as np
import pytest

from helpers import make_classification
from hpctrain.data import Dataset, Sampler
from hpctrain.errors import DataError
from hpctrain.nn import CrossEntropyLoss, MSELoss


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


def test_bad_data(tmp_path):
    make_classification(tmp_path / "d.h5", n=20, features=4, nan_row=13)
    kw = dict(val_fraction=0.1, loss=CrossEntropyLoss(), in_features=4, out_features=3)
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
