"""Pipeline schedules and their checker, with no MPI: the builders' lists, and what the checker refuses."""

import re
from functools import partial

import pytest

from hpctrain.errors import LayoutError
from hpctrain.parallel.schedule import (SCHEDULES, Backward, BackwardInput, BackwardWeight, Exchange, Forward,
                                        Instruction, LoadMicroBatch, MessageKey, Op, OptimizerStep, RecvActivation,
                                        RecvGrad, ReduceGrads, Schedule, ScheduleError, SendActivation, SendGrad,
                                        check_schedule, data_parallel, forward_only, gpipe, interleaved_1f1b,
                                        make_schedule, makespan, one_f_one_b, paper_makespan,
                                        zero_bubble)

SIZES = [(p, m) for p in range(1, 6) for m in range(1, 10)]


def replace_stage(schedule, s, instructions, name=None):
    """``schedule`` with stage ``s`` replaced (and optionally renamed)."""
    stages = list(schedule.stages)
    stages[s] = tuple(instructions)
    return Schedule(name or schedule.name, tuple(stages), schedule.micro_batches, schedule.virtual_stages)


def split_exchanges(schedule):
    """Naive 1F1B: every Exchange written as its send, then its receive."""
    stages = [[part for ins in stage for part in (ins.point_to_point() if isinstance(ins, Exchange) else (ins,))]
              for stage in schedule.stages]
    return Schedule(schedule.name + "-naive", tuple(map(tuple, stages)), schedule.micro_batches)


# ---------------------------------------------------------------------------------------------- instructions


def test_instruction_str_and_repr():
    assert str(Forward(3)) == repr(Forward(3)) == "Forward(3)"
    assert str(ReduceGrads()) == "ReduceGrads()"
    assert str(Exchange(SendActivation(1), RecvGrad(0))) == "Exchange(SendActivation(1), RecvGrad(0))"
    assert Forward(1) != Backward(1)
    assert Forward(1) == Forward(1) and hash(Forward(1)) == hash(Forward(1))


def test_message_keys_match_between_neighbours():
    assert SendActivation(3).ops(1) == (Op(True, MessageKey("activation", 3, 1, 2)),)
    assert RecvActivation(3).ops(2) == (Op(False, MessageKey("activation", 3, 1, 2)),)
    assert SendGrad(3).ops(2) == (Op(True, MessageKey("grad", 3, 2, 1)),)
    assert RecvGrad(3).ops(1) == (Op(False, MessageKey("grad", 3, 2, 1)),)
    assert SendGrad(2).peer(1) == 0 and RecvGrad(2).peer(1) == 2
    assert SendGrad(2).partner() == RecvGrad(2)
    assert Exchange(SendActivation(1), RecvGrad(0)).ops(0) == (SendActivation(1).op(0), RecvGrad(0).op(0))
    for compute in (LoadMicroBatch(0), Forward(0), Backward(0), ReduceGrads(), OptimizerStep()):
        assert compute.ops(0) == ()


def test_bad_instructions():
    with pytest.raises(ValueError, match="mb"):
        Forward(-1)
    with pytest.raises(TypeError, match="send"):
        Exchange(RecvGrad(0), RecvActivation(1))
    with pytest.raises(TypeError, match="recv"):
        Exchange(SendGrad(0), SendActivation(1))


# ---------------------------------------------------------------------------------------------- builders


def test_one_f_one_b_two_stages_two_micro_batches():
    s = one_f_one_b(2, 2)
    assert s.name == "1f1b" and s.num_stages == 2 and s.micro_batches == 2
    assert s.stages[0] == (
        LoadMicroBatch(0), Forward(0), SendActivation(0),
        LoadMicroBatch(1), Forward(1), Exchange(SendActivation(1), RecvGrad(0)), Backward(0),
        RecvGrad(1), Backward(1),
        ReduceGrads(), OptimizerStep(),
    )
    assert s.stages[1] == (
        RecvActivation(0),
        LoadMicroBatch(0), Forward(0), Backward(0), Exchange(SendGrad(0), RecvActivation(1)),
        LoadMicroBatch(1), Forward(1), Backward(1), SendGrad(1),
        ReduceGrads(), OptimizerStep(),
    )


def test_gpipe_two_stages_two_micro_batches():
    s = gpipe(2, 2)
    assert s.stages[0] == (
        LoadMicroBatch(0), Forward(0), SendActivation(0), LoadMicroBatch(1), Forward(1), SendActivation(1),
        RecvGrad(0), Backward(0), RecvGrad(1), Backward(1),
        ReduceGrads(), OptimizerStep(),
    )
    assert s.stages[1] == (
        RecvActivation(0), LoadMicroBatch(0), Forward(0), RecvActivation(1), LoadMicroBatch(1), Forward(1),
        Backward(0), SendGrad(0), Backward(1), SendGrad(1),
        ReduceGrads(), OptimizerStep(),
    )


def test_forward_only_three_stages():
    s = forward_only(3, 2)
    assert s.stages[0] == (LoadMicroBatch(0), Forward(0), SendActivation(0),
                           LoadMicroBatch(1), Forward(1), SendActivation(1))
    assert s.stages[1] == (RecvActivation(0), Forward(0), SendActivation(0),
                           RecvActivation(1), Forward(1), SendActivation(1))
    assert s.stages[2] == (RecvActivation(0), LoadMicroBatch(0), Forward(0),
                           RecvActivation(1), LoadMicroBatch(1), Forward(1))
    assert not s.has_backward and one_f_one_b(3, 2).has_backward


@pytest.mark.parametrize("m", range(1, 10))
def test_data_parallel_is_the_one_stage_pipeline(m):
    dp = data_parallel(m)
    assert dp.stages[0][:3] == (LoadMicroBatch(0), Forward(0), Backward(0))
    assert dp.stages == one_f_one_b(1, m).stages == gpipe(1, m).stages == make_schedule("1f1b", 1, m).stages
    assert len(dp.stages[0]) == 3 * m + 2


def test_make_schedule():
    for name in SCHEDULES:
        assert make_schedule(name, 3, 4).name == name
    assert make_schedule("gpipe", 3, 4) == gpipe(3, 4)
    with pytest.raises(ValueError, match=r"'interleaved'.*1f1b, gpipe, zero-bubble, zero-bubble-h2, interleaved-1f1b"):
        make_schedule("interleaved", 2, 2)


@pytest.mark.parametrize("build", [gpipe, one_f_one_b, forward_only, partial(make_schedule, "1f1b")])
def test_bad_sizes(build):
    with pytest.raises(ValueError, match="num_stages"):
        build(0, 4)
    with pytest.raises(ValueError, match="micro_batches"):
        build(2, 0)
    with pytest.raises(ValueError, match="micro_batches"):
        build(2, True)


def test_bad_micro_batches_for_data_parallel():
    with pytest.raises(ValueError, match="micro_batches"):
        data_parallel(0)


# ---------------------------------------------------------------------------------------------- the checker accepts


@pytest.mark.parametrize("p,m", SIZES)
def test_one_f_one_b_passes_and_keeps_p_minus_s_alive(p, m):
    stats = check_schedule(one_f_one_b(p, m))
    assert stats.peak_live == tuple(min(p - s, m) for s in range(p))
    assert stats.peak_recv_activation == tuple(0 if s == 0 else min(p - s, m) for s in range(p))


@pytest.mark.parametrize("p,m", SIZES)
def test_gpipe_passes_and_keeps_all_alive(p, m):
    stats = check_schedule(gpipe(p, m))
    assert stats.peak_live == ((m,) * p if p > 1 else (1,))  # one stage: GPipe is data parallel
    assert stats.peak_recv_activation == (0,) + (m,) * (p - 1)


@pytest.mark.parametrize("p,m", SIZES)
def test_forward_only_passes(p, m):
    stats = check_schedule(forward_only(p, m))
    assert stats.peak_live == (1,) * p
    assert stats.last_backward == (-1,) * p
    assert stats.peak_recv_activation == (0,) + (1,) * (p - 1)


@pytest.mark.parametrize("m", range(1, 10))
def test_data_parallel_passes(m):
    stats = check_schedule(data_parallel(m))
    assert stats.peak_live == (1,)
    assert stats.peak_recv_activation == (0,)
    assert stats.last_backward == (3 * m - 1,)


@pytest.mark.parametrize("build", [gpipe, one_f_one_b])
def test_last_backward_is_the_index_of_the_last_backward(build):
    schedule = build(4, 6)
    stats = check_schedule(schedule)
    for s, stage in enumerate(schedule.stages):
        assert stage[stats.last_backward[s]] == Backward(5)
        assert Backward(5) not in stage[stats.last_backward[s] + 1:]


@pytest.mark.parametrize("p,m", SIZES)
def test_zero_bubble_passes_and_keeps_one_more_than_one_f_one_b_alive(p, m):
    schedule = zero_bubble(p, m)
    stats = check_schedule(schedule)
    if p == 1:
        assert schedule.stages == data_parallel(m).stages
        return
    assert stats.peak_live == tuple(min(p - s + 1, m) for s in range(p))
    for s, stage in enumerate(schedule.stages):
        assert not any(isinstance(ins, Backward) for ins in stage)
        assert stage[stats.last_backward[s]] == BackwardWeight(m - 1)  # the gradients' last writer: the sync's cue
        index = {ins: i for i, ins in enumerate(stage)}
        assert all(index[BackwardInput(i)] < index[BackwardWeight(i)] for i in range(m))


@pytest.mark.parametrize("p,m", SIZES + [(8, 16), (12, 12)])
def test_zero_bubble_h2_is_never_longer_than_h1_and_reaches_the_floor_from_m_equal_p(p, m):
    """ZB-H2-like: more micro-batches in flight (at most P + 2 on a stage) fill what ZB-H1 leaves of the bubble;
    the step's floor is 3m + P − 1 units (the last stage waits P − 1 for its first forward)."""
    h1, h2 = zero_bubble(p, m), make_schedule("zero-bubble-h2", p, m)
    stats = check_schedule(h2)
    assert h2.name == "zero-bubble-h2"
    assert paper_makespan(h2) <= paper_makespan(h1)
    assert max(stats.peak_live) <= p + 2
    if m >= p > 1:
        assert paper_makespan(h2) == 3 * m + p - 1
    if p <= 2:  # ZB-H1 is at the floor already: the same instructions
        assert h2.stages == h1.stages
    for s, stage in enumerate(h2.stages if p > 1 else ()):  # one stage: data parallel, nothing to split
        assert not any(isinstance(ins, Backward) for ins in stage)
        assert stage[stats.last_backward[s]] == BackwardWeight(m - 1)


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_zero_bubble_is_shorter_than_one_f_one_b(p, m):
    """1F1B's step on paper is (m + p − 1)·3 units; ZB-H1's is 3m + (p − 1)·(F + B − W) = 3m + p − 1."""
    assert paper_makespan(one_f_one_b(p, m)) == 3 * (m + p - 1)
    assert paper_makespan(zero_bubble(p, m)) <= 3 * m + 2 * (p - 1)
    if p == 2:
        assert paper_makespan(zero_bubble(p, m)) == 3 * m + p - 1


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_makespan_on_unequal_stages(m):
    """With measured costs per stage: the slower stage sets the pace. 1F1B at P = 2 with stage 1 twice as slow as
    stage 0 (F 1, B 2 against F 2, B 4) takes stage 0's first forward, stage 1's m forwards and backwards and stage
    0's last backward; unit costs give paper_makespan; a slow stage's bubble on paper grows with m."""
    schedule = one_f_one_b(2, m)

    def costs(*per_stage):
        return lambda s, ins: per_stage[s][0 if isinstance(ins, Forward) else 1]

    assert makespan(schedule, costs((1, 2), (2, 4))) == 1 + m * 6 + 2
    assert makespan(schedule, costs((1, 2), (1, 2))) == paper_makespan(schedule) == 3 * (m + 1)
    fast = makespan(schedule, costs((1.0, 2.0), (1.1, 2.2)))  # 10% apart: stage 0 idles for (F + B)/10 per mb more
    assert fast == pytest.approx(1 + m * 3.3 + 2)
    assert 1 - 3 * m / fast > 1 / (m + 1)


def test_makespan_waits_where_the_list_receives():
    """A stage waits at a receive, as the executor does, even when the instructions after it need nothing from it:
    stage 0 receiving micro-batch 0's gradient before its second forward cannot run that forward early, so this
    order takes 10 units against 1F1B's 9."""
    s0 = (LoadMicroBatch(0), Forward(0), SendActivation(0), RecvGrad(0), LoadMicroBatch(1), Forward(1),
          SendActivation(1), Backward(0), RecvGrad(1), Backward(1), ReduceGrads(), OptimizerStep())
    s1 = (RecvActivation(0), LoadMicroBatch(0), Forward(0), Backward(0), SendGrad(0), RecvActivation(1),
          LoadMicroBatch(1), Forward(1), Backward(1), SendGrad(1), ReduceGrads(), OptimizerStep())
    late = Schedule("late-forward", (s0, s1), 2)
    check_schedule(late)
    assert paper_makespan(late) == 10 and paper_makespan(one_f_one_b(2, 2)) == 9


def test_split_backward_rules():
    one = one_f_one_b(1, 1).stages[0]
    b = one.index(Backward(0))
    with pytest.raises(ScheduleError, match=r"BackwardWeight\(0\) has no BackwardInput\(0\) before it"):
        check_schedule(Schedule("x", (one[:b] + (BackwardWeight(0), BackwardInput(0)) + one[b + 1:],), 1))
    with pytest.raises(ScheduleError, match=r"stage 0 has no BackwardWeight\(0\)"):
        check_schedule(Schedule("x", (one[:b] + (BackwardInput(0),) + one[b + 1:],), 1))
    with pytest.raises(ScheduleError, match=r"splits nothing"):
        check_schedule(Schedule("x", (one[:b] + (BackwardInput(0), Backward(0)) + one[b + 1:],), 1))


def test_large_one_f_one_b_checks():
    stats = check_schedule(one_f_one_b(32, 256))
    assert stats.peak_live == tuple(32 - s for s in range(32))


# ---------------------------------------------------------------------------------------------- deadlocks


def test_naive_one_f_one_b_deadlocks():
    naive = split_exchanges(one_f_one_b(2, 2))
    with pytest.raises(ScheduleError) as info:
        check_schedule(naive)
    message = str(info.value)
    assert message == ("schedule '1f1b-naive' deadlocks under rendezvous sends: "
                       "stage 0 waits at #5 SendActivation(1), stage 1 waits at #4 SendGrad(0)")
    assert isinstance(info.value, LayoutError)


def repaired_from_the_start(name, stages, m, v):
    """The deadlock repair done the slow way: the whole run on paper again after each fusion."""
    from hpctrain.parallel import schedule as sched

    stages = [list(st) for st in stages]
    while True:
        try:
            check_schedule(Schedule(name, tuple(tuple(st + sched._step_end()) for st in stages), m, v))
            return stages
        except ScheduleError as e:
            sends = [(s, i) for s, i in e.at if isinstance(stages[s][i], (SendActivation, SendGrad))]
            s, i = min(sends, key=lambda at: (sched._gap_to_next_receive(stages[at[0]], at[1]), -at[0]))
            j = i + sched._gap_to_next_receive(stages[s], i)
            stages[s] = stages[s][:i] + [Exchange(stages[s][i], stages[s][j])] + stages[s][i + 1 : j] + \
                stages[s][j + 1 :]


@pytest.mark.parametrize("name,p,m,v", [("1f1b", 4, 8, 1), ("zero-bubble", 5, 7, 1), ("zero-bubble", 3, 9, 1),
                                        ("interleaved-1f1b", 3, 6, 2), ("interleaved-1f1b", 4, 8, 3)])
def test_the_one_pass_deadlock_repair_fuses_what_re_running_from_the_start_fuses(name, p, m, v):
    """Building goes on from where the run on paper stopped after each fusion (one pass, so pp 16 x 64
    micro-batches builds in a fraction of a second); re-running from the start after each fusion finds the same."""
    from hpctrain.parallel.schedule import _step_end, _without_deadlocks

    built = make_schedule(name, p, m, v)
    naive = [[part for ins in st[: len(st) - len(_step_end())]
              for part in (ins.point_to_point() if isinstance(ins, Exchange) else (ins,))] for st in built.stages]
    fast = _without_deadlocks(name, [list(st) for st in naive], m, v)
    slow = repaired_from_the_start(name, naive, m, v)
    assert [list(st[: len(st) - len(_step_end())]) for st in fast.stages] == slow
    assert any(isinstance(ins, Exchange) for st in fast.stages for ins in st)
    check_schedule(fast)


@pytest.mark.parametrize("p,m", [(3, 4), (4, 8), (5, 3)])
def test_naive_one_f_one_b_deadlocks_on_more_stages(p, m):
    with pytest.raises(ScheduleError, match="deadlocks under rendezvous sends: stage"):
        check_schedule(split_exchanges(one_f_one_b(p, m)))


def test_receives_on_both_sides_deadlock():
    base = gpipe(2, 1)
    stage0 = list(base.stages[0])
    stage0.remove(RecvGrad(0))
    stage0.insert(stage0.index(SendActivation(0)), RecvGrad(0))  # waits for a gradient before sending the input
    with pytest.raises(ScheduleError, match=re.escape(
            "stage 0 waits at #2 RecvGrad(0), stage 1 waits at #0 RecvActivation(0)")):
        check_schedule(replace_stage(base, 0, stage0))


# ---------------------------------------------------------------------------------------------- unmatched messages


def test_orphan_send_is_named():
    base = one_f_one_b(2, 2)
    stage0 = list(base.stages[0])
    stage0.remove(RecvGrad(1))
    index = base.stages[1].index(SendGrad(1))
    with pytest.raises(ScheduleError, match=re.escape(
            f"schedule '1f1b': stage 1, instruction #{index} SendGrad(1) has no matching RecvGrad(1) on stage 0")):
        check_schedule(replace_stage(base, 0, stage0))


def test_orphan_half_of_an_exchange_is_named():
    base = one_f_one_b(2, 2)
    stage0 = [SendActivation(1) if isinstance(ins, Exchange) else ins for ins in base.stages[0]]
    exchange = Exchange(SendGrad(0), RecvActivation(1))
    index = base.stages[1].index(exchange)
    with pytest.raises(ScheduleError, match=re.escape(
            f"stage 1, instruction #{index} {exchange}: SendGrad(0) has no matching RecvGrad(0) on stage 0")):
        check_schedule(replace_stage(base, 0, stage0))


def test_send_activation_on_the_last_stage():
    base = one_f_one_b(2, 2)
    with pytest.raises(ScheduleError, match=r"stage 1, instruction #11 SendActivation\(0\) has no peer: stage 2"):
        check_schedule(replace_stage(base, 1, base.stages[1] + (SendActivation(0),)))
    dp = data_parallel(2)
    with pytest.raises(ScheduleError, match=r"stage 0, instruction #0 RecvActivation\(0\) has no peer: stage -1"):
        check_schedule(replace_stage(dp, 0, (RecvActivation(0),) + dp.stages[0]))


def test_repeated_message():
    base = gpipe(2, 2)
    with pytest.raises(ScheduleError, match=r"stage 0, instruction #12 SendActivation\(1\) repeats the message "
                                            r"of #5 SendActivation\(1\)"):
        check_schedule(replace_stage(base, 0, base.stages[0] + (SendActivation(1),)))


# ---------------------------------------------------------------------------------------------- ordering


def test_backward_before_forward():
    stage = [LoadMicroBatch(0), Backward(0), Forward(0), ReduceGrads(), OptimizerStep()]
    with pytest.raises(ScheduleError, match=re.escape(
            "schedule 'data-parallel': stage 0, instruction #1 Backward(0) has no Forward(0) before it")):
        check_schedule(replace_stage(data_parallel(1), 0, stage))


def test_missing_forward():
    dp = data_parallel(3)
    stage = [ins for ins in dp.stages[0] if ins != Forward(2)]
    with pytest.raises(ScheduleError, match=r"stage 0, instruction #7 Backward\(2\) has no Forward\(2\) before it"):
        check_schedule(replace_stage(dp, 0, stage))
    fo = forward_only(1, 3)
    stage = [ins for ins in fo.stages[0] if ins != Forward(2)]
    with pytest.raises(ScheduleError, match=r"schedule 'forward-only': stage 0 has no Forward\(2\)"):
        check_schedule(replace_stage(fo, 0, stage))


def test_optimizer_step_before_reduce_grads():
    dp = data_parallel(2)
    stage = dp.stages[0][:-2] + (OptimizerStep(), ReduceGrads())
    with pytest.raises(ScheduleError, match=r"stage 0, instruction #6 OptimizerStep\(\) has no ReduceGrads\(\) before"):
        check_schedule(replace_stage(dp, 0, stage))


def test_backward_after_reduce_grads():
    dp = data_parallel(2)
    stage = dp.stages[0][:3] + (LoadMicroBatch(1), Forward(1), ReduceGrads(), Backward(1), OptimizerStep())
    with pytest.raises(ScheduleError, match=r"#6 Backward\(1\) comes after #5 ReduceGrads\(\)"):
        check_schedule(replace_stage(dp, 0, stage))


def test_forward_before_its_activation_arrives():
    base = gpipe(2, 1)
    stage1 = [LoadMicroBatch(0), Forward(0), RecvActivation(0)] + list(base.stages[1][3:])
    with pytest.raises(ScheduleError, match=r"stage 1, instruction #1 Forward\(0\) has no RecvActivation\(0\) before"):
        check_schedule(replace_stage(base, 1, stage1))


def test_forward_without_load():
    dp = data_parallel(2)
    stage = [ins for ins in dp.stages[0] if ins != LoadMicroBatch(1)]
    with pytest.raises(ScheduleError, match=r"#3 Forward\(1\) has no LoadMicroBatch\(1\) before it"):
        check_schedule(replace_stage(dp, 0, stage))


def test_load_on_a_middle_stage():
    base = gpipe(3, 1)
    with pytest.raises(ScheduleError, match=r"stage 1, instruction #0 LoadMicroBatch\(0\) reads data on a middle"):
        check_schedule(replace_stage(base, 1, (LoadMicroBatch(0),) + base.stages[1]))


def test_micro_batch_out_of_range_and_twice():
    dp = data_parallel(1)
    extra = (LoadMicroBatch(1), Forward(1), Backward(1))
    with pytest.raises(ScheduleError, match=r"#3 LoadMicroBatch\(1\) names micro-batch 1, but the schedule has 1"):
        check_schedule(replace_stage(dp, 0, dp.stages[0][:3] + extra + dp.stages[0][3:]))
    with pytest.raises(ScheduleError, match=r"#3 Forward\(0\) repeats #1"):
        check_schedule(replace_stage(dp, 0, dp.stages[0][:3] + (Forward(0),) + dp.stages[0][3:]))


def test_reduce_grads_in_an_evaluation_schedule():
    fo = forward_only(1, 1)
    with pytest.raises(ScheduleError, match=r"#2 ReduceGrads\(\) in a schedule without Backward"):
        check_schedule(replace_stage(fo, 0, fo.stages[0] + (ReduceGrads(),)))


def test_training_stage_without_optimizer_step():
    dp = data_parallel(1)
    with pytest.raises(ScheduleError, match=r"stage 0 has no OptimizerStep\(\)"):
        check_schedule(replace_stage(dp, 0, dp.stages[0][:-1]))


def test_unknown_instruction():
    dp = data_parallel(1)
    with pytest.raises(ScheduleError, match=r"#3 Instruction\(\) is not an instruction the executor knows"):
        check_schedule(replace_stage(dp, 0, dp.stages[0][:3] + (Instruction(),) + dp.stages[0][3:]))
    with pytest.raises(TypeError, match="not an Instruction"):
        Schedule("x", ((Forward(0), "Backward(0)"),), 1)


# ---------------------------------------------------------------------------------------------- interleaved 1F1B


def compute_order(stage):
    """A stage's ("F" | "B", mb, chunk) in order."""
    return [("F" if isinstance(ins, Forward) else "B", ins.mb, ins.chunk) for ins in stage
            if isinstance(ins, (Forward, Backward))]


def test_a_chunk_shows_in_the_instruction_and_its_messages_cross_to_the_next_virtual_stage():
    assert str(Forward(3, chunk=1)) == "Forward(3, chunk=1)" and str(Forward(3, 0)) == "Forward(3)"
    assert Forward(3, 1) != Forward(3) and Forward(3, 0) == Forward(3)
    # 2 stages: stage 1's chunk 0 is virtual stage 1, whose activation goes to stage 0's chunk 1 (virtual stage 2)
    assert SendActivation(5, 0).ops(1, 2) == (Op(True, MessageKey("activation", 5, 1, 2)),)
    assert RecvActivation(5, 1).ops(0, 2) == (Op(False, MessageKey("activation", 5, 1, 2)),)
    assert SendGrad(5, 1).ops(0, 2) == (Op(True, MessageKey("grad", 5, 2, 1)),)
    assert RecvGrad(5, 0).ops(1, 2) == (Op(False, MessageKey("grad", 5, 2, 1)),)
    assert SendActivation(5, 0).partner(1, 2) == RecvActivation(5, 1)
    assert SendGrad(5, 1).partner(0, 2) == RecvGrad(5, 0) and SendGrad(5, 1).peer(0, 2) == 1
    with pytest.raises(ValueError, match="chunk"):
        Forward(0, -1)
    with pytest.raises(ValueError, match="number of stages"):
        SendActivation(0, 1).key(0)


def test_interleaved_order_is_megatrons():
    """P = 2, v = 2, m = 4: stage 0 warms up with (P − s − 1)·2 + (v − 1)·P = 4 forwards, micro-batches going
    round in groups of P through chunk 0 then chunk 1; backwards run the chunks in reverse."""
    s = interleaved_1f1b(2, 4, 2)
    assert s.name == "interleaved-1f1b" and s.virtual_stages == 2
    assert compute_order(s.stages[0]) == [
        ("F", 0, 0), ("F", 1, 0), ("F", 0, 1), ("F", 1, 1),
        ("F", 2, 0), ("B", 0, 1), ("F", 3, 0), ("B", 1, 1), ("F", 2, 1), ("B", 0, 0), ("F", 3, 1), ("B", 1, 0),
        ("B", 2, 1), ("B", 3, 1), ("B", 2, 0), ("B", 3, 0)]
    assert compute_order(s.stages[1])[:3] == [("F", 0, 0), ("F", 1, 0), ("F", 0, 1)]
    # the first virtual stage reads the inputs, the last (stage 1's chunk 1) the targets
    assert LoadMicroBatch(0, 0) in s.stages[0] and LoadMicroBatch(0, 1) not in s.stages[0]
    assert LoadMicroBatch(0, 1) in s.stages[1] and LoadMicroBatch(0, 0) not in s.stages[1]


@pytest.mark.parametrize("p", [2, 3, 4, 5])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_runs_under_rendezvous_and_its_paper_bubble_is_the_formula(p, v):
    """Proved deadlock-free, every (micro-batch, chunk) forwarded and backwarded once per stage, and the bubble on
    paper exactly (P − 1)/(v·m + P − 1): the 1F1B bubble divided by about v."""
    for m in (p, 2 * p, 3 * p):
        s = interleaved_1f1b(p, m, v)
        stats = check_schedule(s)
        for stage in s.stages:
            order = compute_order(stage)
            assert sorted(order) == sorted((k, i, c) for k in "BF" for i in range(m) for c in range(v))
        bubble = 1 - 3 * m * v / paper_makespan(s)
        assert bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
        one = 1 - 3 * m / paper_makespan(one_f_one_b(p, m))
        assert bubble < one
        # stage 0 keeps Megatron's warm-up of (P − 1)·2 + (v − 1)·P chunk passes, plus the one of its first 1F1B pair
        assert stats.peak_live[0] == min((p - 1) * 2 + (v - 1) * p + 1, m * v)


def test_interleaved_bad_shapes_name_the_settings():
    with pytest.raises(ScheduleError, match=r"train.micro_batches \(3\) must be a multiple of parallel.pp \(2\)"):
        interleaved_1f1b(2, 3, 2)
    with pytest.raises(ScheduleError, match=r"parallel.pp >= 2"):
        interleaved_1f1b(1, 4, 2)
    with pytest.raises(ValueError, match="virtual_stages"):
        interleaved_1f1b(2, 4, 0)
    assert interleaved_1f1b(2, 3, 1) == one_f_one_b(2, 3)  # one chunk: plain 1F1B
    assert make_schedule("interleaved-1f1b", 2, 4, 2) == interleaved_1f1b(2, 4, 2)
    with pytest.raises(ScheduleError, match="interleaved-1f1b"):
        make_schedule("1f1b", 2, 4, 2)


def test_checker_refuses_chunk_faults():
    s = interleaved_1f1b(2, 2, 2)
    # chunk 1 in a schedule of one chunk per stage: its messages go to virtual stages that do not exist
    with pytest.raises(ScheduleError, match=r"SendActivation\(0, chunk=1\) has no peer: stage 3 does not exist "
                                            r"\(2 stages\)"):
        check_schedule(Schedule(s.name, s.stages, s.micro_batches, 1))
    # a chunk beyond the schedule's
    with pytest.raises(ScheduleError, match="names chunk 2, but the schedule has 2 per stage"):
        check_schedule(replace_stage(s, 0, [*s.stages[0][:-2], Forward(0, 2), *s.stages[0][-2:]]))
    # stage 0's chunk 1 forwards micro-batch 0 before receiving its input (the receive moved after it)
    stage = list(s.stages[0])
    recv = next(i for i, ins in enumerate(stage) if ins == RecvActivation(0, 1))
    forward = stage.index(Forward(0, 1))
    stage.insert(forward, stage.pop(recv))
    with pytest.raises(ScheduleError, match=r"Forward\(0, chunk=1\) has no RecvActivation\(0, chunk=1\) before it"):
        check_schedule(replace_stage(s, 0, stage))
    # a load on a chunk that neither starts nor ends the model (stage 0's chunk 1 is virtual stage 2 of 4)
    stage = list(s.stages[0])
    stage.insert(stage.index(Forward(0, 1)), LoadMicroBatch(0, 1))
    with pytest.raises(ScheduleError, match="reads data on a middle stage"):
        check_schedule(replace_stage(s, 0, stage))
    # stage 1 leaves out its chunk-0 backward of micro-batch 1 (sending its gradient anyway): refused
    stage = [ins for ins in s.stages[1] if ins != Backward(1, 0)]
    with pytest.raises(ScheduleError, match=r"SendGrad\(1\) has no Backward\(1\) before it|has no Backward\(1\)"):
        check_schedule(replace_stage(s, 1, stage))


def test_forward_only_goes_through_every_chunk():
    s = forward_only(2, 3, 2)
    assert s.virtual_stages == 2 and not s.has_backward
    stats = check_schedule(s)
    assert stats.peak_live == (1, 1)
    assert [("F", i.mb, i.chunk) for i in s.stages[0] if isinstance(i, Forward)] == [
        ("F", mb, c) for mb in range(3) for c in range(2)]
    assert LoadMicroBatch(2, 1) in s.stages[1] and LoadMicroBatch(2, 0) in s.stages[0]
