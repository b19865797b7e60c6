"""Pipeline schedules as data, and a checker that runs every stage on paper before any message is sent.

    schedule = make_schedule("1f1b", num_stages=P, micro_batches=m)
    stats = check_schedule(schedule)   # ScheduleError if it cannot run; same answer on every rank
    executor.run(schedule.stages[s], batch, ...)   # parallel/executor.py, on stage s

A schedule is, for each pipeline stage, a tuple of small instruction objects that the
executor dispatches through one table (DeepSpeed's runtime/pipe/schedule.py). Data
parallel is simply the one-stage schedule. Nothing here communicates: building and
checking a schedule is pure and deterministic, so every rank reaches the same verdict.

Instructions (``mb`` is a micro-batch index 0..m-1; stage s of P):

* ``LoadMicroBatch(mb)`` reads micro-batch mb: inputs on the first stage, targets on the
  last, both when P = 1.
* ``Forward(mb)``, ``Backward(mb)`` compute; on the last stage Forward includes the loss and
  its gradient. The zero-bubble schedule splits a backward in two: ``BackwardInput(mb)`` (B,
  the input gradient, which the previous stage waits for) and ``BackwardWeight(mb)`` (W, the
  weight gradients, which nothing waits for), run later to fill the pipeline's idle time.
* ``SendActivation(mb)`` s -> s+1, ``RecvActivation(mb)`` s-1 -> s, ``SendGrad(mb)`` s -> s-1,
  ``RecvGrad(mb)`` s+1 -> s are the point-to-point ops. Each names its message by a key
  ``(kind, mb, from_stage, to_stage)``; a send and the receive that matches it share the key.
* ``Exchange(send, recv)`` posts a send and a receive together and completes when both have
  (Megatron's send_forward_recv_backward / send_backward_recv_forward).
* ``ReduceGrads()`` is the stage's data-parallel gradient reduction (collective over the
  stage's data-parallel group); ``OptimizerStep()`` follows it.

Model chunks (interleaved 1F1B). With ``virtual_stages = v`` each stage holds v chunks of the
model, round-robin: chunk c of stage s is virtual stage c·P + s, so stage 0 holds the first
chunk and the (P+1)-th. Every micro-batch instruction then names its chunk as well
(``Forward(3, chunk=1)``), messages go between neighbouring virtual stages (stage P − 1's
chunk c sends its activation to stage 0's chunk c + 1), and a MessageKey names virtual
stages. ``interleaved_1f1b`` builds such a schedule and the checker proves it as any other;
the executor runs each chunk on its own range of layers (``parallel.schedule = "interleaved-1f1b"``,
``parallel.virtual_stages = v``).

Rendezvous model. The checker assumes the strictest behaviour MPI allows: a send completes
only once the matching receive is posted (``MPI_Ssend``; every MPI behaves so for large
enough messages). A stage posts all ops of its current instruction at once, keeps them
posted until all have completed, then moves on. A schedule that finishes under this model
finishes under any buffering; one that does not hangs at some message size.

Why paired exchanges. Naive 1F1B writes the steady state with separate blocking calls;
for P = 2, m = 2:

    stage 0: Forward(1), SendActivation(1), RecvGrad(0), Backward(0), ...
    stage 1: Backward(0), SendGrad(0), RecvActivation(1), Forward(1), ...

Stage 0 waits for stage 1 to receive activation 1 while stage 1 waits for stage 0 to
receive gradient 0; neither receive is ever posted. Posting each steady-state send
together with the receive that follows it (``Exchange``) lets both messages complete.
"""

from __future__ import annotations

import functools

from .instructions import (Backward, BackwardInput, BackwardWeight, Exchange, Forward, Instruction, LoadMicroBatch,
                           MessageKey, Op, OptimizerStep, RecvActivation, RecvGrad, ReduceGrads, Schedule,
                           ScheduleError, SendActivation, SendGrad, check_count)
from .schedule_check import Rendezvous, ScheduleStats, check_schedule

__all__ = [
    "SCHEDULES", "Instruction", "LoadMicroBatch", "Forward", "Backward", "SendActivation", "RecvActivation",
    "SendGrad", "RecvGrad", "Exchange", "ReduceGrads", "OptimizerStep", "MessageKey", "Op", "Schedule",
    "ScheduleStats", "ScheduleError", "data_parallel", "gpipe", "one_f_one_b", "zero_bubble", "forward_only",
    "make_schedule", "check_schedule", "built", "checked", "BackwardInput", "BackwardWeight", "paper_makespan",
    "INTERLEAVED", "interleaved_1f1b", "makespan", "zero_bubble_h2", "SPLIT_BACKWARD",
]

SCHEDULES = ("1f1b", "gpipe", "zero-bubble", "zero-bubble-h2")  # training schedules with one model chunk per stage
SPLIT_BACKWARD = ("zero-bubble", "zero-bubble-h2")  # schedules whose backward is B, then W later
INTERLEAVED = "interleaved-1f1b"  # v model chunks per stage (parallel.virtual_stages)


def _load(s: int, p: int, mb: int) -> list:
    return [LoadMicroBatch(mb)] if s in (0, p - 1) else []


def _forward_block(s: int, p: int, mb: int) -> list:
    """Receive (after the first stage), read data (first and last stage), forward, send (before the last)."""
    recv = [RecvActivation(mb)] if s > 0 else []
    send = [SendActivation(mb)] if s < p - 1 else []
    return [*recv, *_load(s, p, mb), Forward(mb), *send]


def _backward_block(s: int, p: int, mb: int) -> list:
    recv = [RecvGrad(mb)] if s < p - 1 else []
    send = [SendGrad(mb)] if s > 0 else []
    return [*recv, Backward(mb), *send]


def _step_end() -> list:
    return [ReduceGrads(), OptimizerStep()]


def data_parallel(micro_batches: int) -> Schedule:
    """One stage: load, forward and backward each micro-batch, then reduce and step (gradient accumulation)."""
    check_count("micro_batches", micro_batches)
    stage = [ins for i in range(micro_batches) for ins in (LoadMicroBatch(i), Forward(i), Backward(i))]
    return Schedule("data-parallel", (tuple(stage + _step_end()),), micro_batches)


def gpipe(num_stages: int, micro_batches: int) -> Schedule:
    """All forwards, then all backwards in the same order (so gradients accumulate in 1F1B's order).

    Every stage keeps all ``micro_batches`` activations alive at the turn. With one stage
    nothing overlaps, so that buys nothing: GPipe is then data parallel, one micro-batch alive.
    """
    check_count("num_stages", num_stages)
    check_count("micro_batches", micro_batches)
    p, m = num_stages, micro_batches
    if p == 1:
        return Schedule("gpipe", data_parallel(m).stages, m)
    stages = []
    for s in range(p):
        forwards = [ins for i in range(m) for ins in _forward_block(s, p, i)]
        backwards = [ins for i in range(m) for ins in _backward_block(s, p, i)]
        stages.append(tuple(forwards + backwards + _step_end()))
    return Schedule("gpipe", tuple(stages), m)


def _one_f_one_b_stage(s: int, p: int, m: int) -> tuple:
    """Megatron-core's non-interleaved 1F1B for stage ``s``: warmup forwards, steady 1F1B, cooldown backwards."""
    warmup = min(p - s - 1, m)
    remaining = m - warmup
    out = [ins for i in range(warmup) for ins in _forward_block(s, p, i)]
    if remaining > 0 and s > 0:
        out.append(RecvActivation(warmup))
    for j in range(remaining):
        f = warmup + j
        out += [*_load(s, p, f), Forward(f)]
        if s < p - 1:
            out.append(Exchange(SendActivation(f), RecvGrad(j)))
        out.append(Backward(j))
        if s > 0:  # the last gradient goes alone: there is no next activation to receive
            out.append(SendGrad(j) if j == remaining - 1 else Exchange(SendGrad(j), RecvActivation(f + 1)))
    out += [ins for i in range(remaining, m) for ins in _backward_block(s, p, i)]
    return tuple(out + _step_end())


def one_f_one_b(num_stages: int, micro_batches: int) -> Schedule:
    """One forward, one backward: stage s keeps at most min(P - s, m) micro-batches alive."""
    check_count("num_stages", num_stages)
    check_count("micro_batches", micro_batches)
    stages = tuple(_one_f_one_b_stage(s, num_stages, micro_batches) for s in range(num_stages))
    return Schedule("1f1b", stages, micro_batches)


def zero_bubble(num_stages: int, micro_batches: int) -> Schedule:
    """ZB-H1-like (Qi et al., "Zero Bubble Pipeline Parallelism", 2024): each backward split into B and W, the
    input gradient sent on after B, and the W passes moved into the time a stage would wait.

    The order comes from a list-scheduling run on paper with F = B = W = one unit and free messages: whenever a
    stage is idle it runs the ready B (the critical path) first, else the next F if fewer than P − s + 1
    micro-batches are in flight (forwarded, their W not yet run), else the oldest pending W. One micro-batch
    more in flight than 1F1B's P − s is what lets W fill the gaps (hpctrain's W keeps each Linear's input and
    output gradient, about a micro-batch's activations). Messages are then placed as 1F1B's are, and each send
    that would deadlock under rendezvous sends is posted together with its stage's next receive (``Exchange``).
    With one stage the split buys nothing: it is data parallel.
    """
    check_count("num_stages", num_stages)
    check_count("micro_batches", micro_batches)
    p, m = num_stages, micro_batches
    if p == 1:
        return Schedule("zero-bubble", data_parallel(m).stages, m)
    return _split_backward("zero-bubble", p, m, [p - s + 1 for s in range(p)])


def zero_bubble_h2(num_stages: int, micro_batches: int) -> Schedule:
    """ZB-H2-like: zero-bubble's list scheduling with more micro-batches in flight, so the W passes fill what is
    left of the bubble. ZB-H1's P − s + 1 leaves P − 2 units of it beyond the step's floor of P − 1 (the last
    stage's first forward waits for P − 1 stages, the first stage's last backward for as many: 3m + P − 1 units
    of one stage's F = B = W = 1; a step ends with every stage's gradients, so the paper's overlap of the next
    step's forwards is not open here). Stage s may hold max(P − s + 1, L) micro-batches, L the smallest of P,
    P + 1, P + 2 whose schedule is shortest on paper (ZB-H1's own limits when none is shorter): 3m + P − 1 for
    every m from P to 3P at P ≤ 7, within P/3 units of it at P = 8 to 16 (P = 8, m = 16: 55 units against ZB-H1's
    61 and 1F1B's 69), for at most P + 2 micro-batches of activations on a stage (1F1B: P − s)."""
    check_count("num_stages", num_stages)
    check_count("micro_batches", micro_batches)
    p, m = num_stages, micro_batches
    if p == 1:
        return Schedule("zero-bubble-h2", data_parallel(m).stages, m)
    best = None
    for floor in (p, p + 1, p + 2, 0):  # 0: ZB-H1's own limits, last (at P = 2 the first is the same schedule)
        schedule = _split_backward("zero-bubble-h2", p, m, [max(p - s + 1, floor) for s in range(p)])
        units = paper_makespan(schedule)
        if best is None or units < best[0] or (units == best[0] and not floor):  # a tie: ZB-H1's less memory
            best = (units, schedule)
        if units <= 3 * m + p - 1:  # the step's floor: nothing shorter to find
            break
    return best[1]


def _split_backward(name: str, p: int, m: int, limits: list[int]) -> Schedule:
    """The list-scheduled F / B / W order with at most ``limits[s]`` micro-batches in flight on stage s, its
    messages placed, deadlock-free."""
    orders = _list_schedule(p, m, limits)
    return _without_deadlocks(name, [list(_zero_bubble_stage(s, p, order)) for s, order in enumerate(orders)], m)


def _without_deadlocks(name: str, stages: list, m: int, v: int = 1, *, training: bool = True) -> Schedule:
    """The schedule of ``stages`` (lists without the step's end: ``_step_end()`` is added to each when
    ``training``, nothing for an evaluation pass) with each send that would deadlock under rendezvous sends
    posted together with its stage's next receive (``Exchange``), one fusion at a time, until every stage runs
    to its end.

    One run on paper: where the stages stop, a blocked send is fused and the run goes on from there (what came
    before it is unchanged, and a rendezvous run ends in the same place whatever order it moves the stages in),
    so building costs one pass over the instructions, not one per fusion (pp 16 × 64 micro-batches × 2
    chunks: 0.2 s, where re-running from the start took 82 s; bench/bench_schedule_build.py)."""
    p = len(stages)
    stages = [list(st) for st in stages]
    run = Rendezvous([[ins.ops(s, p) for ins in st] for s, st in enumerate(stages)])
    waiting_sends = {}  # stage -> (gap to its next receive, -stage) while it waits at a lone send

    def look(s: int) -> None:  # where stage s stands now: at a lone send (a candidate to fuse) or not
        i = run.pc[s]
        if i < len(stages[s]) and isinstance(stages[s][i], (SendActivation, SendGrad)):
            waiting_sends[s] = (_gap_to_next_receive(stages[s], i), -s)
        else:
            waiting_sends.pop(s, None)

    for _ in range(4 * p * m * v + 1):  # each repair fuses one send with a receive: finitely many
        for s in run.run():  # only the stages that moved can stand somewhere else
            look(s)
        if not waiting_sends:
            blocked = [s for s in range(p) if run.pc[s] < len(stages[s])]
            if not blocked:
                end = _step_end() if training else []
                return Schedule(name, tuple(st + end for st in stages), m, v)
            waits = ", ".join(f"stage {s} waits at #{run.pc[s]} {stages[s][run.pc[s]]}" for s in blocked)
            raise ScheduleError(f"schedule {name!r} deadlocks under rendezvous sends: {waits}")
        # one fusion per round, the least disruptive: the send whose next receive is nearest (fewest
        # instructions wait behind the receive), the later stage on a tie
        gap, s = min(waiting_sends.values())
        s, i = -s, run.pc[-s]
        j = i + gap
        if j >= len(stages[s]):
            raise ScheduleError(f"{name}: stage send {stages[s][i]} deadlocks and has no receive after it to pair "
                                "with")
        fused = stages[s][i] = Exchange(stages[s][i], stages[s].pop(j))
        del run.ops[s][j]
        run.ops[s][i] = fused.ops(s, p)
        run.post(s, fused.recv.op(s, p))  # its send is posted already (the stage waits on it)
        look(s)
    raise ScheduleError(f"{name}: no deadlock-free message order found for {p} stages, {m} micro-batches")


def interleaved_1f1b(num_stages: int, micro_batches: int, virtual_stages: int) -> Schedule:
    """Megatron's interleaved 1F1B: each stage holds ``virtual_stages`` model chunks, chunk c of stage s being
    virtual stage c·P + s (round-robin: stage 0 holds the model's first chunk and its (P+1)-th), and the pipeline's
    bubble shrinks to (P − 1)/(v·m + P − 1) of a step, for v times the messages.

    Stage s's order is Megatron-core's: forward k is micro-batch (k // (P·v))·P + k % P of chunk (k // P) % v, its
    backward k the same micro-batch of chunk v − 1 − (k // P) % v; (P − s − 1)·2 + (v − 1)·P warm-up forwards,
    then one forward, one backward, then the remaining backwards. Messages go to the neighbouring virtual stage
    (stage P − 1's chunk c sends to stage 0's chunk c + 1), each posted before (a receive) or after (a send) its
    compute, then fused with the next receive where rendezvous sends would deadlock. ``micro_batches`` must be a
    multiple of ``num_stages`` (the micro-batches go round in groups of P).
    """
    check_count("num_stages", num_stages)
    check_count("micro_batches", micro_batches)
    check_count("virtual_stages", virtual_stages)
    p, m, v = num_stages, micro_batches, virtual_stages
    if v == 1:  # one chunk per stage: plain 1F1B (Megatron-core falls back to it too), fewer warm-up forwards
        return one_f_one_b(p, m)
    if p < 2:
        raise ScheduleError("interleaved-1f1b: needs parallel.pp >= 2 (with one stage there is nothing to interleave)")
    if m % p:
        raise ScheduleError(f"interleaved-1f1b: train.micro_batches ({m}) must be a multiple of parallel.pp ({p})")
    last = p * v - 1
    stages = []
    for s in range(p):
        out = []
        for kind, mb, c in _interleaved_order(s, p, v, m):
            here = c * p + s
            if kind == "F":
                out += [*([RecvActivation(mb, c)] if here > 0 else []),
                        *([LoadMicroBatch(mb, c)] if here in (0, last) else []),
                        Forward(mb, c), *([SendActivation(mb, c)] if here < last else [])]
            else:
                out += [*([RecvGrad(mb, c)] if here < last else []), Backward(mb, c),
                        *([SendGrad(mb, c)] if here > 0 else [])]
        stages.append(out)
    return _without_deadlocks("interleaved-1f1b", stages, m, v)


def _interleaved_order(s: int, p: int, v: int, m: int) -> list[tuple[str, int, int]]:
    """Stage s's ("F" | "B", micro-batch, chunk) order under interleaved 1F1B (see ``interleaved_1f1b``)."""
    total = m * v

    def forward(k: int) -> tuple[int, int]:
        return (k // (p * v)) * p + k % p, (k // p) % v

    def backward(k: int) -> tuple[int, int]:
        mb, c = forward(k)
        return mb, v - 1 - c

    warmup = min((p - s - 1) * 2 + (v - 1) * p, total)
    order = [("F", *forward(k)) for k in range(warmup)]
    for j in range(total - warmup):
        order += [("F", *forward(warmup + j)), ("B", *backward(j))]
    return order + [("B", *backward(k)) for k in range(total - warmup, total)]


def paper_makespan(schedule: Schedule) -> int:
    """Units a training step takes on paper: a Forward, BackwardInput or BackwardWeight one unit, a Backward two
    (B + W), every stage as early as its list allows (with v chunks per stage, a unit is one chunk's: 1/v of a
    stage's forward). The bubble on paper is 1 − 3mv / makespan: (P − 1)/(m + P − 1) for 1F1B and GPipe, ZB-H1's
    (P − 1)/(3m + P − 1) for zero-bubble at P = 2 and m ≥ 2, (P − 1)/(vm + P − 1) for interleaved 1F1B."""
    return int(makespan(schedule, lambda stage, ins: 2 if isinstance(ins, Backward) else 1))


def makespan(schedule: Schedule, cost) -> float:
    """The time a step takes when instruction ``ins`` of stage ``s`` costs ``cost(s, ins)`` (a Forward, Backward,
    BackwardInput or BackwardWeight; everything else is free), a message arrives the moment its sender's compute
    finished, and each stage runs its list in order, waiting where the executor waits: at a receive (alone or in
    an ``Exchange``) until the message is there. With unit costs it is ``paper_makespan``; with the costs a run
    measured per instruction (``StepResult.kernels``) it is the step that run's kernels allow: a measured step
    longer than that lost the difference outside the kernels (messages, data reads, the executor), one longer
    than ``paper_makespan`` predicts may only have unequal stages."""
    p = schedule.num_stages
    last = p * schedule.virtual_stages - 1
    done = {}  # (Forward | "dx", virtual stage, mb) -> when its output (activation, input gradient) was ready
    pc, free = [0] * p, [0.0] * p
    moved = True
    while moved:
        moved = False
        for s in range(p):
            stage = schedule.stages[s]
            while pc[s] < len(stage):
                ins = stage[pc[s]]
                after = _input_ready(ins, s, p, last, done)
                if after is None:  # its message is not there yet: the stage waits here
                    break
                free[s] = max(free[s], after)
                if isinstance(ins, (Forward, Backward, BackwardInput, BackwardWeight)):
                    free[s] += cost(s, ins)
                    if not isinstance(ins, BackwardWeight):
                        done[(Forward if isinstance(ins, Forward) else "dx", ins.chunk * p + s, ins.mb)] = free[s]
                pc[s] += 1
                moved = True
    if any(pc[s] < len(schedule.stages[s]) for s in range(p)):
        raise ScheduleError(f"{schedule.name}: its stages wait on each other (stage positions {pc})")
    return max(free)


def _input_ready(ins, s: int, p: int, last: int, done: dict):
    """When what ``ins`` on stage ``s`` waits for from the neighbouring virtual stage is there (0.0: nothing to
    wait for; None: not yet known)."""
    if isinstance(ins, Exchange):
        ins = ins.recv
    if isinstance(ins, (RecvActivation, Forward)):
        here = ins.chunk * p + s
        return done.get((Forward, here - 1, ins.mb)) if here > 0 else 0.0
    if isinstance(ins, (RecvGrad, Backward, BackwardInput)):
        here = ins.chunk * p + s
        return done.get(("dx", here + 1, ins.mb)) if here < last else 0.0
    return 0.0


def _list_schedule(p: int, m: int, limits: list[int]) -> list[list[tuple[str, int]]]:
    """Each stage's ("F" | "B" | "W", mb) order from a unit-time run on paper (see ``zero_bubble``), stage s
    holding at most ``limits[s]`` micro-batches in flight."""
    done = {}  # (kind, stage, mb) -> time it finished
    orders = [[] for _ in range(p)]
    next_f, next_b, next_w, in_flight, free_at = [0] * p, [0] * p, [0] * p, [0] * p, [0] * p
    t = 0
    while any(len(o) < 3 * m for o in orders):
        for s in range(p):
            if free_at[s] > t:
                continue
            f, b, w = next_f[s], next_b[s], next_w[s]
            ready_b = b < f and (s == p - 1 or done.get(("B", s + 1, b), t + 1) <= t)
            ready_f = f < m and in_flight[s] < limits[s] and (s == 0 or done.get(("F", s - 1, f), t + 1) <= t)
            kind = "B" if ready_b else "F" if ready_f else "W" if w < b else None
            if kind is None:
                continue
            mb = {"B": b, "F": f, "W": w}[kind]
            orders[s].append((kind, mb))
            done[(kind, s, mb)] = t + 1
            free_at[s] = t + 1
            if kind == "F":
                next_f[s] += 1
                in_flight[s] += 1
            elif kind == "B":
                next_b[s] += 1
            else:
                next_w[s] += 1
                in_flight[s] -= 1
        t += 1
    return orders


def _zero_bubble_stage(s: int, p: int, order) -> list:
    out = []
    for kind, mb in order:
        if kind == "F":
            out += _forward_block(s, p, mb)
        elif kind == "B":
            out += [*([RecvGrad(mb)] if s < p - 1 else []), BackwardInput(mb), *([SendGrad(mb)] if s > 0 else [])]
        else:
            out.append(BackwardWeight(mb))
    return out


def _gap_to_next_receive(stage: list, i: int) -> int:
    return next((j - i for j in range(i + 1, len(stage)) if isinstance(stage[j], (RecvActivation, RecvGrad))),
                len(stage))


def forward_only(num_stages: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """Evaluation: each micro-batch flows through once (through every chunk of a stage in turn, with
    ``virtual_stages`` chunks per stage); no backward, no reduction, no step."""
    check_count("num_stages", num_stages)
    check_count("micro_batches", micro_batches)
    check_count("virtual_stages", virtual_stages)
    p, m, v = num_stages, micro_batches, virtual_stages
    if v == 1:
        stages = tuple(tuple(ins for i in range(m) for ins in _forward_block(s, p, i)) for s in range(p))
        return Schedule("forward-only", stages, m)
    last = p * v - 1
    stages = [[ins for i in range(m) for c in range(v)
               for ins in (*([RecvActivation(i, c)] if c * p + s > 0 else []),
                           *([LoadMicroBatch(i, c)] if c * p + s in (0, last) else []),
                           Forward(i, c), *([SendActivation(i, c)] if c * p + s < last else []))]
              for s in range(p)]
    return _without_deadlocks("forward-only", stages, m, v, training=False)


def make_schedule(name: str, num_stages: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """The training schedule called ``name`` (one of SCHEDULES, or INTERLEAVED with ``virtual_stages`` model
    chunks per stage) for ``num_stages`` stages."""
    builders = {"1f1b": one_f_one_b, "gpipe": gpipe, "zero-bubble": zero_bubble, "zero-bubble-h2": zero_bubble_h2}
    if name == INTERLEAVED:
        return interleaved_1f1b(num_stages, micro_batches, virtual_stages)
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; known: {', '.join(SCHEDULES + (INTERLEAVED,))}")
    if virtual_stages != 1:
        raise ScheduleError(f"{name}: one model chunk per stage; more (parallel.virtual_stages = {virtual_stages}) "
                            f"need the {INTERLEAVED} schedule")
    return builders[name](num_stages, micro_batches)


@functools.lru_cache(maxsize=16)
def built(name: str, num_stages: int, micro_batches: int, virtual_stages: int = 1) -> Schedule:
    """The schedule ``name`` (a training schedule of SCHEDULES or INTERLEAVED, or "forward-only"), built once per
    process and shape: schedules are immutable data."""
    return forward_only(num_stages, micro_batches, virtual_stages) if name == "forward-only" else \
        make_schedule(name, num_stages, micro_batches, virtual_stages)


@functools.lru_cache(maxsize=16)
def checked(name: str, num_stages: int, micro_batches: int, virtual_stages: int = 1) -> tuple[Schedule,
                                                                                                "ScheduleStats"]:
    """``built`` and ``check_schedule``-ed, once per process and shape (a ScheduleError is raised again, not
    cached)."""
    schedule = built(name, num_stages, micro_batches, virtual_stages)
    return schedule, check_schedule(schedule)
