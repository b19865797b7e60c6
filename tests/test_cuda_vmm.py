"""zero = 2's device gradient buffer (backend/cuda/vmm.py: ReleasableDevice) on FakeVmm, CUDA's virtual memory calls
over a host array (tests/fake_device.py): which units hold memory when, the handle pool's bound, and that released
memory reads as garbage (NaN) until written again. The same class on a GPU: tests/cuda/test_cuda_memory.py."""

import numpy as np
import pytest

from fake_device import FakeVmm
from hpctrain.backend.cuda.vmm import ReleasableDevice, VmmDriver

UNIT = 16  # float32 a unit (FakeVmm's 64 bytes)


def make(n=8 * UNIT, outside=((4 * UNIT, 8 * UNIT),), keep_units=0):
    vmm = FakeVmm()
    buf = ReleasableDevice(n, outside=outside, keep_bytes=keep_units * vmm.unit, driver=vmm, wrap=vmm.wrap)
    vmm.spare = buf._spare
    buf.array[...] = 0
    assert not vmm.inaccessible()
    return buf, vmm


def test_units_outside_start_on_the_spare_and_the_rest_hold_their_own_memory():
    buf, vmm = make()
    # 4 units hold this rank's chunk, the 4 outside share the spare: 5 handles, 8 mappings
    assert len(vmm.handles) == 5 and len(vmm.mapped) == 8
    assert buf.mapped_bytes == 5 * vmm.unit
    assert not buf.needs(0, 4 * UNIT) and buf.needs(4 * UNIT, 4 * UNIT + 1) and buf.needs(0, 8 * UNIT)


def test_fill_gives_units_memory_and_release_takes_it_back():
    buf, vmm = make()
    buf.fill(5 * UNIT + 3, 7 * UNIT - 1)  # touches units 5 and 6
    assert np.isnan(buf.array[5 * UNIT : 7 * UNIT]).all()  # fresh memory: whatever it held
    assert len(vmm.handles) == 7 and buf.peak_live_bytes == 2 * vmm.unit
    buf.array[5 * UNIT : 7 * UNIT] = 1.0
    assert not buf.needs(5 * UNIT, 7 * UNIT) and not vmm.inaccessible()
    released = buf.release(4 * UNIT + 1, 8 * UNIT)  # unit 4 is not wholly inside: only 5 and 6 were live
    assert released == 2 * vmm.unit
    assert len(vmm.handles) == 5  # no pool (keep_bytes 0): back to the driver
    assert np.isnan(buf.array[5 * UNIT : 7 * UNIT]).all()  # they read the spare now
    assert not vmm.inaccessible()
    np.testing.assert_array_equal(buf.array[: 4 * UNIT], 0)  # the chunk is untouched


def test_the_pool_keeps_handles_up_to_keep_bytes_and_the_most_ever_live():
    buf, vmm = make(n=16 * UNIT, outside=((4 * UNIT, 16 * UNIT),), keep_units=3)
    buf.fill(4 * UNIT, 6 * UNIT)  # 2 live: the pool may then hold at most 2
    buf.release(4 * UNIT, 16 * UNIT)
    assert buf.pooled_bytes == 2 * vmm.unit and len(vmm.handles) == 4 + 1 + 2
    buf.fill(4 * UNIT, 16 * UNIT)  # 12 units: 2 from the pool, 10 new
    assert buf.moved_in == 2 and buf.pooled_bytes == 0 and buf.peak_live_bytes == 12 * vmm.unit
    buf.release(4 * UNIT, 16 * UNIT)
    assert buf.pooled_bytes == 3 * vmm.unit  # keep_bytes bounds it now
    assert len(vmm.handles) == 4 + 1 + 3
    assert buf.mapped_bytes == (4 + 1 + 3) * vmm.unit and not vmm.inaccessible()


def test_a_buffer_that_does_not_end_on_a_unit_is_padded_at_its_start():
    """The buffer's end lies on a unit boundary, as the bucket and chunk cuts are counted from it."""
    n = 5 * UNIT + 3
    buf, vmm = make(n=n, outside=((0, n - 2 * UNIT),))
    assert buf.array.shape == (n,)
    # units: [pad + 0..UNIT-3), then whole ones; outside [0, 3 UNIT + 3): units 1..3 of the padded range lie
    # wholly inside it (unit 0 holds the pad), so 3 units share the spare and 3 hold memory
    assert len(vmm.handles) == 1 + 3 and buf.mapped_bytes == 4 * vmm.unit
    buf.fill(0, n)
    buf.array[...] = 2.0
    assert buf.release(0, n - 2 * UNIT) == 3 * vmm.unit
    np.testing.assert_array_equal(buf.array[: UNIT - 13], 2.0)  # the pad's unit stays
    np.testing.assert_array_equal(buf.array[n - 2 * UNIT :], 2.0)


def test_close_gives_everything_back():
    buf, vmm = make(keep_units=2)
    buf.fill(4 * UNIT, 8 * UNIT)
    buf.release(4 * UNIT, 6 * UNIT)
    buf.close()
    assert not vmm.handles and not vmm.mapped
    buf.close()  # a second call does nothing


def test_a_failed_start_gives_back_what_it_took():
    vmm = FakeVmm()
    real_map, calls = vmm.map, []

    def failing_map(va, handle):
        calls.append(va)
        if len(calls) == 5:
            raise RuntimeError("CUDA driver: CUDA_ERROR_OUT_OF_MEMORY")
        real_map(va, handle)

    vmm.map = failing_map
    with pytest.raises(RuntimeError, match="OUT_OF_MEMORY"):
        ReleasableDevice(8 * UNIT, outside=((4 * UNIT, 8 * UNIT),), driver=vmm, wrap=vmm.wrap)
    assert not vmm.handles and not vmm.mapped


def test_no_driver_under_the_simulator():
    driver, why = VmmDriver.open(simulator=True)
    assert driver is None and "simulator" in why


def test_a_write_into_an_empty_unit_is_caught():
    """On a GPU every empty unit maps one spare: a writer that skipped fill() would write into all of them."""
    buf, vmm = make()
    buf.array[5 * UNIT] = 3.0  # unit 5 is empty: no fill() first
    with pytest.raises(AssertionError, match="written while empty"):
        buf.fill(5 * UNIT, 6 * UNIT)


def test_nothing_to_write_needs_nothing():
    buf, vmm = make()
    assert not buf.needs(5 * UNIT + 3, 5 * UNIT + 3)
    buf.fill(5 * UNIT + 3, 5 * UNIT + 3)
    assert buf.peak_live_bytes == 0
