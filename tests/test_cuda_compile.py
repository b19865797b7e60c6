"""Every CUDA kernel compiles for real GPUs (sm_80, sm_90) without one, within what its launches allow.

NVVM (numba-cuda[cu12], in the test extra) makes the PTX and ptxas assembles it; nvdisasm (the
nvidia-cuda-nvdisasm wheel, also in the test extra) shows the GEMM's machine code. The checks:

* every kernel of the backend compiles and assembles, at the argument types it is launched with
  (hpctrain/backend/cuda/compile.py lists them), and a kernel missing from that list fails;
* every kernel launches at the largest block the backend accepts (1024 threads: at most 64
  registers) as well as at the default (256), where none spills or needs a local-memory stack
  (at 1024 a few bytes may spill: the register limit is the point there); the GEMM never does;
* float64 instructions only in the kernels meant to accumulate in float64 (``FLOAT64_KERNELS``);
* the GEMM at its tilings: at most 128 registers (two blocks per SM) and multiply-adds at least
  60% of its K loop, 40% at the 32×32 tiling for narrow products (docs/performance.md has the figures,
  from bench/cuda_sass_report.py).
"""

import functools

import pytest

cuda_compile = pytest.importorskip("hpctrain.backend.cuda.compile")


def _nvvm_reason():
    try:
        from numba import cuda  # noqa: F401
        from numba.cuda.cudadrv import nvvm

        nvvm.NVVM()
    except Exception as e:  # numba-cuda missing, or no libnvvm: nothing to compile with
        return f"NVVM is not available ({type(e).__name__}: {e}); pip install 'numba-cuda[cu12]'"
    if cuda_compile.find_tool("ptxas") is None:
        return "ptxas not found; pip install 'numba-cuda[cu12]' (it brings nvidia-cuda-nvcc-cu12)"
    return None


REASON = _nvvm_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))
BLOCKS = (256, 1024)  # the GPU default, and the largest block the backend accepts


@functools.lru_cache(maxsize=None)
def built(block):
    """[(kernel, cc, ptx, PtxasInfo)] for every kernel at ``block`` threads, both targets."""
    out = []
    for k in cuda_compile.kernels(block=block):
        if k.name.startswith(("gemm_", "flash_")) and block != BLOCKS[0]:
            continue  # the GEMM's block is its tile's, the flash kernels' their own, whatever ``block`` says
        for cc in cuda_compile.ARCHS:
            ptx = cuda_compile.ptx(k, cc)
            out.append((k, cc, ptx, cuda_compile.assemble(ptx, cc)))
    return out


@pytest.mark.parametrize("block", BLOCKS)
def test_every_kernel_compiles_and_launches_without_spills(block):
    problems = []
    for k, cc, _, info in built(block):
        blocks, _ = cuda_compile.occupancy(info, k.threads, cc)
        where = f"{k.name} {k.argtypes} sm_{cc[0]}{cc[1]} at {k.threads} threads"
        if blocks == 0:
            problems.append(f"{where}: cannot launch ({info.registers} registers, {info.shared} bytes shared)")
        spills = info.stack or info.spill_stores or info.spill_loads
        if spills and (k.name.startswith(("gemm_", "flash_")) or k.threads == BLOCKS[0]):  # small ones at 1024 threads may
            problems.append(f"{where}: {info.stack} bytes stack, {info.spill_stores}/{info.spill_loads} bytes "
                            "spilled")
        if info.shared > 48 * 1024:
            problems.append(f"{where}: {info.shared} bytes of static shared memory (at most 48 KiB)")
    assert not problems, "\n".join(problems)
    assert {k.name for k, *_ in built(block)} >= {"adam_update", "attention_softmax_rows"} | (
        {"gemm_nt", "gemm_nn", "gemm_tn", "gemm_small_batched_tn", "sum_splits"} if block == BLOCKS[0] else set())


def test_float64_only_where_meant():
    used = {k.name: cuda_compile.float64_ops(ptx) for k, _, ptx, _ in built(BLOCKS[0])}
    stray = {name: n for name, n in used.items() if n and name not in cuda_compile.FLOAT64_KERNELS}
    assert not stray, f"float64 instructions in kernels meant to be float32: {stray}"
    assert used["sum_squares_partial"] > 0  # the check sees float64 where it is


def test_a_kernel_without_a_launch_signature_fails_the_check(monkeypatch):
    from numba import cuda

    import hpctrain.backend.cuda.norm as norm

    original = norm.kernels

    @cuda.jit
    def new_kernel(x):
        x[0] = 1.0

    def with_new(nt):
        k = original(nt)
        return type(k)(**vars(k), new_kernel=new_kernel)

    monkeypatch.setattr(norm, "kernels", with_new)
    with pytest.raises(LookupError, match="new_kernel"):
        cuda_compile.kernels(block=256)


def test_the_gemm_keeps_two_blocks_per_sm_and_its_k_loop_busy():
    if cuda_compile.find_tool("nvdisasm") is None:
        pytest.skip("nvdisasm not found; pip install nvidia-cuda-nvdisasm")
    for k, cc, _, info in built(BLOCKS[0]):
        if not k.name.startswith("gemm_"):
            continue
        blocks, _ = cuda_compile.occupancy(info, k.threads, cc)
        share, ffma, n = cuda_compile.k_loop_ffma_share(cuda_compile.sass(info.cubin))
        where = f"{k.name} sm_{cc[0]}{cc[1]}"
        assert info.registers <= 128 and blocks >= 2, f"{where}: {info.registers} registers, {blocks} block(s)/SM"
        # the 32×32 tiling does 16 multiply-adds per two 128-bit shared loads, and its K loop's global loads and
        # barrier weigh more: 44-49%; it runs only where the larger tilings would leave most SMs idle
        floor = 0.4 if k.name.startswith("gemm_tiny_") else 0.6
        assert share >= floor, f"{where}: multiply-adds {ffma} of {n} K-loop instructions ({share:.0%})"
