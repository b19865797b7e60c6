"""A pipeline schedule's vocabulary: the instructions a stage runs, the messages they name, and ``Schedule``, a
stage's instruction list each (parallel/schedule.py describes them, builds the schedules and re-exports these names;
parallel/schedule_check.py proves a schedule runs). Pure data: nothing here communicates.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import ClassVar, NamedTuple

from ..errors import LayoutError

__all__ = ["ACTIVATION", "GRAD", "ScheduleError", "MessageKey", "Op", "Instruction", "LoadMicroBatch", "Forward",
           "Backward", "BackwardInput", "BackwardWeight", "SendActivation", "RecvActivation", "SendGrad", "RecvGrad",
           "Exchange", "ReduceGrads", "OptimizerStep", "Schedule", "check_count"]

ACTIVATION, GRAD = "activation", "grad"  # message kinds in a MessageKey


class ScheduleError(LayoutError):
    """A pipeline schedule would leave a message unmatched, deadlock, or run an instruction too early."""


class MessageKey(NamedTuple):
    """Names one message; a send and the receive that matches it have equal keys."""

    kind: str  # ACTIVATION or GRAD
    mb: int
    from_stage: int
    to_stage: int


class Op(NamedTuple):
    """One point-to-point operation a stage posts: a send or a receive of message ``key``."""

    is_send: bool
    key: MessageKey


# ---------------------------------------------------------------------------------------------- instructions


@dataclass(frozen=True, repr=False)
class Instruction:
    """Base of all instructions. ``str`` and ``repr`` read like the constructor call: ``Forward(3)``.

    Every subclass is made a frozen dataclass (``repr=False``) as it is defined, with no decorator of its own:
    its fields, if any, are its annotations."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        dataclass(frozen=True, repr=False)(cls)

    def point_to_point(self) -> tuple:
        """The point-to-point instructions this one posts: itself, both halves of an Exchange, or none."""
        return ()

    def ops(self, stage: int, num_stages: int | None = None) -> tuple[Op, ...]:
        """What this instruction posts when run on ``stage`` of ``num_stages`` (empty for compute)."""
        return ()

    def __str__(self) -> str:
        return f"{type(self).__name__}()"

    def __repr__(self) -> str:
        return str(self)


class _MicroBatchInstruction(Instruction):
    mb: int
    chunk: int = 0  # interleaved schedules: which of the stage's model chunks (virtual stage chunk·P + stage)

    def __post_init__(self):
        for name in ("mb", "chunk"):
            value = getattr(self, name)
            if type(value) is int and value >= 0:  # the common case, without the ABC check (large schedules)
                continue
            if not isinstance(value, Integral) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{type(self).__name__}: {name} must be an integer >= 0, got {value!r}")

    def __str__(self) -> str:
        return f"{type(self).__name__}({self.mb}{f', chunk={self.chunk}' if self.chunk else ''})"


class LoadMicroBatch(_MicroBatchInstruction):
    """Read micro-batch ``mb``: inputs on the first stage, targets on the last."""


class Forward(_MicroBatchInstruction):
    """Forward pass of micro-batch ``mb`` (with the loss and its gradient on the last stage)."""


class Backward(_MicroBatchInstruction):
    """Backward pass of micro-batch ``mb``; accumulates into the parameter gradients."""


class BackwardInput(_MicroBatchInstruction):
    """B of micro-batch ``mb``: the input gradient (sent on at once); keeps what its BackwardWeight needs."""


class BackwardWeight(_MicroBatchInstruction):
    """W of micro-batch ``mb``: the weight gradients its BackwardInput left, accumulated."""


class _PointToPoint(_MicroBatchInstruction):
    kind: ClassVar[str]
    is_send: ClassVar[bool]
    step: ClassVar[int]  # peer stage = stage + step

    def virtual(self, stage: int, num_stages: int | None = None) -> int:
        """The virtual stage this op runs on: ``chunk · num_stages + stage`` (``stage`` itself for chunk 0)."""
        if self.chunk == 0:
            return stage
        if num_stages is None:
            raise ValueError(f"{self}: a chunk's virtual stage needs the number of stages")
        return self.chunk * num_stages + stage

    def peer(self, stage: int, num_stages: int | None = None) -> int:
        """The virtual stage this op talks to when run on ``stage`` (may not exist: the checker says so); with
        several chunks per stage, it runs on stage ``peer % num_stages``."""
        return self.virtual(stage, num_stages) + self.step

    def key(self, stage: int, num_stages: int | None = None) -> MessageKey:
        """The message this op sends or receives when run on ``stage``, between virtual stages."""
        here = self.virtual(stage, num_stages)
        peer = here + self.step
        if self.is_send:
            return MessageKey(self.kind, self.mb, here, peer)
        return MessageKey(self.kind, self.mb, peer, here)

    def op(self, stage: int, num_stages: int | None = None) -> Op:
        return Op(self.is_send, self.key(stage, num_stages))

    def ops(self, stage: int, num_stages: int | None = None) -> tuple[Op, ...]:
        return (self.op(stage, num_stages),)

    def partner(self, stage: int = 0, num_stages: int | None = None) -> _PointToPoint:
        """The instruction the peer must run to match this one: SendGrad(2) -> RecvGrad(2); with chunks, on
        stage ``peer % num_stages`` in chunk ``peer // num_stages``."""
        if num_stages is None:
            return _PARTNERS[type(self)](self.mb, self.chunk)
        return _PARTNERS[type(self)](self.mb, max(0, self.peer(stage, num_stages)) // num_stages)

    def point_to_point(self) -> tuple:
        return (self,)


class SendActivation(_PointToPoint):
    """Send the output of Forward(mb) from stage s to s+1."""

    kind, is_send, step = ACTIVATION, True, +1


class RecvActivation(_PointToPoint):
    """Receive the input of Forward(mb) from stage s-1."""

    kind, is_send, step = ACTIVATION, False, -1


class SendGrad(_PointToPoint):
    """Send the input gradient from Backward(mb) of stage s to s-1."""

    kind, is_send, step = GRAD, True, -1


class RecvGrad(_PointToPoint):
    """Receive the output gradient for Backward(mb) from stage s+1."""

    kind, is_send, step = GRAD, False, +1


_PARTNERS = {SendActivation: RecvActivation, RecvActivation: SendActivation, SendGrad: RecvGrad, RecvGrad: SendGrad}


class Exchange(Instruction):
    """A send and a receive posted together and completed together, so neither waits on the other."""

    send: SendActivation | SendGrad
    recv: RecvActivation | RecvGrad

    def __post_init__(self):
        if not isinstance(self.send, (SendActivation, SendGrad)):
            raise TypeError(f"Exchange: send must be a SendActivation or SendGrad, got {self.send!r}")
        if not isinstance(self.recv, (RecvActivation, RecvGrad)):
            raise TypeError(f"Exchange: recv must be a RecvActivation or RecvGrad, got {self.recv!r}")

    def point_to_point(self) -> tuple:
        return (self.send, self.recv)

    def ops(self, stage: int, num_stages: int | None = None) -> tuple[Op, ...]:
        return (self.send.op(stage, num_stages), self.recv.op(stage, num_stages))

    def __str__(self) -> str:
        return f"Exchange({self.send}, {self.recv})"


class ReduceGrads(Instruction):
    """This stage's data-parallel gradient reduction; collective over its data-parallel group."""


class OptimizerStep(Instruction):
    """Update this stage's parameters from the reduced gradients."""


@dataclass(frozen=True)
class Schedule:
    """Instruction lists, one per pipeline stage, for one step of ``micro_batches`` micro-batches."""

    name: str
    stages: tuple[tuple[Instruction, ...], ...]
    micro_batches: int
    virtual_stages: int = 1  # model chunks per stage (interleaved 1F1B): chunk c of stage s is virtual stage c·P + s

    def __post_init__(self):
        object.__setattr__(self, "stages", tuple(tuple(stage) for stage in self.stages))
        if not self.stages:
            raise ValueError(f"schedule {self.name!r}: stages must hold at least one stage")
        check_count("micro_batches", self.micro_batches)
        check_count("virtual_stages", self.virtual_stages)
        for s, stage in enumerate(self.stages):
            for i, ins in enumerate(stage):
                if not isinstance(ins, Instruction):
                    raise TypeError(f"schedule {self.name!r}: stage {s}, item #{i} is not an Instruction: {ins!r}")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def has_backward(self) -> bool:
        """True for a training schedule, False for evaluation (forward only)."""
        return any(isinstance(ins, (Backward, BackwardInput)) for stage in self.stages for ins in stage)


def check_count(name: str, value) -> None:
    if not isinstance(value, Integral) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
