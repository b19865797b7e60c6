"""CUDA backend: every kernel of a training step as a ``numba.cuda.jit`` kernel on one stream.

    [train]
    backend = "cuda"          # or "auto": the GPU when there is one

Shape letters: B batch rows, C features, K reduction size, M/N output rows/columns
of a product, n elements of a flat buffer; the transformer ops add T sequence,
V vocabulary, H heads of hs = C/H channels. The methods and their signatures are
CpuBackend's (cpu.py); arrays are numba device arrays. Parameters, gradients,
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
cuda_gemm.py) and ``block`` (threads per block of the other kernels). The
defaults are for real GPUs; under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``),
which runs every GPU thread as a Python thread, they default to tiny ones.

The GEMMs are shaped to fill the GPU: without an explicit ``tile`` the backend
takes the largest of the 128×128, 64×64 and 32×32 tilings whose grid makes one
full wave (a block per SM), else the 32×32. A weight gradient (``matmul_tn``,
K = the batch's rows) chooses from the first two, and one whose grid is still under
a wave is split along K into up to 2 waves of blocks (``cuda_gemm.k_splits``), the
partial products summed in a fixed order. Attention runs its products as batched
GEMMs over (batch, head) with the 64×64 tiling. ``bench/gemm_grids.py`` lists the
grid of every GEMM of a GPT step.
"""

from __future__ import annotations

import math
import os

import numpy as np
from numba import cuda

from ..errors import BackendError
from .base import Backend, DecayRuns, Mark, StreamWaits, check_array
from .cuda_flash import NT as FLASH_THREADS
from .cuda_flash import flash_kernels, rows_per_block
from .cuda_gemm import (EPI_ACCUMULATE, EPI_BIAS, EPI_STORE, GPU_SMALL_TILE, GPU_TILE, GPU_TILES, GPU_TN_TILES,
                        MAX_GRID_Z, MODE_CAUSAL_K_BELOW,
                        MODE_CAUSAL_K_FROM, MODE_CAUSAL_UPPER, MODE_SPLIT_K, SIM_TILE, GemmTile,
                        batched_gemm_kernels, choose_tile, gemm_kernels, k_splits, launch_config)
from .cuda_launch import Launcher
from .cuda_mem import DevicePool, is_out_of_memory, out_of_memory_error
from .cuda_ops import ops_kernels
from .cuda_transformer import transformer_kernels
from .cuda_vmm import ReleasableDevice, VmmDriver
from .dropout_mask import keep_scale, threshold

__all__ = ["CudaBackend", "simulator"]

GPU_BLOCK, SIM_BLOCK = 256, 16
COLUMN_ROWS = 16  # the column sums' row groups leave each thread at least this many rows
STAGING_PER_SHAPE = 64  # upload's page-locked buffers of one shape (a step uses one per micro-batch)
SIM_MAX_BLOCKS = 4  # small, so that the simulator exercises the grid-stride loops
SIM_WAVE = 4  # "SMs" under the simulator: small, so that tiny products take the split-K path there
NT, NN, TN = 0, 1, 2  # the batched kernels' operand layouts, as cuda_gemm returns them


def simulator() -> bool:
    """True when numba-cuda runs the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``)."""
    from numba.cuda.core import config

    return bool(config.ENABLE_CUDASIM)


def _is_device_array(arr) -> bool:
    return bool(getattr(arr, "__cuda_ndarray__", False) or hasattr(arr, "__cuda_array_interface__"))


class CudaBackend(StreamWaits, Backend):
    """Arrays are numba device arrays on one GPU; ``CudaBackend(device_id=0, tile=..., block=...)``.

    ``device_id`` is the GPU to use (the node-local rank when started by ``get_backend``);
    with a single visible GPU (e.g. Slurm's per-task ``CUDA_VISIBLE_DEVICES``) any id
    maps to it. ``tile`` is a ``GemmTile`` (or a 5-tuple BM, BN, BK, TM, TN), ``block``
    the threads per block of the other kernels (a power of two), ``max_blocks`` the
    grid cap of the grid-stride kernels.
    """

    name = "cuda"
    is_device = True

    def __init__(self, device_id: int = 0, *, tile=None, block: int | None = None, max_blocks: int | None = None):
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
        self._k = ops_kernels(self.block)
        self._tk = transformer_kernels(self.block)
        self.stream = cuda.stream()
        # on a GPU, launches skip numba's per-call dispatch once each kernel's first call has been checked
        # (backend/cuda_launch.py); HPCTRAIN_CUDA_LAUNCH=numba keeps numba's path for every launch
        direct = not self.simulator and os.environ.get("HPCTRAIN_CUDA_LAUNCH", "direct") != "numba"
        self.launcher = Launcher(self.stream) if direct else None
        self.copy_stream = cuda.stream()  # a communication thread's copies out (stage_out): they wait for marks
        self.upload_stream = cuda.stream()  # and its copies back (stage_in), which wait for nothing
        self._init_waits()  # host_waits, mark_waits, background_waits (base.StreamWaits)
        self._pool = None if self.simulator else DevicePool(_raw_alloc, _wrap)
        self._vmm_driver = None  # (VmmDriver or None, why not), once zero = 2 asks (backend/cuda_vmm.py)
        self._no_bias = self.zeros((1,))  # the GEMM kernel always takes a bias array
        self._scalars = self.zeros((3,), np.float64)  # device-side results of the reductions
        self._host_scalars = self.pinned_host((3,), np.float64)
        self._host_reads = {}  # (position, shape, dtype) -> a pinned buffer that read_host copies into
        self._staging = {}  # (shape, dtype) -> [(pinned buffer, the mark after its upload)], for upload
        self._bad_token = self.zeros((1,), np.int64)  # embedding_forward: first flat position of a bad id
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
        """Allocate for ``op``; running out of device memory is a BackendError naming op, shape and size."""
        shape = tuple(int(s) for s in (shape if isinstance(shape, (tuple, list)) else (shape,)))
        try:
            if self._pool is None or math.prod(shape) == 0:
                return cuda.device_array(shape, dtype=dtype, stream=self.stream)
            return self._pool.alloc(shape, dtype)
        except Exception as e:
            if is_out_of_memory(e):
                raise out_of_memory_error(op, shape, dtype, "GPU", e) from None
            raise

    def asarray(self, host):
        """Host numpy array -> device array of the same shape and dtype (device arrays pass through)."""
        if _is_device_array(host):
            return host
        host = np.ascontiguousarray(host)
        out = self._alloc("asarray", host.shape, host.dtype)
        if host.size:
            out.copy_to_device(host, stream=self.stream)
        return out

    def upload(self, host):
        """``asarray`` for what a step uploads at each micro-batch (inputs, ids, targets, the embedding's sort
        plan): staged through a page-locked buffer, so the copy runs asynchronously with the host going on. A
        staging buffer is reused once a wait for the whole stream has passed its copy, else another is made:
        about one step's uploads in all (at most STAGING_PER_SHAPE of a shape, then the oldest is waited for)."""
        if _is_device_array(host):
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
        out.copy_to_device(buf, stream=self.stream)
        staged.append((buf, self.mark()))
        return out

    def to_host(self, arr):
        """Device array -> new host numpy array (synchronises)."""
        if not _is_device_array(arr):
            return np.asarray(arr)
        check_array("to_host", "arr", arr, dtype=arr.dtype)
        out = arr.copy_to_host(stream=self.stream)
        self._wait()
        return out

    def read_host(self, *arrays) -> list:
        """Host copies of device arrays (host arrays are copied as they are), made with one wait: the step's loss
        rows and gradient norm pieces."""
        copies = []
        for i, arr in enumerate(arrays):
            if not _is_device_array(arr):
                copies.append(np.array(arr))
                continue
            key = (i, tuple(arr.shape), np.dtype(arr.dtype).str)  # one buffer per place in the call
            if key not in self._host_reads:
                self._host_reads[key] = self.pinned_host(arr.shape, arr.dtype)
            if arr.size:
                arr.copy_to_host(self._host_reads[key], stream=self.stream)
            copies.append(self._host_reads[key])
        if any(_is_device_array(arr) for arr in arrays):
            self._wait()
        return [np.array(c) for c in copies]  # the pinned buffers are reused by the next read

    def copy_(self, dst, src):
        """dst (device) = src (device or host), same shape and dtype."""
        check_array("copy_", "dst", dst, dtype=dst.dtype)
        self._require_device("copy_", "dst", dst)
        if not _is_device_array(src):
            src = np.ascontiguousarray(src)
        check_array("copy_", "src", src, shape=dst.shape, dtype=dst.dtype)
        if dst.size:
            dst.copy_to_device(src, stream=self.stream)

    def synchronize(self):
        self._wait()

    def _wait(self):
        """The host waits until every kernel and copy queued on the stream is done (counted)."""
        self._stream_wait(self.stream.synchronize)

    # ------------------------------------------------------------------ events: other threads and streams

    def mark(self):
        """An event recorded on the stream now: it completes once everything queued so far is done."""
        event = self._event()
        event.record(self.stream)
        return self._new_mark(event)

    def _event(self):
        return cuda.event() if self.simulator else cuda.event(timing=False)  # the simulator's takes no arguments

    def timer(self):
        """A timing event recorded on the stream now (None under the simulator, whose events time nothing)."""
        if self.simulator:
            return None
        event = cuda.event(timing=True)
        event.record(self.stream)
        return event

    def elapsed(self, start, end) -> float:
        """Seconds of GPU time between two ``timer`` events, both complete."""
        return start.elapsed_time(end) / 1e3

    def after(self, mark) -> None:
        """What is queued on the stream from now on waits for ``mark`` on the device (the host does not wait)."""
        mark.event.wait(self.stream)

    def host_wait_for(self, mark) -> None:
        """The calling thread waits for ``mark`` (counted: the training thread's in ``mark_waits``, since its
        callers queued more work after the mark; a communication thread's are background); no wait when a wait
        for the whole stream has passed the mark already."""
        if self.passed(mark):
            return
        self._count_wait(whole_stream=False)
        mark.event.synchronize()

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
        """Why zero = 2 cannot give gradient memory back on this device ("" where it can: backend/cuda_vmm.py)."""
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
            buf = ReleasableDevice(n, outside=outside, keep_bytes=keep_bytes, driver=driver, wrap=_wrap_address)
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
        """host[...] = dev[...] (same shape and dtype); returns when the copy is done."""
        self._require_device("to_host_into", "dev", dev)
        check_array("to_host_into", "dev", dev, dtype=dev.dtype)
        check_array("to_host_into", "host", host, shape=dev.shape, dtype=dev.dtype)
        if dev.size:
            dev.copy_to_host(host, stream=self.stream)
        self._wait()  # MPI reads ``host`` right after

    def from_host_into(self, host, dev):
        """dev[...] = host[...] (same shape and dtype); returns when the copy is done."""
        self._require_device("from_host_into", "dev", dev)
        check_array("from_host_into", "dev", dev, dtype=dev.dtype)
        check_array("from_host_into", "host", host, shape=dev.shape, dtype=dev.dtype)
        if dev.size:
            dev.copy_to_device(host, stream=self.stream)
        self._wait()  # the caller may overwrite ``host`` (MPI receives into it) next

    # ------------------------------------------------------------------ matrix products (X·Wᵀ, dY·W, dYᵀ·X)

    def matmul_nt(self, a, b, out, bias=None):
        """out[M,N] = a[M,K] @ b[N,K]ᵀ (+ bias[N]): the Linear forward, bias fused into the store."""
        M, N, K = self._matmul_args("matmul_nt", a, b, out, bias)
        self._gemm(NT, a, b, out, M, N, K, bias, EPI_STORE if bias is None else EPI_BIAS)

    def matmul_nn(self, a, b, out):
        """out[M,N] = a[M,K] @ b[K,N]: the Linear input gradient dY·W."""
        M, N, K = self._matmul_args("matmul_nn", a, b, out)
        self._gemm(NN, a, b, out, M, N, K, None, EPI_STORE)

    def matmul_tn(self, a, b, out, accumulate=False):
        """out[M,N] (+)= a[K,M]ᵀ @ b[K,N]: the Linear weight gradient dYᵀ·X."""
        M, N, K = self._matmul_args("matmul_tn", a, b, out)
        self._gemm(TN, a, b, out, M, N, K, None, EPI_ACCUMULATE if accumulate else EPI_STORE)

    def _gemm(self, layout, a, b, out, M, N, K, bias, epilogue):
        if M == 0 or N == 0:
            return
        tile = choose_tile(self.tn_tiles if layout == TN else self.tiles, self.wave, M, N)
        splits = k_splits(tile, self.wave, M, N, K) if layout == TN else 1
        if splits > 1:
            self._split_k(tile, a, b, out, M, N, K, splits, epilogue == EPI_ACCUMULATE)
            return
        grid, threads = launch_config(tile, M, N)
        kernel = gemm_kernels(tile)[layout]
        self._launch(kernel, grid, threads, a, b, out, self._no_bias if bias is None else bias, M, N, K, epilogue)

    def _split_k(self, tile, a, b, out, M, N, K, splits, accumulate):
        """out[M,N] (+)= a[K,M]ᵀ·b[K,N] as ``splits`` partial products over K slices into a workspace, then
        summed slice by slice in order (deterministic)."""
        ks = -(-K // splits)
        ws = self._alloc("matmul_tn", (splits * M, N), np.float32)
        self._batched(tile, TN, a, b, ws, M, N, ks, K, 1, splits, (ks, 0, 0, 0), (ks, 0, 0, 0), (M, 0, 0, 0),
                      MODE_SPLIT_K)
        sum_splits = batched_gemm_kernels(tile)[3]
        self._launch(sum_splits, self._grid(M * N), self.block, _flat(ws), _flat(out), splits, bool(accumulate))

    def _batched(self, tile, layout, a, b, c, M, N, K, k_total, H, Z, ao, bo, co, mode):
        """Z batched products (cuda_gemm.batched_gemm_kernels), in launches of at most MAX_GRID_Z."""
        kernel = batched_gemm_kernels(tile)[layout]
        for z0 in range(0, Z, MAX_GRID_Z):
            grid, threads = launch_config(tile, M, N, min(MAX_GRID_Z, Z - z0))
            self._launch(kernel, grid, threads, a, b, c, M, N, K, k_total, H, z0, ao, bo, co, mode)

    def bias_grad(self, dout, dbias, accumulate=False):
        """dbias[C] (+)= Σ_rows dout[B,C], accumulated in float64 (two passes: ``_column_sums``)."""
        C = self._bias_grad_args(dout, dbias)
        if C:
            self._column_sums("bias_grad", self._k.bias_grad_partials, dout.shape[0], C, 1, (dout,), (dbias,),
                              accumulate)

    def _column_sums(self, op, partials, B, C, outputs, inputs, outs, accumulate):
        """Column sums over B rows in two passes: ``partials`` on a grid of column blocks × G row groups (enough
        blocks for about two waves, each thread at least COLUMN_ROWS rows) writes float64 sums per row group, then
        ``column_finish`` adds each output's G partials in order into ``outs`` (float32, += with accumulate)."""
        k = self._k
        col_blocks = -(-C // k.RX)
        G = max(1, min(-(-2 * self.wave // col_blocks), -(-B // (k.RY * COLUMN_ROWS))))
        partial = self._alloc(op, (outputs * G, C), np.float64)
        self._launch(partials, (col_blocks, G), (k.RX, k.RY), *inputs, partial, -(-B // G) if B else 1)
        for i, out in enumerate(outs):
            self._elementwise(k.column_finish, C, partial[i * G:(i + 1) * G], out, bool(accumulate))

    # ------------------------------------------------------------------ activations

    def relu_forward(self, x, out):
        self._unary("relu_forward", self._k.relu_forward, x=x, out=out)

    def relu_backward(self, x, dout, dinp):
        self._binary("relu_backward", self._k.relu_backward, x=x, dout=dout, dinp=dinp)

    def gelu_forward(self, x, out):
        self._unary("gelu_forward", self._k.gelu_forward, x=x, out=out)

    def gelu_backward(self, x, dout, dinp):
        self._binary("gelu_backward", self._k.gelu_backward, x=x, dout=dout, dinp=dinp)

    def tanh_forward(self, x, out):
        self._unary("tanh_forward", self._k.tanh_forward, x=x, out=out)

    def tanh_backward(self, y, dout, dinp):
        self._binary("tanh_backward", self._k.tanh_backward, y=y, dout=dout, dinp=dinp)

    def _unary(self, op, kernel, *, x, out):
        self._unary_args(op, x, out)
        self._elementwise(kernel, x.size, _flat(x), _flat(out))

    def _binary(self, op, kernel, **arrays):
        self._check_same(op, **arrays)
        first = next(iter(arrays.values()))
        self._elementwise(kernel, first.size, *(_flat(a) for a in arrays.values()))

    # ------------------------------------------------------------------ layernorm

    def layernorm_forward(self, x, weight, bias, eps, out, mean, rstd):
        """out[B,C] = (x − mean)·rstd·weight + bias; saves mean[B] and rstd[B] for the backward pass."""
        B, C = self._layernorm_forward_args(x, weight, bias, out, mean, rstd)
        if B and C:
            self._launch(self._k.layernorm_forward, self._rows_grid(B), self.block,
                         x, weight, bias, np.float32(eps), out, mean, rstd)

    def layernorm_backward(self, dout, x, weight, mean, rstd, dinp, dweight, dbias, accumulate=False):
        """dinp[B,C]; dweight[C], dbias[C] (+)= their sums over the rows."""
        B, C = self._layernorm_backward_args(dout, x, weight, mean, rstd, dinp, dweight, dbias)
        if not C:
            return
        k = self._k
        if B:
            self._launch(k.layernorm_backward_rows, self._rows_grid(B), self.block, dout, x, weight, mean, rstd, dinp)
        self._column_sums("layernorm_backward", k.layernorm_params_partials, B, C, 2, (dout, x, mean, rstd),
                          (dweight, dbias), accumulate)

    # ------------------------------------------------------------------ transformer: residuals, embedding, attention

    def add_(self, out, x):
        """out += x (same shapes): a residual connection and its gradient."""
        self._binary("add_", self._k.add, out=out, x=x)

    def dropout(self, x, out, rows):
        """out[R, W] = x with the elements ``rows`` (a DropRows) draws dropped and the rest scaled by 1/(1 − p);
        out may be x. The same call on the gradient is the backward pass (dropout_mask.py)."""
        R, W = self._dropout_args(x, out, rows)
        group = rows.group or max(R, 1)
        self._elementwise(self._k.dropout, R * W, _flat(x), _flat(out), W, np.uint64(rows.key),
                          np.uint64(threshold(rows.p)), keep_scale(rows.p), rows.row0, group, rows.stride or group,
                          bool(rows.causal))

    def embedding_forward(self, idx, wte, wpe, out, *, vocab_start=0, vocab=None, add_positions=True):
        """out[B·T, C] = wte[idx[b, t]] + wpe[t] for token ids idx[B, T] (int64), wte[V, C], wpe[≥T, C]; a
        vocab-parallel shard as the CPU backend's. An id outside [0, vocab) raises BackendError: host ids are checked
        on the host and uploaded (no wait); for device ids the kernel leaves the first such position in one int64
        that is read back (a wait)."""
        op = "embedding_forward"
        B, T, V, C, lo, vocab = self._embedding_args(op, idx, wte, wpe, out, "out", vocab_start, vocab)
        n = B * T
        if n == 0:
            return
        on_host = not _is_device_array(idx)
        if on_host:
            self._check_ids_on_host(op, idx, vocab)
            idx = self.upload(idx)
        self.fill_(self._bad_token, n)
        self._launch(self._tk.embedding_forward, self._rows_grid(n), self.block, idx, wte, wpe, out, self._bad_token,
                     lo, vocab, bool(add_positions))
        if on_host:
            return
        self._bad_token.copy_to_host(self._host_bad_token, stream=self.stream)
        self._wait()
        bad = int(self._host_bad_token[0])
        if bad < n:
            self.bad_token(idx, bad, vocab)

    def _check_ids_on_host(self, op, ids, limit):
        """Host token ids or targets: the first one outside [0, limit) raises BackendError, as the kernels would."""
        flat = ids.reshape(-1)
        bad = np.flatnonzero((flat < 0) | (flat >= limit))
        if bad.size:
            if op == "cross_entropy":
                self.bad_target(ids, int(bad[0]), limit)
            self.bad_token(ids, int(bad[0]), limit, op=op)

    def _device_ids(self, op, ids, limit):
        """Ids for a kernel: host ids range-checked (``limit``: None for no check) and uploaded, device ids as
        they are."""
        if _is_device_array(ids):
            return ids
        if limit is not None:
            self._check_ids_on_host(op, ids, limit)
        return self.upload(ids)

    def embedding_backward(self, dout, idx, dwte, dwpe, *, vocab_start=0, vocab=None, accumulate_wte=False,
                           accumulate_wpe=False):
        """dwte[v − vocab_start] (+)= Σ dout rows with id v (ids of dwte's block); dwpe[t] (+)= Σ_b dout[b·T + t]
        (rows ≥ T of dwpe: 0 or kept). Deterministic, and bit-identical to the CPU backend: the ids are sorted on
        the host (device ids are read back first: a wait), then one block per distinct id adds its rows in batch
        order; no atomics."""
        op = "embedding_backward"
        B, T, V, C, lo, vocab = self._embedding_args(op, idx, dwte, dwpe, dout, "dout", vocab_start, vocab)
        ids = self.to_host(idx).reshape(-1) if B * T and C else None  # first: the wpe kernel overlaps the sort
        if not accumulate_wte:
            self.fill_(dwte, 0)
        self._elementwise(self._tk.embedding_backward_wpe, dwpe.size, dout, B, T, dwpe, bool(accumulate_wpe))
        if ids is None:
            return
        bad = np.flatnonzero((ids < 0) | (ids >= vocab))
        if bad.size:
            self.bad_token(idx, int(bad[0]), vocab, op=op)
        order = np.argsort(ids, kind="stable")  # stable: each id's rows stay in batch order
        ids = ids[order] - lo
        keep = (ids >= 0) & (ids < V)  # this table's block of the vocabulary
        order, ids = order[keep], ids[keep]
        n = ids.size
        if n == 0:
            return
        starts = np.flatnonzero(ids[1:] != ids[:-1]) + 1
        starts = np.concatenate(([0], starts, [n]))
        tokens = ids[starts[:-1]]
        U = tokens.size
        plan = np.zeros(3 * B * T + 1, dtype=np.int64)  # one upload, of one size per batch shape (staging reuse)
        plan[: n + 2 * U + 1] = np.concatenate((order, starts, tokens))
        plan = self.upload(plan)
        self._launch(self._tk.embedding_backward_wte, self._rows_grid(U), self.block,
                     dout, plan[:n], plan[n:n + U + 1], plan[n + U + 1:n + 2 * U + 1], dwte)

    def attention_forward(self, qkv, T, n_head, out, att, *, dropout=None):
        """out[B·T, C] = softmax(q·kᵀ/√hs, causal)·v per head, from qkv[B·T, 3C] (q, k, v, heads of hs = C/H);
        att[B, H, T, T] keeps the probabilities for the backward pass. ``dropout`` (a DropRows over att's
        B·H·T rows): out = dropout(att)·v, att itself kept undropped (the backward redraws the mask)."""
        op = "attention_forward"
        B, H, C, hs, T = self._attention_args(op, qkv, T, n_head, att, out=out)
        if B == 0:
            return
        scale, Z, tile = np.float32(1.0 / math.sqrt(hs)), B * H, self.attention_tile
        att2 = att.reshape(B * H * T, T)  # row (b·H + h)·T + i
        q, k, v = (T, 0, 0, hs), (T, 0, C, hs), (T, 0, 2 * C, hs)  # a head's [T, hs] in qkv (cuda_gemm.py)
        rows, heads = (H * T, T, 0, 0), (T, 0, 0, hs)  # a head's [T, T] in att2, its [T, hs] in out
        self._batched(tile, NT, qkv, qkv, att2, T, T, hs, hs, H, Z, q, k, rows, MODE_CAUSAL_UPPER)
        self._attention_rows(self._tk.attention_softmax_rows, B * H * T, att2, T, scale)
        used = self._dropped(op, att2, dropout)
        self._batched(tile, NN, used, qkv, out, T, hs, T, T, H, Z, rows, v, heads, MODE_CAUSAL_K_BELOW)

    def attention_backward(self, dout, qkv, att, T, n_head, dqkv, *, dropout=None):
        """dqkv[B·T, 3C] from dout[B·T, C], the forward's qkv and att (overwritten, never accumulated);
        ``dropout`` as the forward's."""
        op = "attention_backward"
        B, H, C, hs, T = self._attention_args(op, qkv, T, n_head, att, dout=dout, dqkv=dqkv)
        if B == 0:
            return
        scale, Z, tile = np.float32(1.0 / math.sqrt(hs)), B * H, self.attention_tile
        att2 = att.reshape(B * H * T, T)
        dscores = self._alloc(op, (B * H * T, T), np.float32)
        q, k, v = (T, 0, 0, hs), (T, 0, C, hs), (T, 0, 2 * C, hs)
        rows, dy = (H * T, T, 0, 0), (T, 0, 0, hs)
        self._batched(tile, NT, dout, qkv, dscores, T, T, hs, hs, H, Z, dy, v, rows, MODE_CAUSAL_UPPER)  # dy·vᵀ
        used = self._dropped(op, att2, dropout)
        self._batched(tile, TN, used, dout, dqkv, T, hs, T, T, H, Z, rows, dy, v, MODE_CAUSAL_K_FROM)  # dv
        if dropout is not None:
            self.dropout(dscores, dscores, dropout)  # the gradient of the dropped att, through the same mask
        self._attention_rows(self._tk.attention_softmax_backward_rows, B * H * T, att2, dscores, T, scale)
        self._batched(tile, NN, dscores, qkv, dqkv, T, hs, T, T, H, Z, rows, k, q, MODE_CAUSAL_K_BELOW)  # dq
        self._batched(tile, TN, dscores, qkv, dqkv, T, hs, T, T, H, Z, rows, q, k, MODE_CAUSAL_K_FROM)  # dk

    def flash_attention_forward(self, qkv, T, n_head, out, lse, *, dropout=None):
        """out as ``attention_forward``'s, keeping lse[B, H, T] instead of att: one fused kernel, an online
        softmax over tiles of keys (cuda_flash.py); heads of at most 128 channels."""
        op = "flash_attention_forward"
        B, H, C, hs, T = self._flash_args(op, qkv, T, n_head, lse, out=out)
        if B == 0:
            return
        fk = flash_kernels(hs)
        grid = B * H * -(-T // rows_per_block(hs))
        self._launch(fk.flash_forward, grid, FLASH_THREADS, qkv, out, lse.reshape(B * H * T), T, H,
                     np.float32(1.0 / math.sqrt(hs)), *self._flash_draw(dropout, B * H * T))

    def flash_attention_backward(self, dout, qkv, out, lse, T, n_head, dqkv, *, dropout=None):
        """dqkv[B·T, 3C] from dout, the forward's qkv, out and lse: a dq kernel (which leaves each row's
        dout·out), then a dk/dv kernel; overwritten, never accumulated."""
        op = "flash_attention_backward"
        B, H, C, hs, T = self._flash_args(op, qkv, T, n_head, lse, out=out, dout=dout, dqkv=dqkv)
        if B == 0:
            return
        fk = flash_kernels(hs)
        rows = B * H * T
        dsum = self._alloc(op, (rows,), np.float32)
        grid, lse1 = B * H * -(-T // rows_per_block(hs)), lse.reshape(rows)
        scale, draw = np.float32(1.0 / math.sqrt(hs)), self._flash_draw(dropout, rows)
        self._launch(fk.flash_backward_dq, grid, FLASH_THREADS, qkv, dout, out, lse1, dsum, dqkv, T, H, scale,
                     *draw)
        self._launch(fk.flash_backward_dkdv, grid, FLASH_THREADS, qkv, dout, lse1, dsum, dqkv, T, H, scale, *draw)

    @staticmethod
    def _flash_draw(dropout, rows):
        """The flash kernels' dropout arguments: key, cut, keep scale, row0, group, stride, drop."""
        if dropout is None:
            return np.uint64(0), np.uint64(0), np.float32(1.0), 0, 1, 1, False
        group = dropout.group or max(rows, 1)
        return (np.uint64(dropout.key), np.uint64(threshold(dropout.p)), keep_scale(dropout.p), dropout.row0, group,
                dropout.stride or group, True)

    def _dropped(self, op, att2, dropout):
        """att2, or its dropout into a new array (the mask drawn again in the backward pass)."""
        if dropout is None:
            return att2
        out = self._alloc(op, att2.shape, np.float32)
        self.dropout(att2, out, dropout)
        return out

    def _attention_rows(self, kernel, rows, *args):
        per_block = self._tk.ROWS_PER_BLOCK
        self._launch(kernel, self._rows_grid(-(-rows // per_block)), self.block, *args)

    # ------------------------------------------------------------------ losses (host scalars out)

    def cross_entropy(self, logits, targets, dlogits, grad_scale, *, into=None):
        """Softmax cross-entropy of logits[B,C] against int64 targets[B] (host or device): returns (loss sum,
        correct), or with ``into`` writes [loss sum, correct, first bad row (B if none)] there and returns None
        (no wait); writes dlogits = (softmax − onehot)·grad_scale. A target outside [0, C) raises BackendError
        (host targets: at once; device targets with ``into``: the caller reads the bad row)."""
        B, C = self._cross_entropy_args(logits, targets, dlogits)
        self._into_arg("cross_entropy", into, 3)
        if B == 0:
            if into is not None:
                self.copy_(into, np.zeros(3))
                return None
            return 0.0, 0
        if C == 0:
            self.bad_target(targets, 0, C)
        targets = self._device_ids("cross_entropy", targets, C)
        row_loss = self._alloc("cross_entropy", (B,), np.float64)
        row_flag = self._alloc("cross_entropy", (B,), np.int32)
        k = self._k
        self._launch(k.cross_entropy_rows, self._rows_grid(B), self.block,
                     logits, targets, dlogits, np.float32(grad_scale), row_loss, row_flag)
        self._launch(k.cross_entropy_finish, 1, self.block, row_loss, row_flag,
                     self._scalars if into is None else into)
        if into is not None:
            return None
        total, correct, bad = self._read_scalars()
        if bad < B:
            self.bad_target(targets, int(bad), C)
        return float(total), int(correct)

    def ce_shard_stats(self, logits, targets, mx, arg, tlogit, *, vocab_start, vocab):
        """Vocab-parallel cross-entropy, pass 1 (see the CPU backend): each row's max, first argmax + vocab_start,
        and the target's logit where this block of columns holds it."""
        B, V, lo = self._vocab_shard_args("ce_shard_stats", logits, targets, vocab_start, vocab,
                                          mx=(mx, np.float32), arg=(arg, np.int64), tlogit=(tlogit, np.float32))
        if B and V:
            targets = self._device_ids("ce_shard_stats", targets, None)  # the loss checks them against the vocab
            self._launch(self._k.ce_shard_stats, self._rows_grid(B), self.block, logits, targets, lo, mx, arg, tlogit)

    def ce_shard_sumexp(self, logits, mx, sumexp):
        """Pass 2: sumexp[B] (float64) = Σ_j exp(logits[i, j] − mx[i])."""
        B, _ = self._ce_sumexp_args(logits, mx, sumexp)
        if B:
            self._launch(self._k.ce_shard_sumexp, self._rows_grid(B), self.block, logits, mx, sumexp)

    def ce_shard_grad(self, logits, targets, logz, dlogits, grad_scale, *, vocab_start, vocab):
        """Pass 3: dlogits = (exp(logits − logz) − onehot(target))·grad_scale on this block of columns."""
        B, V, lo = self._vocab_shard_args("ce_shard_grad", logits, targets, vocab_start, vocab,
                                          logz=(logz, np.float64))
        self._arg("ce_shard_grad", "dlogits", dlogits, shape=(B, V))
        targets = self._device_ids("ce_shard_grad", targets, None) if B * V else targets
        self._elementwise(self._k.ce_shard_grad, B * V, logits, targets, lo, logz, dlogits, np.float32(grad_scale))

    def mse(self, pred, target, dpred, grad_scale, *, into=None):
        """Σ (pred − target)² over pred[B,C] (host float, or written to into[0] with no wait); writes
        dpred = 2·(pred − target)·grad_scale."""
        self._mse_args(pred, target, dpred)
        self._into_arg("mse", into, 3)
        return self._sum_reduce("mse", self._k.mse_partial, pred.size, _flat(pred), _flat(target), _flat(dpred),
                                np.float32(grad_scale), into=into)

    # ------------------------------------------------------------------ flat buffers

    def sum_squares(self, x, *, into=None):
        """Σ x² over a flat x[n] as a host float (the global gradient norm²), float64 accumulation; with ``into``
        (a float64 device array of 1) written there, with no wait."""
        self._arg("sum_squares", "x", x, ndim=1)
        self._into_arg("sum_squares", into, 1)
        return self._sum_reduce("sum_squares", self._k.sum_squares_partial, x.size, x, into=into)

    def scale_(self, x, s):
        """x[n] *= s."""
        self._arg("scale_", "x", x, ndim=1)
        self._elementwise(self._k.scale, x.size, x, np.float32(s))

    def fill_(self, x, value):
        """x[...] = value, any dtype."""
        self._arg("fill_", "x", x, dtype=x.dtype)
        self._elementwise(self._k.fill, x.size, _flat(x), x.dtype.type(value))

    def decay_table(self, runs) -> DecayRuns:
        """DecayRuns with the runs' starts and decayed flags uploaded once (the update looks each element's up)."""
        table = DecayRuns(runs)
        starts = np.array([lo for lo, _, _ in table.runs] or [0], dtype=np.int64)
        decayed = np.array([d != 0 for _, _, d in table.runs] or [0], dtype=np.int64)
        table.device = (self.asarray(starts), self.asarray(decayed))
        return table

    def sgd_update(self, param, grad, momentum_buf, *, lr, momentum, weight_decay, nesterov, grad_scale=1.0):
        """torch.optim.SGD step over the flat buffers, one fused kernel (momentum_buf unused if momentum = 0);
        ``grad_scale``: the clipping factor, applied as the gradients are read; ``weight_decay`` a number or a
        ``decay_table``."""
        self._check_flat("sgd_update", param=param, grad=grad, momentum_buf=momentum_buf)
        self._check_decay("sgd_update", weight_decay, param.shape[0])
        f32 = np.float32
        if isinstance(weight_decay, DecayRuns):
            starts, decayed = self._decay_arrays(weight_decay)
            self._elementwise(self._k.sgd_update_runs, param.size, param, grad, f32(grad_scale), momentum_buf,
                              starts, decayed, f32(lr), f32(momentum), f32(weight_decay.value), bool(momentum != 0),
                              bool(nesterov))
            return
        self._elementwise(self._k.sgd_update, param.size, param, grad, f32(grad_scale), momentum_buf, f32(lr),
                          f32(momentum), f32(weight_decay), bool(momentum != 0), bool(nesterov))

    def _decay_arrays(self, table):
        if table.device is None:  # made by another backend's decay_table
            table = self.decay_table(table.runs)
        return table.device

    def adam_update(self, param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step, decoupled,
                    grad_scale=1.0):
        """torch.optim.Adam (L2 decay) / AdamW (decoupled decay) step over the flat buffers, one fused kernel;
        ``grad_scale``: the clipping factor, applied as the gradients are read."""
        self._check_flat("adam_update", param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
        self._check_decay("adam_update", weight_decay, param.shape[0])
        f32 = np.float32
        step_size = lr / (1.0 - beta1**step)  # bias corrections in float64 on the host, as cpu.py does
        bc2_sqrt = math.sqrt(1.0 - beta2**step)
        runs = weight_decay if isinstance(weight_decay, DecayRuns) else None
        wd = runs.value if runs is not None else weight_decay  # the decayed runs' (the others: 0, as one-run calls)
        keep, l2 = (1.0 - lr * wd, 0.0) if decoupled else (1.0, wd)
        common = (f32(step_size), f32(beta1), f32(beta2), f32(1.0 - beta1), f32(1.0 - beta2), f32(bc2_sqrt), f32(eps),
                  f32(l2), f32(keep))
        if runs is not None:
            self._elementwise(self._k.adam_update_runs, param.size, param, grad, f32(grad_scale), exp_avg, exp_avg_sq,
                              *self._decay_arrays(runs), *common)
            return
        self._elementwise(self._k.adam_update, param.size, param, grad, f32(grad_scale), exp_avg, exp_avg_sq, *common)

    # ------------------------------------------------------------------ launching

    def _launch(self, kernel, grid, threads, *args):
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
        self._scalars.copy_to_host(self._host_scalars, stream=self.stream)
        self._wait()
        return self._host_scalars.copy()

    # ------------------------------------------------------------------ argument checks

    def _require_device(self, op, name, arr):
        if not _is_device_array(arr):
            shape = getattr(arr, "shape", None)
            raise BackendError(f"{op}: {name} must be a device array (backend.asarray), got "
                               f"{type(arr).__name__}" + (f" with shape {tuple(shape)}" if shape is not None else ""))

    def _arg(self, op, name, arr, **kw):
        """check_array plus: the array lives on the device (a host array would be copied back and forth)."""
        self._require_device(op, name, arr)
        return check_array(op, name, arr, **kw)


def _flat(arr):
    """A 1-D view of a C-contiguous device array (the element-wise kernels index flat)."""
    return arr if arr.ndim == 1 else arr.reshape(arr.size)


def _multiprocessors() -> int:
    try:
        return int(cuda.get_current_device().MULTIPROCESSOR_COUNT)
    except Exception:  # an attribute the driver does not report: a safe grid cap anyway
        return 128


def _raw_alloc(nbytes):
    return cuda.current_context().memalloc(nbytes)


def _wrap_address(address, n, owner):
    """``n`` float32 at a device address that ``owner`` holds (a ReleasableDevice's reserved range)."""
    desc = {"shape": (n,), "strides": None, "typestr": "<f4", "data": (address, False), "version": 3}
    return cuda.from_cuda_array_interface(desc, owner=owner, sync=False)


def _wrap(block, shape, dtype, owner):
    desc = {"shape": shape, "strides": None, "typestr": dtype.str, "data": (block.device_pointer_value, False),
            "version": 3}
    return cuda.from_cuda_array_interface(desc, owner=owner, sync=False)
