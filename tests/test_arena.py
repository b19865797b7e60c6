"""The step arena (hpctrain/backend/arena.py) on host arrays: the plan's offsets, record and replay, and every way
a step can leave the plan without a wrong value. The CUDA backend's use of it (the simulator, and training with
the arena on and off to the same bits) is tests/cuda/test_cuda_arena.py."""

import math
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctrain.backend.arena import ALIGN, StepArena, peak_bytes, plan_offsets


def host_arena():
    """A StepArena over numpy arrays, counting the fresh allocations."""
    fresh = []

    def make(shape, dtype):
        fresh.append(tuple(shape))
        return np.empty(shape, dtype)

    def carve(slab, offset, shape, dtype):
        return np.ndarray(shape, dtype, buffer=slab[offset : offset + math.prod(shape) * dtype.itemsize])

    arena = StepArena(fresh=make, slab=lambda n: memoryview(np.full(n, 0xFF, np.uint8)), carve=carve,
                      refs=lambda a: (a,), root=lambda a: a.base if isinstance(a.base, np.ndarray) else a)
    arena.make = make
    return arena, fresh


def request(arena, shape, dtype=np.float32):
    out = arena.request(shape, dtype)
    return out if out is not None else arena.make(shape, dtype)  # what the backend does with None


def a_step(arena, scale=1.0):
    """A forward and backward of sorts: activations kept to the end, temporaries that die at once, the result
    a host value. Returns it (the same with and without the arena when every array holds what it should)."""
    x = request(arena, (4, 8))
    x[:] = np.arange(32).reshape(4, 8) * scale
    saved = []
    for i in range(3):
        tmp = request(arena, (4, 8))
        np.multiply(x, i + 1, out=tmp)
        act = request(arena, (4, 8))
        np.tanh(tmp, out=act)
        del tmp
        saved.append(act)
    total = 0.0
    for act in reversed(saved):
        g = request(arena, (4,), np.float64)
        g[:] = act.sum(axis=1)
        total += float(g.sum())
    return total


@pytest.mark.parametrize("n", [0, 1, 5])
def test_plan_offsets_stack_arrays_that_live_together_and_reuse_the_space_of_dead_ones(n):
    sizes = [ALIGN * (i + 1) for i in range(n)]
    offsets, total = plan_offsets(sizes, list(range(n)), [n] * n)  # all alive to the end: side by side
    assert total == sum(sizes)
    assert sorted(offsets) == sorted(set(offsets))
    offsets, total = plan_offsets([ALIGN] * n, list(range(n)), [i + 1 for i in range(n)])  # each dies at the next
    assert offsets == [0] * n and total == (ALIGN if n else 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 8)), min_size=1, max_size=40))
def test_no_two_arrays_alive_together_overlap_and_the_slab_holds_the_peak(spec):
    """Random lifetimes: arrays whose [birth, death) intervals meet never share a byte; the slab is at least the
    most bytes alive at once."""
    sizes = [ALIGN * s for s, _ in spec]
    births = list(range(len(spec)))
    deaths = [b + life for b, (_, life) in zip(births, spec)]
    offsets, total = plan_offsets(sizes, births, deaths)
    for i in range(len(spec)):
        assert offsets[i] % ALIGN == 0 and offsets[i] + sizes[i] <= total
        for j in range(i):
            if births[i] < deaths[j]:  # j still alive when i is born
                assert offsets[i] >= offsets[j] + sizes[j] or offsets[j] >= offsets[i] + sizes[i]
    peak = max(sum(s for s, b, d in zip(sizes, births, deaths) if b <= t < d) for t in range(len(spec)))
    assert total >= peak == peak_bytes(sizes, births, deaths)


def test_steps_after_the_first_get_the_same_arrays_and_allocate_nothing():
    arena, fresh = host_arena()
    want = a_step(host_arena()[0])  # outside a step: every array the caller's own
    got, seen = [], []
    for _ in range(4):
        before = len(fresh)
        with arena.step():
            got.append(a_step(arena))
        seen.append(len(fresh) - before)
    assert got == [want] * 4
    assert seen == [10, 0, 0, 0] and arena.plans == 1 and arena.served == 30 and arena.reason == ""
    assert arena.escaped == 0
    # 3 activations and the input alive to the end (4 × 128 B, each on a 512 B granule), temporaries reusing
    assert arena.slab_bytes <= 6 * ALIGN


def test_outside_a_step_and_on_another_thread_the_caller_allocates():
    arena, _ = host_arena()
    assert arena.request((2,), np.float32) is None
    with arena.step():
        a_step(arena)
    with arena.step():
        box = []
        worker = threading.Thread(target=lambda: box.append(arena.request((4, 8), np.float32)))
        worker.start()
        worker.join()
        assert box == [None]
        a_step(arena)
    assert arena.reason == ""


def test_a_request_of_another_shape_leaves_the_plan_for_the_step_and_the_next_records_again():
    arena, fresh = host_arena()
    for _ in range(2):
        with arena.step():
            a_step(arena)
    with arena.step():
        x = request(arena, (4, 8))
        y = request(arena, (3, 3))  # the plan has (4, 8)
        assert arena.reason.startswith("request 1 asked for (3, 3) float32, the plan has (4, 8) float32")
        assert y.shape == (3, 3) and not np.shares_memory(x, y)
    before = len(fresh)
    with arena.step():
        a_step(arena)  # records
    assert len(fresh) - before == 10 and arena.plans == 2
    with arena.step():
        a_step(arena)
    assert len(fresh) - before == 10 and arena.reason == ""


def test_an_array_held_past_its_planned_death_is_never_overwritten():
    """The plan lets the first temporary's memory go to a later array; a step that keeps it instead (a user's
    hook, a changed code path) keeps its values: the arena sees it held and steps aside."""
    arena, fresh = host_arena()
    with arena.step():
        a_step(arena)
    with arena.step():
        x = request(arena, (4, 8))
        tmp = request(arena, (4, 8))
        tmp[:] = 7.0
        act = request(arena, (4, 8))  # the plan reuses tmp's memory from here on (it died in the recorded step)
        act[:] = 1.0
        later = [request(arena, (4, 8)) for _ in range(4)]
        for a in later:
            a[:] = -1.0
        assert np.all(tmp == 7.0), "an array still held was handed out again"
        assert "still held" in arena.reason
        del x, act, later


def test_a_slot_still_held_when_the_next_step_starts_is_not_reused():
    """Something keeps an array of the step (a value logged later): the arena says so at the step's end and the
    next step records again rather than hand the array out a second time."""
    arena, fresh = host_arena()
    with arena.step():
        a_step(arena)
    kept = []
    with arena.step():
        x = request(arena, (4, 8))
        x[:] = 3.0
        kept.append(x)
        del x
        a_step_rest = [request(arena, (4, 8)) for _ in range(6)] + [request(arena, (4,), np.float64)
                                                                     for _ in range(3)]
        del a_step_rest
    assert "still held" in arena.reason
    with arena.step():
        a_step(arena)
    assert np.all(kept[0] == 3.0)


def test_an_array_that_outlives_the_recorded_step_is_fresh_every_step():
    arena, fresh = host_arena()
    kept = []
    for step in range(3):
        before = len(fresh)
        with arena.step():
            a_step(arena)
            keep = request(arena, (2,))
            keep[:] = step
            kept.append(keep)
            del keep
        assert len(fresh) - before == (11 if step == 0 else 1)
    assert arena.escaped == 1 and [float(k[0]) for k in kept] == [0.0, 1.0, 2.0]


def test_a_step_that_raises_makes_no_plan():
    arena, fresh = host_arena()
    with pytest.raises(RuntimeError):
        with arena.step():
            request(arena, (4, 8))
            raise RuntimeError("a rank failed mid-step")
    assert arena.plans == 0
    with arena.step():
        a_step(arena)
    assert arena.plans == 1


def test_an_array_lent_to_another_thread_keeps_its_memory_to_the_end_of_the_step():
    """A pipeline send: the sender thread lets go of the array whenever it has sent it. Recorded while the thread
    still held it or after, the plan is the same: the array's memory is nobody else's until the step ends."""
    for thread_lets_go_at_once in (True, False):
        arena, fresh = host_arena()
        for step in range(3):
            with arena.step():
                sent = request(arena, (4, 8))
                sent[:] = 5.0
                arena.lend(sent[1:])  # a view: the request is found by its memory
                holder = [sent]
                del sent
                if thread_lets_go_at_once:
                    holder.clear()
                later = [request(arena, (4, 8)) for _ in range(3)]
                for a in later:
                    a[:] = -1.0
                assert holder == [] or np.all(holder[0] == 5.0)
                holder.clear()
                del later, a
        assert arena.reason == "" and arena.slab_bytes == 4 * ALIGN
