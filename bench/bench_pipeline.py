"""Pipeline bubble and activation memory: measured against the (P − 1)/(m + P − 1) formula.

    mpiexec -n 2 python bench/bench_pipeline.py                    # P = 2, m = 1, 2, 4, 8, every schedule
    mpiexec -n 2 python bench/bench_pipeline.py --width 2048 --batch 512 --micro 4 8 --schedules 1f1b zero-bubble
    mpiexec -n 2 python bench/bench_pipeline.py --width 2048 --batch 512 --micro 4 8 --schedules 1f1b interleaved-1f1b
    mpiexec -n 2 python bench/bench_pipeline.py --fixed-ms 5 --width 256   # stages of fixed, equal cost
    mpiexec -n 4 python bench/bench_pipeline.py --stages 4         # P = 4 (on a node with >= 4 cores)
    srun -n 4 python bench/bench_pipeline.py --stages 4            # P = 4 on a cluster

The model has equal-cost stages: ``stages`` blocks of two width × width Linear layers with
ReLU, cut one block per stage (``parallel.stages``); a 64 → width input layer on the first
stage and a width → 10 head on the last are each about 1% of their stage's work at width
1024. (Without the input layer the first stage would do a sixth less work: the model's
first layer computes no input gradient.) Each micro-batch has ``--rows`` rows, so a
step of m micro-batches has m · rows rows and the work per micro-batch stays the same.

For each schedule and m the real ``Trainer.train_step`` runs ``--steps`` times after two
warm-up steps. A stage's bubble is the share of its step, less its gradient reduction and
optimizer work, not spent in its own kernels or data reads (hpctrain.parallel.executor's
``bubble_share``: waits for the other stages, in messages or in the gradient norm's
reduction, which a synchronous step cannot avoid, count as bubble); the figure printed is the mean over stages of the median over steps. The
formula's bubble is the schedule's on paper (``paper_makespan``: F, B and W one unit each, equal
stages): (P − 1)/(m + P − 1) for 1F1B and GPipe, and for zero-bubble ZB-H1's (P − 1)/(3m + P − 1)
once m ≥ P ((P − 1)(F + B − W) idle against m(F + B + W) busy; at m = 1 the one W cannot hide). Peak activation memory is the
largest total of what forward passes kept for their backward passes on a stage. ``--batch`` fixes
the step's rows instead (``batch / m`` per micro-batch, the issue's comparison of schedules at one
batch size); each line then also gives the step time and samples/s against 1F1B's at the same m.
``interleaved-1f1b`` cuts the same layers into P · v virtual stages (``--virtual-stages``, default 2: one
width × width Linear each), stage s running chunks s, s + P, ...; its formula is (P − 1)/(v·m + P − 1), and its
peak live count is of chunk passes (each 1/v of a stage's activations).
"replayed" is the bubble (mean over stages of the median over steps, as measured) of the same step replayed with each compute instruction's measured host time
(``schedule.makespan``; messages, data reads and the executor cost nothing there): what the kernels alone
allow, with stages that are unequal in practice and kernel times that vary. measured / replayed is what the
messages, the data reads and the executor add; replayed / formula what the kernels' own times do.
``--detail`` adds two lines per row: each stage's least and most kernel time in a step (unequal stages and
varying kernel times), how long messages took to arrive once both ends were at them (``Messages``), and each
stage's step split by instruction kind (``Timeline``: compute, receives, other instructions, the executor between
them), and, last, a bare ``Isend`` of one activation (``bare_isend``): MPI's own cost of a send.
``--fixed-ms F`` puts layers of fixed cost in the wide layers' place (``FixedCost``: F ms of a busy loop in the
forward, in B and in W): equal, constant stages, so what stands above the formula is the executor's, the
messages' and the data reads' alone.
Run with one rank per core: oversubscribed ranks measure the scheduler, not the pipeline.

Figure: each schedule's measured bubble against its formula and replay, samples/s, activation memory;
docs/performance.md, "Pipeline" (every run behind it: docs/performance-log.md).
"""

import argparse
import os
import shutil
import sys
import time

import hpctrain  # noqa: F401  (first: it shares the cores between the ranks before numpy starts BLAS)
import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import shared_tempdir, synthetic_classification  # noqa: E402

from hpctrain import register_layer  # noqa: E402
from hpctrain.config import parse_config  # noqa: E402
from hpctrain.nn.layers import Layer  # noqa: E402
from hpctrain.parallel.executor import ACTIVATION  # noqa: E402
from hpctrain.parallel.schedule import (Backward, BackwardInput, BackwardWeight, Exchange, Forward,  # noqa: E402
                                        LoadMicroBatch, RecvActivation, RecvGrad, SendActivation, SendGrad,
                                        make_schedule, makespan, paper_makespan)
from hpctrain.parallel.mesh import Mesh  # noqa: E402
from hpctrain.train import Trainer  # noqa: E402


FEATURES = 64
COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)


def say(*a):
    if MPI.COMM_WORLD.rank == 0:
        print(*a, flush=True)


class FixedCost(Layer):
    """``--fixed-ms``'s stand-in for a wide layer: no parameters, its output a copy of its input, and a fixed cost
    spent in a loop on the clock (one core each, and no cache or memory bandwidth to share): ``ms`` for the forward,
    ``ms`` for the backward's input part B and ``ms`` for its weight part W (2 · ms where the backward is not split),
    the F = B = W of the formula's equal stages."""

    def __init__(self, ms: float):
        self.seconds = ms / 1e3

    def _pass(self, be, x, seconds):
        _spend(seconds)
        out = be.empty(x.shape)
        be.copy_(out, x)
        return out

    def forward(self, be, x):
        return self._pass(be, x, self.seconds), None

    def backward(self, be, dout, saved, accumulate=False, need_dinp=True):
        out = self._pass(be, dout, 2 * self.seconds)
        return out if need_dinp else None

    def backward_input(self, be, dout, saved, accumulate=False, need_dinp=True):
        out = self._pass(be, dout, self.seconds)
        return (out if need_dinp else None), True

    def backward_weight(self, be, wsaved, accumulate=False):
        _spend(self.seconds)


def _spend(seconds: float) -> None:
    """Busy for ``seconds``, the core kept running as a kernel keeps it (a sleep would hand it back, and the Python
    after a sleep runs 2-3x slower here: a cold core)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def register_fixed_cost():
    register_layer("fixed_cost", FixedCost, keys={"ms": float}, required=("ms",))


def pipeline_config(path, stages, width, rows, micro, schedule, virtual=1, fixed_ms=0.0):
    # a cheap input layer on the first stage: its two wide layers then need their input gradients
    # too, so every stage does 2 forward and 4 backward width x width GEMMs per micro-batch
    layers, wide = [{"type": "linear", "in": FEATURES, "out": width}, {"type": "relu"}], []
    for s in range(stages):
        for _ in range(2):
            wide.append(len(layers))
            # (a fixed-cost layer with a LayerNorm, a few microseconds: every virtual stage must hold parameters)
            layers += [{"type": "fixed_cost", "ms": fixed_ms}, {"type": "layernorm", "dim": width}] if fixed_ms else \
                [{"type": "linear", "in": width, "out": width}, {"type": "relu"}]
    layers.append({"type": "linear", "in": width, "out": 10})
    chunks = stages * virtual  # (virtual) stages of 2 / virtual wide layers each, the input layer and head outside
    per = len(wide) // chunks
    starts = [0] + [wide[c * per] for c in range(1, chunks)]
    ranges = [[lo, hi - 1] for lo, hi in zip(starts, starts[1:] + [len(layers)])]
    extra = {"virtual_stages": virtual} if virtual > 1 else {}
    return parse_config({
        "model": {"layers": layers},
        "data": {"path": path, "inputs": "x", "targets": "y", "val_fraction": 0.0, "shuffle": False},
        "train": {"batch_size": rows * micro, "micro_batches": micro, "steps": 10**6, "backend": "cpu",
                  "eval_every": 0},
        "optim": {"name": "sgd", "lr": 1e-4},
        "parallel": {"pp": stages, "schedule": schedule, "stages": ranges, **extra},
    })


def measure(mesh, cfg, steps, detail=False):
    """Per stage: median bubble, peak live micro-batches and bytes, median step seconds, the median bubble of the
    step replayed with each compute instruction's measured time (``replayed_bubble``); with ``detail`` also the
    least and most kernel seconds of a step, and the messages' delivery times (``Messages``)."""
    t = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    schedule = t.runner.schedule
    messages = Messages(t.runner.executor) if detail else None
    timeline = Timeline(t.runner.executor) if detail else None
    bubbles, peaks, spans, replays, kernels = [], [], [], [], []
    for s in range(steps + 2):
        mesh.world.Barrier()
        if messages is not None:
            messages.clear()
            timeline.clear()
        t0 = time.perf_counter()
        timing = t.train_step(s, 1e-4)
        mesh.world.Barrier()
        if s >= 2:
            kernels.append(sum(timing["kernels"].values()))
            if messages is not None:
                messages.settle(mesh)
                timeline.settle()
            bubbles.append(timing["bubble"])
            peaks.append((timing["peak_live"], timing["peak_bytes"]))
            spans.append(time.perf_counter() - t0)
            replays.append(replayed_bubble(mesh, schedule, timing["kernels"]))
    t.close()
    mine = np.array([np.median(bubbles), max(p[0] for p in peaks), max(p[1] for p in peaks), np.median(spans),
                     np.median(replays), min(kernels), max(kernels)], dtype=np.float64)
    if timeline is not None:
        mine = np.concatenate([mine, timeline.medians()])
    every = np.zeros((mesh.size, len(mine)), dtype=np.float64)
    mesh.world.Allgather(mine, every)
    return every, messages  # one row per stage (dp = 1)


class Timeline:
    """Wraps every instruction of an executor to split a step's time on this stage: compute instructions (forward,
    backward, B, W), receives (alone or in an exchange: waits), the other instructions (loads, sends, the
    gradient reduction and the optimizer) and the executor's own time between instructions; and the median time
    of one send (alone, not in an exchange) and of one load after the step's first."""

    PARTS = ("compute", "receive", "other", "between", "one send", "one load")

    def __init__(self, executor):
        self.steps, self.spans = [], []
        for kind, method in list(executor.table.items()):
            part = "compute" if kind in COMPUTE else "receive" if kind in (RecvActivation, RecvGrad, Exchange) \
                else "send" if kind in (SendActivation, SendGrad) else "load" if kind is LoadMicroBatch else "other"
            executor.table[kind] = self._timed(method, part)

    def _timed(self, method, part):
        def run(ins):
            t0 = time.perf_counter()
            method(ins)
            t1 = time.perf_counter()
            self.spans.append((part, t0, t1))

        return run

    def clear(self):
        self.spans = []

    def settle(self):
        """This step's seconds per part."""
        spans = self.spans
        total = dict.fromkeys(self.PARTS, 0.0)
        for part, t0, t1 in spans:
            total["other" if part in ("send", "load") else part] += t1 - t0
        if spans:
            total["between"] = spans[-1][2] - spans[0][1] - sum(t1 - t0 for _, t0, t1 in spans)
        sends = [t1 - t0 for part, t0, t1 in spans if part == "send"]
        loads = [t1 - t0 for part, t0, t1 in spans if part == "load"][1:]  # the first reads the step's rows
        total["one send"] = float(np.median(sends)) if sends else 0.0
        total["one load"] = float(np.median(loads)) if loads else 0.0
        self.steps.append([total[p] for p in self.PARTS])

    def medians(self) -> np.ndarray:
        return np.median(np.array(self.steps, dtype=np.float64), axis=0)


class Messages:
    """Wraps an executor's send and receive so that each message's delivery is timed: from the later of its send
    being posted and its receiver starting to wait, to the receive's return (``time.perf_counter``, one clock for
    the ranks of one node: run the stages on one node). Matched by (sender, tag) over the stages each step."""

    def __init__(self, executor):
        self.ex = executor
        self.sent, self.received, self.delays = [], [], []  # (tag, t); (source, tag, start, end); seconds
        send, recv = executor._send, executor._recv

        def timed_send(ins):
            send(ins)
            self.sent.append((executor._tag(executor._kind(ins), ins.mb, ins.chunk, send=True), time.perf_counter()))

        def timed_recv(ins):
            kind = executor._kind(ins)
            source = (executor.stage + (-1 if kind == ACTIVATION else 1)) % executor.stages
            t0 = time.perf_counter()
            recv(ins)
            self.received.append((source, executor._tag(kind, ins.mb, ins.chunk, send=False), t0, time.perf_counter()))

        executor._send, executor._recv = timed_send, timed_recv  # Exchange calls these
        for kind, method in list(executor.table.items()):
            if method == send:
                executor.table[kind] = timed_send
            elif method == recv:
                executor.table[kind] = timed_recv

    def clear(self):
        self.sent, self.received = [], []

    def settle(self, mesh):
        """Each stage's sends to every stage, then this stage's receives matched with them (collective)."""
        mine = np.array([(tag, t) for tag, t in self.sent], dtype=np.float64).reshape(-1, 2)
        counts = counts_of(mesh, len(mine))
        every = np.zeros((sum(counts), 2), dtype=np.float64)
        mesh.world.Allgatherv(mine, [every, [2 * c for c in counts]])
        posted, at = {}, 0
        for stage, n in enumerate(counts):
            for tag, t in every[at : at + n]:
                posted[(stage, int(tag))] = t
            at += n
        for source, tag, start, end in self.received:
            self.delays.append(end - max(start, posted[(source, tag)]))


def counts_of(mesh, n: int) -> list:
    """Every stage's ``n`` (collective)."""
    every = np.zeros(mesh.size, dtype=np.int64)
    mesh.world.Allgather(np.array([n], dtype=np.int64), every)
    return [int(c) for c in every]


def delivery(mesh, messages) -> str:
    """Median, 90th percentile and largest delivery time over every stage's receives (collective)."""
    mine = np.array(messages.delays, dtype=np.float64)
    counts = counts_of(mesh, len(mine))
    every = np.zeros(sum(counts), dtype=np.float64)
    mesh.world.Allgatherv(mine, [every, counts])
    return (f"{len(every)} deliveries: median {np.median(every) * 1e3:.3f} ms, 90% {np.percentile(every, 90) * 1e3:.3f},"
            f" most {every.max() * 1e3:.3f} ms")


def replayed_bubble(mesh, schedule, kernels) -> float:
    """This stage's bubble in ``schedule`` replayed with each compute instruction's measured host time on its stage
    (``schedule.makespan``): messages, data reads and the executor free, so what the kernels alone allow, unequal
    stages and varying kernel times included. Collective over the stages."""
    s = mesh.pp_rank
    compute = [[ins for ins in stage if type(ins) in COMPUTE] for stage in schedule.stages]
    mine = np.array([kernels[ins] for ins in compute[s]], dtype=np.float64)
    counts = [len(c) for c in compute]
    every = np.zeros(sum(counts), dtype=np.float64)
    mesh.world.Allgatherv(mine, [every, counts])
    seconds = np.split(every, np.cumsum(counts)[:-1])
    cost = {(st, ins): seconds[st][i] for st, stage in enumerate(compute) for i, ins in enumerate(stage)}
    span = makespan(schedule, lambda st, ins: cost[(st, ins)])
    return float(1 - seconds[s].sum() / span)


def bare_isend(world, count: int, repeat: int = 200) -> float:
    """Median seconds of the ``Isend`` call alone, rank 0 to rank 1, the receive posted beforehand: what MPI
    itself costs a send, against the executor's send instruction (``Timeline``). Collective over ``world``."""
    data = np.ones(count, dtype=np.float32)
    took = []
    for i in range(repeat):
        request = world.Irecv(data, source=0, tag=i) if world.rank == 1 else None
        world.Barrier()
        if world.rank == 0:
            t0 = time.perf_counter()
            request = world.Isend(data, dest=1, tag=i)
            took.append(time.perf_counter() - t0)
        if request is not None:
            request.Wait()
    return float(np.median(took)) if took else 0.0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--rows", type=int, default=64, help="rows per micro-batch")
    p.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=0, help="rows per step (batch / m per micro-batch); 0: --rows each")
    p.add_argument("--schedules", nargs="+", default=["1f1b", "gpipe", "zero-bubble", "interleaved-1f1b"])
    p.add_argument("--virtual-stages", type=int, default=2, help="model chunks per stage for interleaved-1f1b")
    p.add_argument("--detail", action="store_true",
                   help="also each stage's least and most kernel ms in a step, and the messages' delivery times")
    p.add_argument("--fixed-ms", type=float, default=0.0,
                   help="wide layers that spend this long per pass in a busy loop instead of multiplying "
                        "(FixedCost): equal, constant stages, so measured / formula is what the executor and the "
                        "messages add")
    a = p.parse_args()
    if a.fixed_ms:
        register_fixed_cost()
    world = MPI.COMM_WORLD
    if world.size != a.stages:
        raise SystemExit(f"run with one rank per stage: mpiexec -n {a.stages} python {sys.argv[0]}")
    mesh = Mesh(pp=a.stages)
    folder = shared_tempdir(world)
    path = os.path.join(folder, "d.h5")
    if world.rank == 0:
        synthetic_classification(path, max(a.batch, a.rows * max(a.micro)), FEATURES, 10)
    world.Barrier()
    per = f"{a.batch} rows per step" if a.batch else f"{a.rows} rows per micro-batch"
    wide = f"fixed-cost layers of {a.fixed_ms} ms a pass (F = B = W), {a.width} wide" if a.fixed_ms else \
        f"{a.width}x{a.width} Linear layers"
    say(f"{MPI.Get_library_version().splitlines()[0].strip()}; P = {a.stages} stages of two {wide}, {per}, "
        f"{a.steps} steps each; "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
    say(f"{'schedule':>16} {'m':>3} {'formula':>8} {'measured':>9} {'ratio':>6} {'replayed':>8} {'ratio':>6} "
        f"{'step ms':>8} {'vs 1f1b':>8}   "
        "per stage: bubble, peak live micro-batches, peak activation MiB")
    step_1f1b = {}
    for schedule in a.schedules:
        v = a.virtual_stages if schedule == "interleaved-1f1b" else 1
        for m in a.micro:
            if v > 1 and m % a.stages:
                say(f"{schedule:>16} {m:>3}   (m must be a multiple of P = {a.stages})")
                continue
            rows_per = a.batch // m if a.batch else a.rows
            cfg = pipeline_config(path, a.stages, a.width, rows_per, m, schedule, v, a.fixed_ms)
            rows, messages = measure(mesh, cfg, a.steps, a.detail)
            P = a.stages
            # (P - 1)/(m + P - 1) for 1F1B, (P - 1)/(v m + P - 1) interleaved
            formula = 1 - 3 * m * v / paper_makespan(make_schedule(schedule, P, m, v))
            replayed = float(rows[:, 4].mean())
            measured = float(rows[:, 0].mean())
            step = float(rows[:, 3].max())
            if schedule == "1f1b":
                step_1f1b[m] = step
            speed = f"{step_1f1b[m] / step:8.3f}" if m in step_1f1b else f"{'':>8}"
            stages = "  ".join(f"s{s}: {r[0]:.3f} {int(r[1])} {r[2] / 2**20:.2f}" for s, r in enumerate(rows))
            say(f"{schedule:>16} {m:>3} {formula:8.3f} {measured:9.3f} {measured / formula:6.3f} {replayed:8.3f} "
                f"{measured / replayed if replayed > 0 else 0:6.3f} {step * 1e3:8.2f} {speed}   {stages}")
            if messages is not None:
                text = delivery(mesh, messages)
                kernels = "  ".join(f"s{s}: {r[5] * 1e3:.1f}-{r[6] * 1e3:.1f}" for s, r in enumerate(rows))
                say(f"{'':>20} kernel ms a step, least-most: {kernels}; messages: {text}")
                parts = "  ".join(f"s{s}: " + ", ".join(f"{name} {v * 1e3:.2f}" for name, v in
                                                          zip(Timeline.PARTS, r[7:11])) for s, r in enumerate(rows))
                say(f"{'':>20} ms a step by instruction kind (medians): {parts}")
                each = "  ".join(f"s{s}: one send {r[11] * 1e6:.0f}, one load {r[12] * 1e6:.0f}"
                                 for s, r in enumerate(rows))
                say(f"{'':>20} µs an instruction (medians): {each}")
    if a.detail and a.stages >= 2:
        say(f"a bare Isend of one activation ({a.rows} x {a.width} float32), receive posted first, rank 0 to 1: "
            f"median {bare_isend(world, a.rows * a.width) * 1e6:.1f} µs")
    mesh.free()
    world.Barrier()
    if world.rank == 0:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
