"""ZeRO's pieces without MPI: the slices of the flat buffer, releasable gradient memory, the config key."""

import mmap

import numpy as np
import pytest

from helpers import config
from hpctrain.errors import ConfigError
from hpctrain.parallel.data_parallel import make_buckets
from hpctrain.parallel.grad_pages import ReleasableHost
from hpctrain.parallel.zero import ALIGN, ZeroShard, bucket_elems, overlap, page_unit, split_near, split_range


@pytest.mark.parametrize("size", [0, 1, 15, 16, 17, 1000, 26_122, 1 << 20])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7, 64])
def test_a_range_splits_in_order_balanced_and_aligned(size, parts):
    pieces = split_range(5, 5 + size, parts)
    assert len(pieces) == parts and pieces[0][0] == 5 and pieces[-1][1] == 5 + size
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))  # contiguous, in rank order
    assert all((lo - 5) % ALIGN == 0 or lo == 5 + size for lo, _ in pieces)
    assert max(hi - lo for lo, hi in pieces) <= -(-size // parts) + ALIGN - 1  # 1/parts, plus one alignment pad


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
@pytest.mark.parametrize("limit", [None, 9_000])
def test_every_value_has_one_owner_and_round_trips(dp, limit):
    """Every value below ``limit`` (a tied replica lies beyond it) is updated by exactly one rank."""
    size = 10_007
    shards = [ZeroShard(make_buckets(size, 1000), dp, r, limit=limit) for r in range(dp)]
    end = size if limit is None else limit
    assert sum(s.size for s in shards) == end and shards[0].sizes() == [s.size for s in shards]
    full = np.arange(size, dtype=np.float32)
    back = np.full(size, -1, dtype=np.float32)
    for r, s in enumerate(shards):
        mine = np.concatenate([full[a:b] for a, b in s.pieces])
        assert mine.size == s.size and all(b <= end or a == b for a, b in s.pieces)
        s.place(back, r, mine)
    assert np.array_equal(back[:end], full[:end]) and (back[end:] == -1).all()
    assert shards[-1].parts == ZeroShard(make_buckets(size, 1000), dp, dp - 1).parts  # what the collectives move


@pytest.mark.parametrize("dp", [1, 2, 3, 4, 8])
def test_zero_2_cuts_large_buckets_on_huge_pages_from_the_end(dp):
    """Bucket and chunk cuts on multiples of a huge page counted from the buffer's end (where the buckets start
    and the gradient buffer ends on a page): each chunk within one page of an even share."""
    size = 50_343_936  # the 50 M MLP of bench/bench_memory.py
    unit = page_unit(size)
    assert unit == (2 << 20) // 4 and page_unit(unit * 16 - 1) == 0
    elems = bucket_elems(25.0, unit)
    assert elems % unit == 0 and 0 <= elems - 25e6 / 4 < unit
    buckets = make_buckets(size, elems)
    shard = ZeroShard(buckets, dp, 0, unit=unit)
    for (lo, hi), parts in zip(buckets, shard.parts):
        assert parts[0][0] == lo and parts[-1][1] == hi
        assert all(b == c for (_, b), (c, _) in zip(parts, parts[1:]))
        if hi - lo >= 3 * dp * unit:
            assert all((size - b) % unit == 0 for _, b in parts[:-1])
            assert all(abs((b - a) - (hi - lo) / dp) <= unit for a, b in parts)
        else:  # too small to cut on pages: the cache-line cut
            assert parts == split_range(lo, hi, dp)
    owners = np.zeros(size, dtype=np.int64)
    for r in range(dp):
        for a, b in ZeroShard(buckets, dp, r, unit=unit).pieces:
            owners[a:b] += 1
    assert (owners == 1).all()


def test_a_near_cut_stays_in_order_when_the_pages_are_coarse():
    assert split_near(0, 10, 4, 8, 10) == [(0, 2), (2, 2), (2, 10), (10, 10)]
    assert split_near(0, 96, 2, 16, 96) == [(0, 48), (48, 96)]
    assert split_near(5, 101, 2, 16, 101) == [(5, 53), (53, 101)]


def test_overlap_of_ranges():
    assert overlap((0, 10), (5, 20)) == (5, 10)
    assert overlap((0, 10), (10, 20)) == (10, 10)
    lo, hi = overlap((30, 40), (0, 10))
    assert hi == lo  # empty


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_released_pages_read_as_zeros_and_leave_memory():
    n = 64 << 20 >> 2  # 64 MiB of float32
    buf = ReleasableHost(n)
    if not buf.releasable:
        pytest.skip("madvise(MADV_DONTNEED) is not available here")
    before = _rss_kb()
    buf.array[:] = 1.0
    touched = _rss_kb()
    assert touched - before > 60_000
    page = mmap.PAGESIZE // 4
    released = buf.release(page // 2, n - 10)  # partial pages at either end stay
    assert released == (n - 10) // page * page * 4 - page * 4
    assert _rss_kb() < touched - 60_000
    assert buf.array[: page].all() and not buf.array[page : (n - 10) // page * page].any()
    assert buf.array[-10:].all()
    buf.array[page] = 2.0  # writable again: one page back
    assert buf.array[page] == 2.0


@pytest.mark.parametrize("value, message", [(4, "must be 0, 1, 2 or 3"), (-1, "must be 0, 1, 2 or 3"),
                                            ("1", "expected int"), (True, "")])
def test_bad_zero_is_one_line_naming_the_key(tmp_path, value, message):
    with pytest.raises(ConfigError, match=f"parallel.zero.*{message}"):
        config(tmp_path / "d.h5", parallel={"zero": value})


def test_zero_with_the_parameter_server_names_both_keys(tmp_path):
    with pytest.raises(ConfigError, match='parallel.zero: zero = 1 with parallel.mode = "async_ps" is not supported'):
        config(tmp_path / "d.h5", parallel={"zero": 1, "mode": "async_ps"})


def test_zero_alone_on_one_rank_says_it_has_no_effect(tmp_path):
    from helpers import make_classification, train_params
    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer
    from mpi4py import MPI

    make_classification(tmp_path / "d.h5", n=64)
    cfg = config(tmp_path / "d.h5", parallel={"zero": 2}, train={"steps": 2})
    lines = []
    mesh = Mesh(comm=MPI.COMM_SELF)
    t = Trainer(cfg, mesh=mesh, log=lines.append)
    try:
        t.run()
        assert t.zero == 0 and t.grad_memory is None
    finally:
        t.close()
        mesh.free()
    said = [line for line in lines if "parallel.zero" in line]
    assert said == ["parallel.zero = 2 has no effect with one data-parallel rank (dp = 1): nothing to shard the "
                    "optimizer state or gradients over"]
    assert np.allclose(train_params(cfg, MPI.COMM_SELF)["0.weight"],
                       train_params(config(tmp_path / "d.h5", train={"steps": 2}), MPI.COMM_SELF)["0.weight"])


def test_zero_reduce_without_zero_is_said_once_to_have_no_effect(tmp_path):
    from helpers import make_classification
    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer
    from mpi4py import MPI

    make_classification(tmp_path / "d.h5", n=64)
    for how, want in (("allreduce", 1), ("auto", 0)):
        lines = []
        mesh = Mesh(comm=MPI.COMM_SELF)
        t = Trainer(config(tmp_path / "d.h5", parallel={"zero_reduce": how}, train={"steps": 1}), mesh=mesh,
                    log=lines.append)
        t.close()
        mesh.free()
        said = [line for line in lines if "zero_reduce" in line]
        assert said == ['parallel.zero_reduce = "allreduce" has no effect with parallel.zero = 0: without ZeRO every '
                        "bucket is Allreduced"][:want]
