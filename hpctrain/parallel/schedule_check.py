"""The schedule checker: every stage of a schedule run on paper under rendezvous sends (parallel/schedule.py,
"Rendezvous model") before any message is sent. Pure and deterministic: every rank reaches the same verdict.

    stats = check_schedule(schedule)   # ScheduleError naming the fault; ScheduleStats: what each stage needs
"""

from __future__ import annotations

from dataclasses import dataclass

from .instructions import (Backward, BackwardInput, BackwardWeight, Exchange, Forward, Instruction, LoadMicroBatch,
                           Op, OptimizerStep, RecvActivation, RecvGrad, ReduceGrads, Schedule, ScheduleError,
                           SendActivation, SendGrad)

__all__ = ["ScheduleStats", "check_schedule", "Rendezvous"]


@dataclass(frozen=True)
class ScheduleStats:
    """What each stage of a checked schedule needs; tuples indexed by stage."""

    peak_live: tuple[int, ...]  # micro-batches forwarded and not yet backwarded (activation memory)
    last_backward: tuple[int, ...]  # index of the stage's last Backward (or BackwardWeight), -1 if none
    peak_recv_activation: tuple[int, ...]  # received activations still needed (receive ring size)
    peak_recv_grad: tuple[int, ...] = ()  # received gradients still needed (a W reads its B's); () = 1 each


def check_schedule(schedule: Schedule) -> ScheduleStats:
    """Prove that ``schedule`` runs to the end under rendezvous sends; raise ScheduleError naming the fault.

    Checks, in order: every message has exactly one sender and one receiver; no set of stages
    waits on each other forever; on each stage every instruction comes after what it needs.
    """
    ops = _all_ops(schedule)
    _check_messages(schedule, ops)
    _check_no_deadlock(schedule, ops)
    trains = schedule.has_backward
    walks = [_StageWalk(schedule, s, trains).run() for s in range(schedule.num_stages)]
    return ScheduleStats(peak_live=tuple(w.peak_live for w in walks),
                         last_backward=tuple(w.last_backward for w in walks),
                         peak_recv_activation=tuple(w.peak_recv for w in walks),
                         peak_recv_grad=tuple(w.peak_recv_grad for w in walks))


def _all_ops(schedule: Schedule) -> list:
    """``ops[s][i]``: what instruction i of stage s posts (messages between virtual stages)."""
    p = schedule.num_stages
    return [[ins.ops(s, p) for ins in stage] for s, stage in enumerate(schedule.stages)]


def _where(schedule: Schedule, stage: int, index: int, ins: Instruction) -> str:
    return f"schedule {schedule.name!r}: stage {stage}, instruction #{index} {ins}"


def _stage_messages(schedule: Schedule, s: int, ops: list) -> dict:
    """Message key -> (index, op number) on stage ``s``, in program order; a repeated message is an error."""
    found = {}
    for i, posted in enumerate(ops):
        for k, op in enumerate(posted):
            if op.key in found:
                j, _ = found[op.key]
                where = _where(schedule, s, i, schedule.stages[s][i])
                raise ScheduleError(f"{where} repeats the message of #{j} {schedule.stages[s][j]}")
            found[op.key] = (i, k)
    return found


def _check_messages(schedule: Schedule, ops: list) -> None:
    """Every op has a peer stage that posts the matching op; report the first that does not."""
    p, v = schedule.num_stages, schedule.virtual_stages
    messages = [_stage_messages(schedule, s, ops[s]) for s in range(p)]
    for s in range(p):
        for key, (i, k) in messages[s].items():
            send = ops[s][i][k].is_send
            peer = key.to_stage if send else key.from_stage  # a virtual stage, on stage peer % p
            # (a key names its sender and receiver, so the stage that posts it too is the peer; with one stage of
            # several chunks both ends would be this stage, and _stage_messages refused the repeated key already)
            if 0 <= peer < p * v and key in messages[peer % p]:
                continue
            ins = schedule.stages[s][i]
            part = ins.point_to_point()[k]
            what = _where(schedule, s, i, ins) + ("" if ins is part else f": {part}")
            if not 0 <= peer < p * v:
                count = f"{p} stages" if v == 1 else f"{p * v} virtual stages"
                raise ScheduleError(f"{what} has no peer: stage {peer} does not exist ({count})")
            raise ScheduleError(f"{what} has no matching {part.partner(s, p)} on stage {peer % p}")


def _check_no_deadlock(schedule: Schedule, ops: list) -> None:
    """Run all stages under rendezvous semantics; each op is posted and matched once, so this is linear.

    ``ops[s][i]`` is what instruction i of stage s posts. Assumes _check_messages passed:
    each key is posted once by each of its two stages.
    """
    run = Rendezvous(ops)
    run.run()
    blocked = run.blocked()
    if blocked:
        waits = ", ".join(f"stage {s} waits at #{run.pc[s]} {schedule.stages[s][run.pc[s]]}" for s in blocked)
        raise _Deadlock(f"schedule {schedule.name!r} deadlocks under rendezvous sends: {waits}",
                        [(s, run.pc[s]) for s in blocked])


class Rendezvous:
    """Stages run on paper under rendezvous sends: a stage posts every op of its instruction at once and moves
    on when all are matched. ``run()`` moves every stage as far as it can (``blocked()``: those short of their
    end); a waiting stage's ops may then change at and after its instruction (``ops``, ``post``) and the run go
    on."""

    def __init__(self, ops: list):
        p = len(ops)
        self.ops = [list(stage) for stage in ops]  # ops[s][i]: what instruction i of stage s posts
        self.pc = [0] * p  # current instruction of each stage
        self.waiting = [0] * p  # ops of the current instruction not yet matched
        self.posted = {}  # key -> stage that posted it and waits for its partner
        self.todo = list(range(p))  # stages that may be able to move

    def post(self, s: int, op: Op) -> None:
        """Stage ``s`` posts ``op``: matched at once if its partner waits, else it waits for it."""
        peer = self.posted.pop(op.key, None)
        if peer is None:
            self.posted[op.key] = s
            self.waiting[s] += 1
            return
        self.waiting[peer] -= 1
        if self.waiting[peer] == 0:  # the peer's instruction completed: it may move on
            self.pc[peer] += 1
            self.todo.append(peer)

    def run(self) -> set[int]:
        """Move every stage that can; the stages that moved (or were looked at)."""
        moved = set()
        while self.todo:
            s = self.todo.pop()
            moved.add(s)
            stage = self.ops[s]
            while self.waiting[s] == 0 and self.pc[s] < len(stage):
                for op in stage[self.pc[s]]:
                    self.post(s, op)
                if self.waiting[s] == 0:
                    self.pc[s] += 1
        return moved

    def blocked(self) -> list[int]:
        """The stages that have not reached their end."""
        return [s for s in range(len(self.ops)) if self.pc[s] < len(self.ops[s])]


class _Deadlock(ScheduleError):
    """A deadlock found by the checker, with where each stuck stage waits: ``at`` = [(stage, index)]."""

    def __init__(self, message: str, at):
        super().__init__(message)
        self.at = at


class _StageWalk:
    """One pass over a stage's list: each instruction must come after what it needs; measures the stage."""

    def __init__(self, schedule: Schedule, stage: int, trains: bool):
        self.schedule, self.stage, self.trains = schedule, stage, trains
        self.p, self.v = schedule.num_stages, schedule.virtual_stages
        self.last = self.p * self.v - 1  # the last virtual stage: the loss
        self.seen = {}  # (instruction type, mb or None, chunk) -> index where it ran; live sets hold (mb, chunk)
        self.live, self.recv_live, self.grad_live = set(), set(), set()
        self.peak_live = self.peak_recv = self.peak_recv_grad = 0
        self.last_backward = -1
        self.table = {
            LoadMicroBatch: self._load, Forward: self._forward, Backward: self._backward,
            BackwardInput: self._backward_input, BackwardWeight: self._backward_weight,
            SendActivation: self._p2p, RecvActivation: self._p2p, SendGrad: self._p2p, RecvGrad: self._p2p,
            Exchange: self._p2p, ReduceGrads: self._reduce, OptimizerStep: self._optimizer_step,
        }

    def run(self) -> _StageWalk:
        for self.index, self.ins in enumerate(self.schedule.stages[self.stage]):
            handler = self.table.get(type(self.ins))
            if handler is None:
                self._fail("is not an instruction the executor knows")
            handler(self.ins)
        self._finish()
        return self

    def _fail(self, problem: str):
        raise ScheduleError(f"{_where(self.schedule, self.stage, self.index, self.ins)} {problem}")

    def _virtual(self, ins) -> int:
        return ins.chunk * self.p + self.stage

    def _need(self, cls: type, mb: int | None = None, chunk: int = 0) -> None:
        if (cls, mb, chunk) not in self.seen:
            self._fail(f"has no {cls() if mb is None else cls(mb, chunk)} before it")

    def _record(self, ins: Instruction) -> None:
        """Note that ``ins`` ran here; a micro-batch or chunk out of range, or run twice, is an error."""
        mb, chunk = getattr(ins, "mb", None), getattr(ins, "chunk", 0)
        if mb is not None and mb >= self.schedule.micro_batches:
            self._fail(f"names micro-batch {mb}, but the schedule has {self.schedule.micro_batches}")
        if chunk >= self.v:
            self._fail(f"names chunk {chunk}, but the schedule has {self.v} per stage")
        key = (type(ins), mb, chunk)
        if key in self.seen:
            self._fail(f"repeats #{self.seen[key]}")
        self.seen[key] = self.index

    def _reads_data(self, chunk: int) -> bool:
        return chunk * self.p + self.stage in (0, self.last)

    def _load(self, ins: LoadMicroBatch) -> None:
        if not self._reads_data(ins.chunk):
            self._fail("reads data on a middle stage (only the first and last stages read data)")
        self._record(ins)

    def _forward(self, ins: Forward) -> None:
        self._record(ins)
        if self._reads_data(ins.chunk):
            self._need(LoadMicroBatch, ins.mb, ins.chunk)
        if self._virtual(ins) > 0:
            self._need(RecvActivation, ins.mb, ins.chunk)
        if self.trains:
            self.live.add((ins.mb, ins.chunk))
            self.peak_live = max(self.peak_live, len(self.live))
        else:  # evaluation keeps nothing: one micro-batch at a time, its input freed once used
            self.peak_live = 1
            self.recv_live.discard((ins.mb, ins.chunk))

    def _backward(self, ins: Backward) -> None:
        if (BackwardInput, ins.mb, ins.chunk) in self.seen:
            self._fail(f"splits nothing: #{self.seen[BackwardInput, ins.mb, ins.chunk]} "
                       f"{BackwardInput(ins.mb, ins.chunk)} ran already")
        self._input_half(ins)
        self._weight_half(ins)

    def _backward_input(self, ins: BackwardInput) -> None:
        if (Backward, ins.mb, ins.chunk) in self.seen:
            self._fail(f"comes after #{self.seen[Backward, ins.mb, ins.chunk]} {Backward(ins.mb, ins.chunk)}")
        self._input_half(ins)

    def _backward_weight(self, ins: BackwardWeight) -> None:
        self._need(BackwardInput, ins.mb, ins.chunk)
        self._weight_half(ins)

    def _input_half(self, ins) -> None:
        self._record(ins)
        self._need(Forward, ins.mb, ins.chunk)
        if self._virtual(ins) < self.last:
            self._need(RecvGrad, ins.mb, ins.chunk)
        if (ReduceGrads, None, 0) in self.seen:
            self._fail(f"comes after #{self.seen[ReduceGrads, None, 0]} ReduceGrads()")

    def _weight_half(self, ins) -> None:
        """What a micro-batch holds is freed once its weight gradients are written (a W reads the input
        activation and the received gradient)."""
        if not isinstance(ins, Backward):
            self._record(ins)
            if (ReduceGrads, None, 0) in self.seen:
                self._fail(f"comes after #{self.seen[ReduceGrads, None, 0]} ReduceGrads()")
        held = (ins.mb, ins.chunk)
        self.live.discard(held)
        self.recv_live.discard(held)
        self.grad_live.discard(held)
        self.last_backward = self.index

    def _p2p(self, ins: Instruction) -> None:
        for part in ins.point_to_point():
            self._record(part)
            held = (part.mb, part.chunk)
            if isinstance(part, SendActivation):
                self._need(Forward, *held)
            elif isinstance(part, SendGrad):
                if (BackwardInput, *held) not in self.seen:
                    self._need(Backward, *held)
            elif isinstance(part, RecvActivation):
                self.recv_live.add(held)
                self.peak_recv = max(self.peak_recv, len(self.recv_live))
            elif isinstance(part, RecvGrad):
                self.grad_live.add(held)
                self.peak_recv_grad = max(self.peak_recv_grad, len(self.grad_live))

    def _reduce(self, ins: ReduceGrads) -> None:
        if not self.trains:
            self._fail("in a schedule without Backward")
        self._record(ins)

    def _optimizer_step(self, ins: OptimizerStep) -> None:
        if not self.trains:
            self._fail("in a schedule without Backward")
        self._record(ins)
        self._need(ReduceGrads)

    def _finish(self) -> None:
        """Everything the stage must run at least once did run, in each of its chunks."""
        m = self.schedule.micro_batches
        needed = []
        for c in range(self.v):
            needed += [(Forward, i, c) for i in range(m)]
            if self._reads_data(c):
                needed += [(LoadMicroBatch, i, c) for i in range(m)]
            if self.trains:
                needed += [(Backward, i, c) if (BackwardInput, i, c) not in self.seen else (BackwardWeight, i, c)
                           for i in range(m)]
        if self.trains:
            needed += [(ReduceGrads, None, 0), (OptimizerStep, None, 0)]
        for cls, mb, c in needed:
            if (cls, mb, c) not in self.seen:
                missing = cls() if mb is None else cls(mb, c)
                raise ScheduleError(f"schedule {self.schedule.name!r}: stage {self.stage} has no {missing}")
