"""ZeRO-2's gradient buffer (hpctrain/parallel/grad_pages.py): released units wait in a pool within its limit and
come back to the units a layer is about to write, with their pages (not faulted in again); without the pool, or
once a move fails, released pages go back to the kernel and read as zeros."""

import mmap

import numpy as np
import pytest

from hpctrain.parallel.grad_pages import ReleasableHost, unit_bytes

HUGE = 2 << 20


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def pooled(n, units_kept, outside=None):
    buf = ReleasableHost(n, outside=[(0, n)] if outside is None else outside, keep_bytes=units_kept * unit_bytes(n * 4))
    if not buf.keep_bytes:
        pytest.skip("no pool here: mremap(MREMAP_DONTUNMAP) needs Linux 5.7 and libc")
    return buf


def test_units_are_huge_pages_for_large_buffers_and_whole_pages_else():
    page = mmap.PAGESIZE
    assert unit_bytes(64 << 20, page, HUGE) == HUGE
    assert unit_bytes(16 * HUGE, page, HUGE) == HUGE
    assert unit_bytes(16 * HUGE - 1, page, HUGE) == -(-(16 * HUGE - 1) // 256 // page) * page
    assert unit_bytes(1000, page, HUGE) == page
    assert unit_bytes(256 * 3 * page, page, HUGE) == 3 * page


def test_released_units_move_to_the_pool_and_back_without_being_zeroed():
    n = 64 << 20 >> 2  # 64 MiB of float32: 32 units of 2 MiB (or 16 KiB pages without huge pages)
    buf = pooled(n, 4)
    per = buf.unit // 4  # floats per unit
    units = n // per
    buf.fill(0, n)  # a backward about to write all of it
    buf.array[:] = np.repeat(np.arange(units, dtype=np.float32), per)
    before = _rss_kb()
    assert buf.release(0, n) == n * 4
    # the pool takes units only while it and the live ones stay within 4 units: the last 4 released
    assert buf.pooled_bytes == 4 * buf.unit
    assert not buf.array.any()  # every unit reads as zeros: its pages left
    assert before - _rss_kb() > 0.8 * (units - 4) * buf.unit / 1024
    held = _rss_kb()
    buf.fill(0, 4 * per)  # the next backward's first four units get those pages back, as they were
    assert buf.moved_in == 4 and buf.pooled_bytes == 0
    got = sorted(float(buf.array[u * per]) for u in range(4))
    assert got == [units - 4, units - 3, units - 2, units - 1]
    for u in range(4):
        assert (buf.array[u * per : (u + 1) * per] == buf.array[u * per]).all()
    assert _rss_kb() - held < 0.2 * 4 * buf.unit / 1024  # nothing faulted in


def test_a_layer_gets_pooled_pages_for_the_units_it_is_first_to_write():
    n = 64 << 20 >> 2
    buf = pooled(n, 4)
    per = buf.unit // 4
    buf.fill(0, n)
    buf.array[:] = 1.0
    buf.release(0, n)
    buf.fill(per // 2, 3 * per)  # half of unit 0, then units 1 and 2: none written since the release
    assert buf.moved_in == 3 and buf.array[: 3 * per].all() and not buf.array[3 * per :].any()
    buf.fill(0, per)  # unit 0 went live with the first call: nothing more
    assert buf.moved_in == 3


def test_a_backward_in_steady_state_writes_into_pooled_pages():
    """Buckets of 2 units written last first, each released once the next is written (one bucket in flight):
    from the second step on every unit is written into pages released before (the first two buckets get the
    previous step's last two), and nothing is faulted in."""
    n = 64 << 20 >> 2
    buf = pooled(n, 4)  # two buckets' worth
    per = buf.unit // 4
    buckets = [(lo, lo + 2 * per) for lo in range(n - 2 * per, -1, -2 * per)]
    for step in range(3):
        moved = buf.moved_in
        for i, (lo, hi) in enumerate(buckets):
            buf.fill(lo, hi)
            buf.array[lo:hi] = step + 1.0
            if i:
                buf.release(*buckets[i - 1])
            assert buf.pooled_bytes + buf._live * buf.unit <= max(buf.keep_bytes, 4 * buf.unit)
        buf.release(*buckets[-1])
        if step:
            assert buf.moved_in - moved == 2 * len(buckets)
    assert not buf.array.any()


def test_the_array_ends_on_a_unit_boundary_and_its_first_unit_is_shared_with_nothing():
    n = (64 << 20 >> 2) - 1000  # not a whole number of units: the first one starts before the array
    buf = pooled(n, 4)
    assert (buf.array.ctypes.data + 4 * n) % buf.unit == 0
    buf.fill(0, n)
    buf.array[:] = 5.0
    released = buf.release(0, n)
    assert released >= 4 * n - mmap.PAGESIZE and buf.pooled_bytes == 4 * buf.unit
    assert not buf.array[1024:].any()
    buf.fill(0, n)
    assert buf.moved_in == 4
    buf.array[:] = 6.0
    assert (buf.array == 6.0).all()


def test_units_beyond_outside_are_never_moved():
    n = 64 << 20 >> 2
    per = unit_bytes(n * 4) // 4
    buf = pooled(n, 4, outside=[(0, n // 2)])
    buf.fill(0, n)
    buf.array[:] = 7.0
    buf.release(n // 2, n)  # not outside: back to the kernel, never pooled
    assert buf.pooled_bytes == 0 and not buf.array[n // 2 :].any()
    buf.release(0, n // 2)
    assert buf.pooled_bytes == 4 * per * 4


def test_a_failed_move_turns_the_pool_off_and_pages_go_back_to_the_kernel():
    n = 64 << 20 >> 2
    buf = pooled(n, 4)
    buf._libc.move = lambda src, dst, size: False
    buf.fill(0, n)
    buf.array[:] = 3.0
    buf.release(0, n)
    assert buf.keep_bytes == 0 and buf.pooled_bytes == 0
    assert not buf.array.any()
    buf.fill(0, n)
    buf.array[:] = 4.0  # the buffer is whole and writable
    assert (buf.array == 4.0).all()


def test_without_a_pool_released_pages_read_as_zeros():
    n = 1 << 20
    buf = ReleasableHost(n, outside=[(0, n)], keep_bytes=0)
    assert buf.keep_bytes == 0
    buf.fill(0, n)
    buf.array[:] = 2.0
    buf.release(0, n)
    assert not buf.array.any() and buf.moved_in == 0


def test_needs_says_whether_a_write_would_bring_released_units_back():
    n = 64 << 20 >> 2
    buf = pooled(n, 4, outside=[(0, n // 2)])  # the second half: this rank's chunk, never released
    per = buf.unit // 4
    assert buf.needs(0, per) and not buf.needs(n // 2, n)
    buf.fill(0, 2 * per)
    assert not buf.needs(0, 2 * per) and buf.needs(per, 3 * per)  # units 0 and 1 live, unit 2 still empty
    buf.release(0, per)
    assert buf.needs(0, per) and not buf.needs(per, 2 * per)
