"""Compile every CUDA kernel of the backend for real GPUs, without one.

NVVM (``numba.cuda.compile_ptx``, from ``numba-cuda[cu12]``) turns each kernel, at the
argument types the backend launches it with, into PTX for a compute capability;
``ptxas -v`` assembles it and reports registers, local-memory stack, spills and
shared memory per thread; ``nvdisasm`` (the ``nvidia-cuda-nvdisasm`` wheel) shows the
machine code (SASS). None of them needs a GPU or a driver. tests/test_cuda_compile.py
and bench/cuda_sass_report.py use this module:

    from hpctrain.backend.cuda import compile as cc
    for k in cc.kernels(block=256):                   # every kernel, each launch signature
        ptx = cc.ptx(k, (9, 0))
        info = cc.assemble(ptx, (9, 0))               # registers, stack, spills, shared, cubin

``signatures()`` lists each kernel's argument types as ``CudaBackend`` passes them
(device arrays are C-contiguous, Python ints int64, flags booleans); a kernel that
the factories return and the table lacks is an error (``kernels``), so a new
kernel cannot skip the checks. ``FLOAT64_KERNELS`` are the kernels meant to use
float64: the reductions that accumulate in it, and ``fill`` of a float64 buffer.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from types import SimpleNamespace
from typing import NamedTuple

__all__ = ["signatures", "FLOAT64_KERNELS", "Kernel", "kernels", "ptx", "assemble", "find_tool", "float64_ops",
           "occupancy", "sass", "k_loop_ffma_share", "ARCHS"]

ARCHS = ((8, 0), (9, 0))  # A100, H100/H200
FLASH_HS = (64, 128)  # the flash kernels' head sizes checked: the GPT-2 family's, and the largest they take

FLOAT64_KERNELS = frozenset({
    "sum_squares_partial", "sum_partials", "mse_partial", "softmax_cross_entropy",
    "ce_shard_sumexp", "ce_shard_grad",  # a float64 row result out, a float64 log Z in (converted once a row)
    "fill",  # fill(float64[::1], float64) clears the device-side scalars
    "bias_grad", "layernorm_backward",  # column sums in float64, as on the CPU
    "clip_decide", "gate_step",  # the gradient norm and clipping factor in float64, as on the host (optim.py)
})


def _types():
    from numba import types

    f1, f2, f4 = types.float32[::1], types.float32[:, ::1], types.float32[:, :, :, ::1]
    return SimpleNamespace(F1=f1, F2=f2, F4=f4, D1=types.float64[::1], D2=types.float64[:, ::1],
                           D3=types.float64[:, :, ::1], I1=types.int64[::1], I2=types.int64[:, ::1],
                           J1=types.int32[::1], i64=types.int64, f32=types.float32, f64=types.float64,
                           b1=types.boolean, U4=types.UniTuple(types.int64, 4), u64=types.uint64,
                           U1=types.uint64[::1], W1=types.uint32[::1], H1=types.uint16[::1],
                           H2=types.uint16[:, ::1])


def signatures() -> dict[str, tuple[tuple, ...]]:
    """Kernel name -> the argument types of each way ``CudaBackend`` launches it."""
    t = _types()
    F1, F2, D1, D2, I1, I2, J1 = t.F1, t.F2, t.D1, t.D2, t.I1, t.I2, t.J1
    i64, f32, f64, b1, U4, U1 = t.i64, t.f32, t.f64, t.b1, t.U4, t.U1
    gemm = ((F2, F2, F2, F1, i64, i64, i64, i64),)
    batched = ((F2, F2, F2) + (i64,) * 6 + (U4, U4, U4, i64),)
    flash = (i64, i64, f32, t.u64, t.u64, U1, b1, t.u64, f32, i64, i64, i64, b1)
    table = {
        # gemm/tiled.py: c = a·b in three layouts, the epilogue a launch argument, at the default tiling, the
        # small one (_small) and, for X·Wᵀ and dY·W, the tiny one (_tiny); the batched kernels (attention,
        # split-K: a GPU runs them at the small tiling only) and split-K's second stage
        "gemm_nt": gemm, "gemm_nn": gemm, "gemm_tn": gemm,
        "gemm_small_nt": gemm, "gemm_small_nn": gemm, "gemm_small_tn": gemm,
        "gemm_tiny_nt": gemm, "gemm_tiny_nn": gemm,  # weight gradients never take the tiny tiling
        "gemm_small_batched_nt": batched, "gemm_small_batched_nn": batched, "gemm_small_batched_tn": batched,
        "sum_splits": ((F1, F1, i64, b1),),
        # blocks.py, linear.py, activations.py, dropout.py, optim.py, norm.py, loss.py
        "fill": ((F1, f32), (I1, i64), (D1, f64)),
        "scale": ((F1, f32),),
        "add": ((F1, F1),),
        "dropout": ((F1, F1, i64, t.u64, t.u64, U1, b1, t.u64, f32, i64, i64, i64, b1),),
        "sum_squares_partial": ((F1, D1),),
        "sum_partials": ((D1, D1),),
        "bias_grad": ((F2, t.D3, I1, i64, F1, b1),),
        "relu_forward": ((F1, F1),), "relu_backward": ((F1, F1, F1),), "relu_backward_bf16": ((t.H1, F1, F1),),
        "gelu_forward": ((F1, F1),), "gelu_forward_bf16": ((F1, t.H1),),
        "gelu_backward": ((F1, F1, F1),), "gelu_backward_bf16": ((t.H1, F1, F1),),
        "tanh_forward": ((F1, F1),), "tanh_backward": ((F1, F1, F1),),
        "copy": ((F1, F1),),
        "round_bf16": ((t.W1, t.W1),),  # float32 buffers viewed as their bits (train.precision = "bf16")
        "to_bf16": ((t.W1, t.H1),),  # a float32 buffer's bits -> bfloat16 bits
        "from_bf16": ((t.H1, t.W1),),
        "layernorm_forward": ((F2, F2, b1, F1, F1, f32, F2, F1, F1),),
        "layernorm_forward_bf16": ((F2, F2, b1, F1, F1, f32, t.H2, F1, F1),),  # the output as bfloat16 words
        "layernorm_backward": ((F2, F2, F1, F1, F1, F2, F2, b1, D2, I1, F1, F1, b1),),
        "softmax_cross_entropy": ((F2, I1, F2, f32, D1, J1, I1, D1),),
        "ce_shard_stats": ((F2, I1, i64, F1, I1, F1),),
        "ce_shard_sumexp": ((F2, F1, D1),),
        "ce_shard_grad": ((F2, I1, i64, D1, F2, f32),),
        "mse_partial": ((F1, F1, F1, f32, D1),),
        "sgd_update": ((F1, F1, F1, F1, b1, b1),),
        "adam_update": ((F1, F1, F1, F1, F1),),
        "sgd_update_runs": ((F1, F1, F1, I1, I1, F1, b1, b1),),
        "adam_update_runs": ((F1, F1, F1, F1, I1, I1, F1),),
        "clip_decide": ((D1, f64, f64, D1),), "gate_step": ((F1, D1),),
        # embedding.py, attention.py
        "embedding_forward": ((I2, F2, F2, F2, I1, i64, i64, b1),),
        "embedding_backward_wte": ((F2, I1, i64, F2),),
        "embedding_backward_wpe": ((F2, i64, i64, F2, b1),),
        "attention_softmax_rows": ((F2, i64, f32),),
        "attention_softmax_backward_rows": ((F2, F2, i64, f32),),
        # heads made contiguous for cuBLASLt: float32 bits copied, or rounded to bfloat16 words; kept bfloat16
        # words copied
        "attention_heads": ((t.W1, i64, t.W1, i64, i64, i64, b1), (t.W1, i64, t.H1, i64, i64, i64, b1),
                            (t.H1, i64, t.H1, i64, i64, i64, b1)),
        "attention_rows": ((F1, F1, i64, i64, i64, i64),),
        # flash.py, at each of FLASH_HS (flash_forward_hs128, ..): dropout's key, cut, scale, row0, group,
        # stride and flag after T, H and the scale
        "flash_forward": ((F2, F2, F1) + flash,),
        "flash_backward_dq": ((F2, F2, F2, F1, F1, F2) + flash,),
        "flash_backward_dkdv": ((F2, F2, F1, F1, F2) + flash,),
    }
    for hs in FLASH_HS:
        for name in ("flash_forward", "flash_backward_dq", "flash_backward_dkdv"):
            table[_flash_name(name, hs)] = table[name]
    return table


def _flash_name(name: str, hs: int) -> str:
    """A flash kernel's name in the tables: with its head size but at the first of FLASH_HS."""
    return name if hs == FLASH_HS[0] else f"{name}_hs{hs}"



class Kernel(NamedTuple):
    name: str
    dispatcher: object  # a numba CUDA kernel
    argtypes: tuple
    threads: int  # the threads per block the backend launches it with


def kernels(block: int = 256, tile=None) -> list[Kernel]:
    """Every kernel of ``CudaBackend(block=block, tile=tile)``, once per launch signature.

    Raises LookupError naming any kernel the factories return that ``signatures()`` does not list
    (or the reverse)."""
    from numba.cuda.dispatcher import CUDADispatcher

    from . import FAMILIES
    from .flash import NT as FLASH_THREADS
    from .flash import flash_kernels
    from .gemm.tiled import GPU_SMALL_TILE, GPU_TILE, GPU_TINY_TILE, batched_gemm_kernels, gemm_kernels

    tile = tile or GPU_TILE
    found = {}
    for family in FAMILIES:
        found.update({n: k for n, k in vars(family.kernels(block)).items() if isinstance(k, CUDADispatcher)})
    threads = {}
    small = GPU_SMALL_TILE
    for layout, k, sk, bk in zip(("nt", "nn", "tn"), gemm_kernels(tile), gemm_kernels(small),
                                 batched_gemm_kernels(small)):
        found.update({"gemm_" + layout: k, "gemm_small_" + layout: sk, "gemm_small_batched_" + layout: bk})
        threads["gemm_" + layout] = tile.threads[0] * tile.threads[1]
        threads["gemm_small_" + layout] = threads["gemm_small_batched_" + layout] = small.threads[0] * small.threads[1]
    tiny = GPU_TINY_TILE
    for layout, k in zip(("nt", "nn"), gemm_kernels(tiny)):
        found["gemm_tiny_" + layout] = k
        threads["gemm_tiny_" + layout] = tiny.threads[0] * tiny.threads[1]
    found["sum_splits"] = batched_gemm_kernels(small)[3]
    for hs in FLASH_HS:
        for name, k in vars(flash_kernels(hs)).items():
            name = _flash_name(name, hs)
            found[name], threads[name] = k, FLASH_THREADS
    table = signatures()
    unknown, missing = sorted(set(found) - set(table)), sorted(set(table) - set(found))
    if unknown or missing:
        raise LookupError(f"kernels without launch signatures in compile.signatures(): {unknown}; "
                          f"signatures of kernels that no longer exist: {missing}")
    return [Kernel(name, found[name], sig, threads.get(name, block))
            for name in sorted(found) for sig in table[name]]


@contextlib.contextmanager
def _target(cc):
    """Device functions ask the driver for the compute capability; a machine with no GPU has none."""
    import numba.cuda.dispatcher as dispatcher

    saved = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=cc)
    try:
        yield
    finally:
        dispatcher.get_current_device = saved


def ptx(kernel: Kernel, cc) -> str:
    """The kernel's PTX for compute capability ``cc`` with the options it was declared with."""
    from numba import cuda

    opts = kernel.dispatcher.targetoptions
    with _target(cc):
        text, _ = cuda.compile_ptx(kernel.dispatcher.py_func, kernel.argtypes, cc=cc,
                                   fastmath=bool(opts.get("fastmath", False)), launch_bounds=opts.get("launch_bounds"))
    return text


def find_tool(name: str) -> str | None:
    """``ptxas`` / ``nvdisasm``: on PATH, else from the nvidia-cuda-nvcc / nvidia-cuda-nvdisasm wheels."""
    found = shutil.which(name)
    if found:
        return found
    for base in sys.path:
        for sub in ("cuda_nvcc", "cu13", "cu12", "cuda_nvdisasm"):
            path = os.path.join(base, "nvidia", sub, "bin", name)
            if os.access(path, os.X_OK):
                return path
    return None


class PtxasInfo(NamedTuple):
    registers: int
    stack: int  # bytes of local-memory stack frame per thread
    spill_stores: int
    spill_loads: int
    shared: int  # bytes of static shared memory per block
    cubin: bytes


def assemble(ptx_text: str, cc) -> PtxasInfo:
    """``ptxas -v`` for ``sm_XY``; raises RuntimeError with ptxas's output when it fails."""
    tool = find_tool("ptxas")
    if tool is None:
        raise FileNotFoundError("ptxas not found: pip install 'numba-cuda[cu12]' (the nvidia-cuda-nvcc-cu12 wheel)")
    with tempfile.TemporaryDirectory() as tmp:
        src, out = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as f:
            f.write(ptx_text)
        r = subprocess.run([tool, f"-arch=sm_{cc[0]}{cc[1]}", "-v", src, "-o", out], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"ptxas failed for sm_{cc[0]}{cc[1]}:\n{r.stderr[-3000:]}")
        with open(out, "rb") as f:
            cubin = f.read()
    log = r.stderr

    def number(pattern):
        m = re.search(pattern, log)
        return int(m.group(1)) if m else 0

    return PtxasInfo(registers=number(r"Used (\d+) registers"), stack=number(r"(\d+) bytes stack frame"),
                     spill_stores=number(r"(\d+) bytes spill stores"), spill_loads=number(r"(\d+) bytes spill loads"),
                     shared=number(r"(\d+) bytes smem"), cubin=cubin)


def float64_ops(ptx_text: str) -> int:
    """PTX instructions that operate on float64 (declarations of .f64 registers not counted)."""
    return len(re.findall(r"^\s*(?:@%p\d+\s+)?[a-z][\w.]*\.f64\b", ptx_text, re.M))


# per-SM limits of the compute capabilities in ARCHS
_SM = {(8, 0): dict(regs=65536, threads=2048, blocks=32, shared=164 * 1024),
       (9, 0): dict(regs=65536, threads=2048, blocks=32, shared=228 * 1024)}


def occupancy(info: PtxasInfo, threads: int, cc) -> tuple[int, float]:
    """(blocks per SM, fraction of the SM's threads busy) for blocks of ``threads``; 0 blocks: cannot launch."""
    sm = _SM[cc]
    if threads > 1024 or info.registers * threads > sm["regs"]:
        return 0, 0.0
    warps = -(-threads // 32)
    regs_per_warp = -(-max(info.registers, 1) * 32 // 256) * 256  # allocated per warp in units of 256
    by_regs = sm["regs"] // (regs_per_warp * warps)
    by_shared = sm["shared"] // info.shared if info.shared else sm["blocks"]
    blocks = min(by_regs, by_shared, sm["threads"] // (warps * 32), sm["blocks"])
    return blocks, blocks * warps * 32 / sm["threads"]


def sass(cubin: bytes) -> str:
    """The machine code of a cubin (``nvdisasm``)."""
    tool = find_tool("nvdisasm")
    if tool is None:
        raise FileNotFoundError("nvdisasm not found: pip install nvidia-cuda-nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        r = subprocess.run([tool, "-c", f.name], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"nvdisasm failed:\n{r.stderr[-2000:]}")
    return r.stdout


def k_loop_ffma_share(sass_text: str) -> tuple[float, int, int]:
    """(FFMA / instructions, FFMAs, instructions) in the loop with the most FFMAs: a GEMM's K loop.

    A loop is a backward branch ``BRA .L_x_N`` to a label above it; its body is the instructions between."""
    lines = sass_text.splitlines()
    labels, instructions = {}, []  # label -> index of the next instruction; (text) per instruction
    for line in lines:
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(instructions)
            continue
        m = re.match(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            instructions.append(m.group(1))
    best = (0.0, 0, 0)
    for end, text in enumerate(instructions):
        m = re.search(r"\bBRA\b.*?(\.L_x_\d+)", text)
        if not m or labels.get(m.group(1), end + 1) > end:
            continue
        body = instructions[labels[m.group(1)]:end + 1]
        ffma = sum(1 for ins in body if re.search(r"\bFFMA\b", ins))
        if ffma > best[1]:
            best = (ffma / len(body), ffma, len(body))
    return best
