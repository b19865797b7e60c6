"""CUDA backend: every kernel of a training step as a ``numba.cuda.jit`` kernel on one stream.

    [train]
    backend = "cuda"          # or "auto": the GPU when there is one

Shape letters: B batch rows, C features, K reduction size, M/N output rows/columns
of a product, n elements of a flat buffer; the transformer ops add T sequence,
V vocabulary, H heads of hs = C/H channels. The methods and their signatures are
CpuBackend's (cpu/); arrays are numba device arrays. Parameters, gradients,
optimizer state and activations stay on the device for the whole step: what
crosses the bus each step is the input batch (``asarray``) and a few scalars
(the loss sum and correct count from ``cross_entropy``/``mse``, the gradient norm
from ``sum_squares``, the first bad token position from ``embedding_forward``),
the sort order of the token ids up for ``embedding_backward``'s deterministic
scatter-add, plus the gradients when MPI is not CUDA-aware (``to_host_into``/
``from_host_into`` through a pinned buffer). See docs/gpu.md.

Every kernel and copy goes on the backend's one stream, in order. The host waits for
the stream only where it must read a result: ``to_host``, ``read_host`` (several arrays,
one wait), the losses and ``sum_squares`` when they return host values, the embedding
ops given device ids (the ids come back for the range check and the sort), and
``synchronize()`` (before MPI reads device memory). A training step avoids all but one:
its ids and targets stay on the host (checked there, uploaded here), its losses and
gradient norm go ``into`` device scalars, and the step reads them together once
(train/step.py). ``host_waits`` counts the waits for the whole stream, ``mark_waits``
those for an earlier mark (the tests' hooks).

Launch shapes are fixed at construction: ``tile`` (the GEMM tiling, see
gemm/tiled.py) and ``block`` (threads per block of the other kernels). The
defaults are for real GPUs; under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``),
which runs every GPU thread as a Python thread, they default to tiny ones.

The GEMMs are shaped to fill the GPU: without an explicit ``tile`` the backend
takes the largest of the 128×128, 64×64 and 32×32 tilings whose grid makes one
full wave (a block per SM), else the 32×32. A weight gradient (``matmul_tn``,
K = the batch's rows) chooses from the first two, and one whose grid is still under
a wave is split along K into up to 2 waves of blocks (gemm/tiled.py, ``k_splits``), the
partial products summed in a fixed order. Attention runs its products as batched
GEMMs over (batch, head) with the 64×64 tiling. ``bench/gemm_grids.py`` lists the
grid of every GEMM of a GPT step.

The package, a module per family of ops with forward and backward side by side, each holding its kernels
(``kernels(nt)``, built once per block size; compile.py lists them all) and a mixin class with its methods:
linear.py (products, bias gradient), gemm/ (the GEMM providers: tiled.py, cublaslt.py), activations.py (and the
residual add), norm.py, loss.py, embedding.py, attention.py (softmax rows around batched GEMMs), flash.py,
dropout.py, optim.py. replay.py wires a training step to the step arena (backend/arena.py) and its graphs (graphs.py).
This module is the rest: construction, memory (memory.py's pool, vmm.py for zero = 2), copies, streams and
events, and launching (launch.py). blocks.py holds the reductions the families share, sim.py the
simulator's mend and launch bounds.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import numpy as np
from numba import cuda

from ...errors import BackendError
from ..base import Backend, Mark, PendingRead, StreamWaits, check_array
from . import activations, attention, blocks, dropout, embedding, linear, loss, norm, optim
from .activations import Activations
from .attention import Attention
from .dropout import Dropout
from .embedding import Embedding
from .flash import FlashAttention
from .gemm import Gemm
from .gemm.tiled import GPU_SMALL_TILE, GPU_TILE, GPU_TILES, GPU_TN_TILES, SIM_TILE, GemmTile
from .launch import Launcher, kernel_name, traced_arguments
from .linear import Linear
from .loss import Loss
from .memory import (DevicePool, flat, is_device_array, is_out_of_memory, out_of_memory_error, raw_alloc, wrap,
                     wrap_address)
from .norm import Norm
from .optim import Optim
from .replay import StepReplay
from .vmm import ReleasableDevice, VmmDriver

__all__ = ["CudaBackend", "simulator", "FAMILIES"]

# the modules whose ``kernels(block)`` the backend launches (flash.py's and gemm/'s are keyed by head size and tile)
FAMILIES = (blocks, linear, activations, norm, loss, embedding, attention, dropout, optim)
GPU_BLOCK, SIM_BLOCK = 256, 16
COLUMN_ROWS = 16  # the column sums' row groups leave each thread at least this many rows
PARTIAL_ALIGN = 16  # float64 values in a 128-byte cache line: the rows of a last-block reduction's partials
STAGING_PER_SHAPE = 64  # upload's page-locked buffers of one shape (a step uses one per micro-batch)
SIM_MAX_BLOCKS = 4  # small, so that the simulator exercises the grid-stride loops
SIM_WAVE = 4  # "SMs" under the simulator: small, so that tiny products take the split-K path there


def simulator() -> bool:
    """True when numba-cuda runs the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``)."""
    from numba.cuda.core import config

    return bool(config.ENABLE_CUDASIM)


class CudaBackend(Linear, Gemm, Activations, Norm, Dropout, Embedding, Attention, FlashAttention, Loss, Optim,
                  StepReplay, StreamWaits, Backend):
    """Arrays are numba device arrays on one GPU; ``CudaBackend(device_id=0, tile=..., block=...)``.

    ``device_id`` is the GPU to use (the node-local rank when started by ``get_backend``);
    with a single visible GPU (e.g. Slurm's per-task ``CUDA_VISIBLE_DEVICES``) any id
    maps to it. ``tile`` is a ``GemmTile`` (or a 5-tuple BM, BN, BK, TM, TN), ``block``
    the threads per block of the other kernels (a power of two), ``max_blocks`` the
    grid cap of the grid-stride kernels, ``arena`` whether a training step's arrays come from the step arena
    (``step_scope``), ``graphs`` (True, False or "auto": wherever the arena is on) whether its kernels are then
    replayed in segments, each one CUDA graph (graphs.py; emulated under the simulator), ``gemm`` the GEMM
    provider ("auto", "cublaslt" or "numba": gemm/__init__.py; ``gemm_provider`` says which one runs).
    """

    name = "cuda"
    is_device = True
    defers_step_values = True  # clipping and skipping decided on the device, the step's values read a step late

    def __init__(self, device_id: int = 0, *, tile=None, block: int | None = None, max_blocks: int | None = None,
                 arena: bool = True, graphs: bool | str = "auto", gemm: str = "auto", tf32: bool = False):
        self.simulator = simulator()
        if not cuda.is_available():
            raise BackendError("the CUDA backend needs a GPU: numba.cuda sees none (check nvidia-smi, or set "
                               "NUMBA_ENABLE_CUDASIM=1 to run the kernels in the simulator)")
        if int(device_id) < 0:
            raise BackendError(f"CUDA device_id must be >= 0, got {device_id}")
        if self.simulator:
            self.device_id = 0  # the simulator has one device, shared by every rank
            self.device_name = "CUDA simulator"
        else:
            count = len(cuda.gpus)
            if count > 1 and device_id >= count:
                raise BackendError(f"CUDA device {device_id} requested (the node-local rank) but only {count} GPUs "
                                   "are visible: start at most one rank per GPU on each node")
            self.device_id = int(device_id) if count > 1 else 0
            cuda.select_device(self.device_id)
            name = cuda.get_current_device().name
            name = name.decode() if isinstance(name, bytes) else str(name)
            self.device_name = f"{name} (device {self.device_id})"
        self.tile = GemmTile(*(tile if tile is not None else (SIM_TILE if self.simulator else GPU_TILE))).check(
            aligned=not self.simulator)
        # the tilings to choose from, largest first; an explicit tile (tests, benchmarks) is used everywhere. A
        # weight gradient (matmul_tn: K is the batch's rows) still under a wave is split along K rather than cut
        # into tiny tiles, so it chooses from the first two only; attention's batched products use the 64×64.
        explicit = tile is not None or self.simulator
        self.tiles = (self.tile,) if explicit else GPU_TILES
        self.tn_tiles = (self.tile,) if explicit else GPU_TN_TILES
        self.attention_tile = self.tile if explicit else GPU_SMALL_TILE
        self.wave = SIM_WAVE if self.simulator else _multiprocessors()  # blocks in one wave of the GEMM grid
        self.block = int(block if block is not None else (SIM_BLOCK if self.simulator else GPU_BLOCK))
        if max_blocks is None:
            max_blocks = SIM_MAX_BLOCKS if self.simulator else 32 * _multiprocessors()
        self.max_blocks = int(max_blocks)
        if self.max_blocks < 1:
            raise BackendError(f"max_blocks must be >= 1, got {max_blocks}")
        self._k = kernel_table(self.block)  # every family's kernels by name (compiled at their first launch)
        self.stream = cuda.stream()
        # on a GPU, launches skip numba's per-call dispatch once each kernel's first call has been checked
        # (launch.py); HPCTRAIN_CUDA_LAUNCH=numba keeps numba's path for every launch
        direct = not self.simulator and os.environ.get("HPCTRAIN_CUDA_LAUNCH", "direct") != "numba"
        self.launcher = Launcher(self.stream) if direct else None
        self.copy_stream = cuda.stream()  # a communication thread's copies out (stage_out): they wait for marks
        self.upload_stream = cuda.stream()  # and its copies back (stage_in), which wait for nothing
        self._init_waits()  # host_waits, mark_waits, background_waits (base.StreamWaits)
        self._pool = None if self.simulator else DevicePool(raw_alloc, wrap)
        self.allocs = 0  # arrays allocated outside the step arena (each builds an array wrapper)
        self.launches = 0  # kernels launched from Python, one by one (and cuBLASLt calls: gemm/)
        self.launch_trace = None  # a list: every launch appended as (kernel, grid, block, traced_arguments)
        self._init_replay(arena, graphs)  # replay.py: the step arena and the step's graphs
        self._init_gemm(gemm, tf32)  # gemm/: cuBLASLt or tiled.py's kernels (cuda.gemm)
        self._vmm_driver = None  # (VmmDriver or None, why not), once zero = 2 asks (vmm.py)
        self._no_bias = self.zeros((1,))  # the GEMM kernel always takes a bias array
        self._scalars = self.zeros((3,), np.float64)  # device-side results of the reductions
        self._host_scalars = self.pinned_host((3,), np.float64)
        self._host_reads = {}  # (position, shape, dtype) -> a pinned buffer that read_host copies into
        self._staging = {}  # (shape, dtype) -> [(pinned buffer, the mark after its upload)], for upload
        self._counters = [self.zeros((64,), np.int64)]  # _counter_slots
        self._bad_token = self.zeros((1,), np.int64)  # embedding_forward: first flat position of a bad id
        self._step_dev, self._step_host = self.zeros((1,), np.uint64), self.pinned_host((1,), np.uint64)
        self._step_on_device, self._step_copied = 0, None  # dropout.py's _device_step
        self._host_bad_token = self.pinned_host((1,), np.int64)

    # ------------------------------------------------------------------ memory

    def empty(self, shape, dtype=np.float32):
        """An uninitialised device array (from the caching pool on a GPU)."""
        return self._alloc("empty", shape, dtype)

    def zeros(self, shape, dtype=np.float32):
        out = self._alloc("zeros", shape, dtype)
        self.fill_(out, 0)
        return out

    def _alloc(self, op, shape, dtype):
        """Allocate for ``op`` (inside a training step, from the step's arena once it has a plan); running out of
        device memory is a BackendError naming op, shape and size."""
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        try:
            if self.arena is not None and math.prod(shape):
                out = self.arena.request(shape, dtype)
                if out is not None:
                    return out
                if self.graphs is not None and not self.arena.replaying:  # fresh arrays: other addresses
                    self.graphs.leave(f"the arena left its plan: {self.arena.reason}")
            return self._fresh(shape, dtype)
        except Exception as e:
            if is_out_of_memory(e):
                raise out_of_memory_error(op, shape, dtype, "GPU", e) from None
            raise

    def _fresh(self, shape, dtype):
        """A new array: from the caching pool on a GPU, numba's under the simulator (counted in ``allocs``)."""
        self.allocs += 1
        if self._pool is None or math.prod(shape) == 0:
            return cuda.device_array(shape, dtype=dtype, stream=self.stream)
        return self._pool.alloc(shape, dtype)

    def asarray(self, host):
        """Host numpy array -> device array of the same shape and dtype (device arrays pass through)."""
        if is_device_array(host):
            return host
        host = np.ascontiguousarray(host)
        out = self._alloc("asarray", host.shape, host.dtype)
        if host.size:
            self._host_acts()
            out.copy_to_device(host, stream=self.stream)
        return out

    def upload(self, host):
        """``asarray`` for what a step uploads at each micro-batch (inputs, ids, targets, the embedding's sort
        plan): staged through a page-locked buffer, so the copy runs asynchronously with the host going on. A
        staging buffer is reused once a wait for the whole stream has passed its copy, else another is made:
        about one step's uploads in all (at most STAGING_PER_SHAPE of a shape, then the oldest is waited for)."""
        if is_device_array(host):
            return host
        host = np.ascontiguousarray(host)
        if host.size == 0:
            return self.asarray(host)
        staged = self._staging.setdefault((host.shape, host.dtype.str), [])
        buf = next((b for b, mark in staged if self.passed(mark)), None)
        if buf is None and len(staged) >= STAGING_PER_SHAPE:
            buf, mark = staged[0]
            self.host_wait_for(mark)
        if buf is None:
            buf = self.pinned_host(host.shape, host.dtype)
        else:
            staged[:] = [(b, m) for b, m in staged if b is not buf]
        np.copyto(buf, host)
        out = self._alloc("upload", host.shape, host.dtype)
        self._host_acts()
        out.copy_to_device(buf, stream=self.stream)
        staged.append((buf, self.mark()))
        return out

    def to_host(self, arr):
        """Device array -> new host numpy array (synchronises)."""
        if not is_device_array(arr):
            return np.asarray(arr)
        check_array("to_host", "arr", arr, dtype=arr.dtype)
        self._host_acts()
        out = arr.copy_to_host(stream=self.stream)
        self._wait()
        return out

    def read_host(self, *arrays) -> list:
        """Host copies of device arrays (host arrays are copied as they are), made with one wait: the step's loss
        rows and gradient norm pieces."""
        copies = self._queue_reads(arrays, "now")
        if any(is_device_array(arr) for arr in arrays):
            self._wait()
        return [np.array(c) for c in copies]  # the pinned buffers are reused by the next read

    def read_later(self, *arrays) -> PendingRead:
        """``read_host``'s copies queued now into their own pinned buffers; ``wait()`` waits for them alone (a
        ``mark_waits``), long done when the host is a step ahead of the device."""
        copies = self._queue_reads(arrays, "later")
        done = self.mark()

        def finish():
            self.host_wait_for(done)
            return [np.array(c) for c in copies]

        return PendingRead(None, finish)

    def _queue_reads(self, arrays, place: str) -> list:
        """Each device array's copy queued into a pinned buffer kept per (``place``, position, shape, dtype),
        reused by the next read from there; a host array copied now."""
        copies = []
        for i, arr in enumerate(arrays):
            if not is_device_array(arr):
                copies.append(np.array(arr))
                continue
            key = (place, i, tuple(arr.shape), np.dtype(arr.dtype).str)
            if key not in self._host_reads:
                self._host_reads[key] = self.pinned_host(arr.shape, arr.dtype)
            if arr.size:
                self._host_acts()
                arr.copy_to_host(self._host_reads[key], stream=self.stream)
            copies.append(self._host_reads[key])
        return copies

    def copy_(self, dst, src):
        """dst (device) = src (device or host), same shape and dtype."""
        check_array("copy_", "dst", dst, dtype=dst.dtype)
        self._require_device("copy_", "dst", dst)
        if not is_device_array(src):
            src = np.ascontiguousarray(src)
        check_array("copy_", "src", src, shape=dst.shape, dtype=dst.dtype)
        if dst.size:
            self._host_acts()
            dst.copy_to_device(src, stream=self.stream)

    def synchronize(self):
        self._wait()

    def _wait(self):
        """The host waits until every kernel and copy queued on the stream is done (counted)."""
        self._host_acts()
        self._stream_wait(self.stream.synchronize)

    # ------------------------------------------------------------------ events: other threads and streams

    def mark(self):
        """An event recorded on the stream now: it completes once everything queued so far is done."""
        event = self._event()
        self._host_acts()
        event.record(self.stream)
        return self._new_mark(event)

    def _event(self):
        return cuda.event() if self.simulator else cuda.event(timing=False)  # the simulator's takes no arguments

    def timer(self):
        """A timing event recorded on the stream now (None under the simulator, whose events time nothing)."""
        if self.simulator:
            return None
        event = cuda.event(timing=True)
        self._host_acts()
        event.record(self.stream)
        return event

    def elapsed(self, start, end) -> float:
        """Seconds of GPU time between two ``timer`` events, both complete."""
        return start.elapsed_time(end) / 1e3

    def after(self, mark) -> None:
        """What is queued on the stream from now on waits for ``mark`` on the device (the host does not wait)."""
        self._host_acts()
        mark.event.wait(self.stream)

    def host_wait_for(self, mark) -> None:
        """The calling thread waits for ``mark`` (counted: the training thread's in ``mark_waits``, since its
        callers queued more work after the mark; a communication thread's are background); no wait when a wait
        for the whole stream has passed the mark already."""
        if self.passed(mark):
            return
        self._mark_wait(mark, mark.event.synchronize)

    def bind_thread(self) -> None:
        """Make this backend's GPU current on the calling thread (a communication thread, before its first copy)."""
        if not self.simulator:
            cuda.select_device(self.device_id)

    def stage_out(self, dev, host, ready) -> None:
        """host[...] = dev[...] on the copy stream once ``ready`` (a ``mark``) is done; returns when the copy is
        (a wait of the calling thread: a communication thread's, so the training thread goes on queueing)."""
        self._require_device("stage_out", "dev", dev)
        check_array("stage_out", "host", host, shape=dev.shape, dtype=dev.dtype)
        ready.event.wait(self.copy_stream)
        if dev.size:
            dev.copy_to_host(host, stream=self.copy_stream)
        self._count_wait()
        self.copy_stream.synchronize()

    def stage_in(self, host, dev):
        """dev[...] = host[...] queued on the upload stream; returns its mark: ``after(mark)`` before the stream
        reads ``dev``. ``host`` must stay as it is until then (a later ``stage_out`` into it waits for a mark the
        training stream records after its ``after``, so it is safe)."""
        self._require_device("stage_in", "dev", dev)
        check_array("stage_in", "host", host, shape=dev.shape, dtype=dev.dtype)
        if dev.size:
            dev.copy_to_device(host, stream=self.upload_stream)
        event = self._event()
        event.record(self.upload_stream)
        return Mark(event, None)  # on its own stream: no wait for the training stream covers it

    # ------------------------------------------------------------------ zero = 2: gradients that give memory back

    @property
    def release_unsupported(self) -> str:
        """Why zero = 2 cannot give gradient memory back on this device ("" where it can: vmm.py)."""
        return self._vmm()[1]

    def _vmm(self):
        if self._vmm_driver is None:
            self._vmm_driver = VmmDriver.open(self.simulator)
        return self._vmm_driver

    def releasable_buffer(self, n: int, *, outside, keep_bytes: int):
        """zero = 2's gradient buffer of ``n`` zeros: a ReleasableDevice whose units inside ``outside`` give their
        memory back once reduced (only where ``release_unsupported`` is "")."""
        driver, why = self._vmm()
        if driver is None:
            raise BackendError(f"zero = 2 cannot release gradient memory here: {why}")
        try:
            buf = ReleasableDevice(n, outside=outside, keep_bytes=keep_bytes, driver=driver, wrap=wrap_address)
        except RuntimeError as e:  # the driver's error (out of memory, most likely); what it took is given back
            raise BackendError(f"zero = 2's gradient buffer of {4 * n / 1e6:,.1f} MB on the GPU: {e}") from None
        self.fill_(buf.array, 0)
        self.synchronize()  # once, at start-up: no kernel still writes the units the first fill() maps again
        return buf

    def pinned_host(self, shape, dtype=np.float32):
        """A page-locked host array: the staging buffer when MPI is not CUDA-aware."""
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        try:
            return cuda.pinned_array(shape, dtype=dtype)
        except Exception as e:
            if is_out_of_memory(e):
                raise out_of_memory_error("pinned_host", shape, dtype, "pinned host", e) from None
            raise

    def to_host_into(self, dev, host):
        """host[...] = dev[...] (same shape and dtype); returns when the copy is done (MPI reads ``host`` next)."""
        self._copy_and_wait("to_host_into", dev, host, lambda: dev.copy_to_host(host, stream=self.stream))

    def from_host_into(self, host, dev):
        """dev[...] = host[...] (same shape and dtype); returns when the copy is done (the caller may overwrite
        ``host`` next: MPI receives into it)."""
        self._copy_and_wait("from_host_into", dev, host, lambda: dev.copy_to_device(host, stream=self.stream))

    def _copy_and_wait(self, op, dev, host, copy):
        self._require_device(op, "dev", dev)
        check_array(op, "dev", dev, dtype=dev.dtype)
        check_array(op, "host", host, shape=dev.shape, dtype=dev.dtype)
        if dev.size:
            self._host_acts()
            copy()
        self._wait()

    def fill_(self, x, value):
        """x[...] = value, any dtype."""
        self._arg("fill_", "x", x, dtype=x.dtype)
        self._elementwise(self._k.fill, x.size, flat(x), x.dtype.type(value))

    # ------------------------------------------------------------------ launching

    def _launch(self, kernel, grid, threads, *args):
        if self.launch_trace is not None:
            self.launch_trace.append((kernel_name(kernel), grid, threads, traced_arguments(args)))
        if self.graphs is not None and self.graphs.launch(kernel, grid, threads, args):
            return  # replayed: it runs with its segment's graph
        self.launches += 1
        if self.launcher is None:
            kernel[grid, threads, self.stream](*args)
        else:
            self.launcher(kernel, grid, threads, args)

    def _elementwise(self, kernel, n, *args):
        if n:
            self._launch(kernel, self._grid(n), self.block, *args)

    def _grid(self, n):
        return max(1, min(-(-n // self.block), self.max_blocks))

    def _rows_grid(self, rows):
        return max(1, min(rows, self.max_blocks if self.simulator else 65535))

    def _column_sums(self, op, kernel, B, C, dout, out, accumulate):
        """out[C] (+)= the column sums of dout[B, C] in one launch of ``kernel`` (linear.py's ``bias_grad``): a grid
        of column blocks × G row groups (enough blocks for about two waves, each thread at least COLUMN_ROWS rows)
        writes float64 sums per row group, and the last block of each column block adds its G sums in order."""
        k = self._k
        col_blocks = -(-C // k.RX)
        G = max(1, min(-(-2 * self.wave // col_blocks), -(-B // (k.RY * COLUMN_ROWS))))
        partial = self._partials(op, (col_blocks, G), k.RX)
        self._launch(kernel, (col_blocks, G), (k.RX, k.RY), dout, partial, self._counter_slots(col_blocks),
                     -(-B // G) if B else 1, out, bool(accumulate))

    def _partials(self, op, rows, C):
        """A float64 scratch of partial sums, shaped ``rows`` (an int or a tuple) × C, for a kernel whose last block
        adds them, each row padded to whole 128-byte cache lines: an SM's L1 is not kept coherent with the others'
        stores within a launch, so no line may hold two blocks' partials (one block could cache a line another
        writes later, and then read it stale when it finishes the sum). Allocations start on 512-byte boundaries
        (memory.py)."""
        rows = rows if isinstance(rows, tuple) else (rows,)
        return self._alloc(op, rows + (-(-C // PARTIAL_ALIGN) * PARTIAL_ALIGN,), np.float64)

    def _counter_slots(self, n):
        """At least ``n`` int64 counters, all 0 between launches, for the kernels whose last block finishes a
        reduction (blocks.py's ``last_to_finish``); grown when a launch needs more (the old ones are kept: a
        kernel queued earlier may still count in them)."""
        if self._counters[-1].size < n:
            self._counters.append(self.zeros((max(n, 2 * self._counters[-1].size),), np.int64))
        return self._counters[-1]

    def _sum_reduce(self, op, kernel, n, *args, into=None):
        """Run a kernel that writes per-block float64 partial sums and add them up on the device: the total into
        ``into[0]`` (returns None, no wait), or returned as a host float."""
        if n == 0:
            if into is not None:
                self.fill_(into[:1], 0)
                return None
            return 0.0
        grid = self._grid(n)
        partial = self._alloc(op, (grid,), np.float64)
        self._launch(kernel, grid, self.block, *args, partial)
        self._launch(self._k.sum_partials, 1, self.block, partial, self._scalars if into is None else into)
        if into is not None:
            return None
        return float(self._read_scalars()[0])

    def _read_scalars(self):
        self._host_acts()
        self._scalars.copy_to_host(self._host_scalars, stream=self.stream)
        self._wait()
        return self._host_scalars.copy()

    # ------------------------------------------------------------------ argument checks

    def _check_ids_on_host(self, op, ids, limit):
        """Host token ids or targets: the first one outside [0, limit) raises BackendError, as the kernels would."""
        every = ids.reshape(-1)
        bad = np.flatnonzero((every < 0) | (every >= limit))
        if bad.size:
            if op == "cross_entropy":
                self.bad_target(ids, int(bad[0]), limit)
            self.bad_token(ids, int(bad[0]), limit, op=op)

    def _device_ids(self, op, ids, limit):
        """Ids for a kernel: host ids range-checked (``limit``: None for no check) and uploaded, device ids as
        they are."""
        if is_device_array(ids):
            return ids
        if limit is not None:
            self._check_ids_on_host(op, ids, limit)
        return self.upload(ids)

    def _require_device(self, op, name, arr):
        if not is_device_array(arr):
            shape = getattr(arr, "shape", None)
            raise BackendError(f"{op}: {name} must be a device array (backend.asarray), got "
                               f"{type(arr).__name__}" + (f" with shape {tuple(shape)}" if shape is not None else ""))

    def _arg(self, op, name, arr, **kw):
        """check_array plus: the array lives on the device (a host array would be copied back and forth)."""
        self._require_device(op, name, arr)
        return check_array(op, name, arr, **kw)


def _multiprocessors() -> int:
    try:
        return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
    except Exception:  # an attribute the driver does not report: a safe grid cap anyway
        return 128


def kernel_table(block: int) -> SimpleNamespace:
    """Every family's kernels for blocks of ``block`` threads, by name (unique across FAMILIES)."""
    table = {}
    for family in FAMILIES:
        kernels = vars(family.kernels(block))
        clash = sorted(set(kernels) & set(table))
        if clash:
            raise RuntimeError(f"{family.__name__} names kernels another family has: {clash}")
        table.update(kernels)
    return SimpleNamespace(**table)
