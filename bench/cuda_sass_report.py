"""What every CUDA kernel compiles to on sm_90 and sm_80, without a GPU: registers, memory, occupancy, the GEMM's K loop.

    python bench/cuda_sass_report.py                  # every kernel at the default block (256) and tile
    python bench/cuda_sass_report.py --block 1024     # at the largest block the backend accepts
    python bench/cuda_sass_report.py --tile 64,64,8,4,4 --only gemm_nt gemm_nn gemm_tn

Needs NVVM and ptxas (``pip install 'numba-cuda[cu12]'``) and nvdisasm (``pip install
nvidia-cuda-nvdisasm``), all in hpctrain's test extra; no GPU or driver. Per kernel and launch
signature (hpctrain/backend/cuda/compile.py): registers per thread, local-memory stack and spill
bytes, static shared memory per block, float64 PTX instructions, blocks per SM and the share of
the SM's threads they keep busy at the block size the backend launches them with. For the GEMM,
also the multiply-adds (FFMA) among the instructions of its K loop, and whether the shared loads
are 128-bit. And the seconds each took to compile to PTX (numba's typing and lowering, then NVVM: what a GPU
job spends on its first step), with the total per architecture at the end. Targets (issue 13): GEMM K-loop FFMA share >= 60% (40% at the 32×32 tiling for narrow products), <= 128 registers, no stack,
>= 2 blocks per SM in every layout. tests/test_cuda_compile.py checks the same in CI.

Figure: registers, stack, occupancy and the GEMM's K-loop FFMA share per kernel; docs/performance.md, "GEMM" (every
run behind it: docs/performance-log.md).
"""

import argparse
import re
import sys
import time

from hpctrain.backend.cuda import compile as cc
from hpctrain.backend.cuda.gemm.tiled import GPU_TILE, GemmTile


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--block", type=int, default=256, help="threads per block of the non-GEMM kernels")
    p.add_argument("--tile", default=",".join(map(str, GPU_TILE)), help="GEMM tile BM,BN,BK,TM,TN")
    p.add_argument("--only", nargs="+", help="these kernels only")
    a = p.parse_args()
    tile = GemmTile(*map(int, a.tile.split(","))).check()
    print(f"block {a.block}, GEMM tile {tuple(tile)} ({tile.threads[0] * tile.threads[1]} threads)")
    print(f"{'kernel':27s} {'arch':6s} {'regs':>4s} {'stack':>5s} {'spill':>7s} {'smem':>6s} {'f64':>4s} "
          f"{'blocks/SM':>9s} {'occupancy':>9s} {'compile':>7s}  GEMM K loop")
    met = True
    compile_s = {arch: 0.0 for arch in cc.ARCHS}
    for k in cc.kernels(block=a.block, tile=tile):
        if a.only and k.name not in a.only:
            continue
        for arch in reversed(cc.ARCHS):
            t0 = time.perf_counter()
            ptx = cc.ptx(k, arch)
            took = time.perf_counter() - t0
            compile_s[arch] += took
            info = cc.assemble(ptx, arch)
            blocks, occ = cc.occupancy(info, k.threads, arch)
            extra = ""
            if k.name.startswith("gemm_"):
                code = cc.sass(info.cubin)
                share, ffma, n = cc.k_loop_ffma_share(code)
                wide = "LDS.128" in code
                extra = f"FFMA {ffma}/{n} = {share:.0%}, shared loads {'128-bit' if wide else '32-bit'}"
                floor = 0.4 if k.name.startswith("gemm_tiny_") else 0.6  # as tests/test_cuda_compile.py
                ok = share >= floor and info.registers <= 128 and not info.stack and blocks >= 2
                met &= ok
                extra += "" if ok else "  (target missed)"
            sig = "" if len(cc.signatures()[k.name]) == 1 else " " + re.sub(r"Array\((\w+), (\d).*?\)", r"\1[\2d]",
                                                                              str(k.argtypes[0]))
            print(f"{(k.name + sig)[:27]:27s} sm_{arch[0]}{arch[1]:<3d} {info.registers:4d} {info.stack:5d} "
                  f"{info.spill_stores:3d}/{info.spill_loads:<3d} {info.shared:6d} {cc.float64_ops(ptx):4d} "
                  f"{blocks:9d} {occ:9.0%} {took:6.2f}s  {extra}")
    print("compile to PTX: " + ", ".join(f"sm_{a[0]}{a[1]} {compile_s[a]:.1f} s" for a in reversed(cc.ARCHS)))
    print("GEMM targets (FFMA >= 60% of the K loop, 40% at the tiny tiling, <= 128 registers, no stack, >= 2 blocks/SM): "
          + ("met" if met else "MISSED"))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
