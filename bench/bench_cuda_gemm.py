"""The library GEMM (CudaBackend.matmul_*) against cuBLAS SGEMM with TF32 off, in all three layouts.

    python bench/bench_cuda_gemm.py                          # 1024², 2048², 4096²; cuBLAS via PyTorch, else CuPy
    python bench/bench_cuda_gemm.py --cublas cupy --sizes 4096
    python bench/bench_cuda_gemm.py --tile 64,64,8,4,4       # another tiling (BM,BN,BK,TM,TN)
    python bench/bench_cuda_gemm.py --sizes --shapes gpt-char  # gpt-char's products (M x K x N, C = A·Bᵀ is M x N)
    NUMBA_ENABLE_CUDASIM=1 python bench/bench_cuda_gemm.py   # correctness of the three layouts only

Layouts: nt = X·Wᵀ (Linear forward), nn = dY·W (input gradient), tn = dYᵀ·X (weight
gradient); cuBLAS runs the same products (``a @ b.T``, ``a @ b``, ``a.T @ b``) in
float32 with TF32 disabled (PyTorch: ``allow_tf32 = False``, precision "highest";
CuPy: ``CUPY_TF32=0``). Each size and layout is checked against cuBLAS's result
before it is timed. Target: the library at >= 50 % of cuBLAS SGEMM at 4096² (nt).

Figure: the library GEMM / cuBLAS SGEMM (TF32 off) in all three layouts; docs/performance.md, "GEMM" (every run
behind it: docs/performance-log.md).
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_common import check, gemm_tolerance, gflops, gpu_mode, time_kernel  # noqa: E402

from hpctrain.backend.cuda import CudaBackend  # noqa: E402
from hpctrain.backend.cuda.gemm.tiled import GemmTile  # noqa: E402

LAYOUTS = ("nt", "nn", "tn")
# gpt-char's products (jobs/configs/gpt-char.toml: batch 32 x block 64 = 2048 rows, n_embd 128, vocab 128), as
# M x K x N: the forward products of qkv, the attention projection and lm_head (both 128 x 128), MLP up and MLP down
# (their input gradients have the same sizes), then the weight gradients, whose contraction is the 2048 rows.
GPT_CHAR = ("2048x128x384", "2048x128x128", "2048x128x512", "2048x512x128",
            "384x2048x128", "128x2048x128", "512x2048x128", "128x2048x512")


def operands(layout, a, b):
    """(A, B) host operands of ``layout`` whose product is C = a·bᵀ."""
    if layout == "nt":
        return a, b
    if layout == "nn":
        return a, np.ascontiguousarray(b.T)
    return np.ascontiguousarray(a.T), np.ascontiguousarray(b.T)


def reference(a, b):
    return a.astype(np.float64) @ b.astype(np.float64).T


def library_call(be, layout, A, B, C):
    if layout == "nt":
        return lambda: be.matmul_nt(A, B, C)
    if layout == "nn":
        return lambda: be.matmul_nn(A, B, C)
    return lambda: be.matmul_tn(A, B, C)


class TorchBlas:
    name = "PyTorch"

    def __init__(self):
        import torch

        if not torch.cuda.is_available():
            raise ImportError("PyTorch has no CUDA device")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        self.torch = torch
        self.version = f"torch {torch.__version__}"

    def setup(self, layout, A, B, shape):
        t = self.torch
        a, b = t.from_numpy(A).cuda(), t.from_numpy(B).cuda()
        c = t.empty(shape, dtype=t.float32, device="cuda")
        op = {"nt": lambda: t.matmul(a, b.T, out=c), "nn": lambda: t.matmul(a, b, out=c),
              "tn": lambda: t.matmul(a.T, b, out=c)}[layout]
        return op, lambda: c.cpu().numpy()

    def time(self, fn, repeat, number=10):
        t = self.torch
        for _ in range(2):
            fn()
        t.cuda.synchronize()
        best = float("inf")
        for _ in range(repeat):
            start, stop = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(number):
                fn()
            stop.record()
            stop.synchronize()
            best = min(best, start.elapsed_time(stop) / 1e3 / number)
        return best


class CupyBlas:
    name = "CuPy"

    def __init__(self):
        os.environ.setdefault("CUPY_TF32", "0")  # read when cupy is imported: plain SGEMM
        if os.environ["CUPY_TF32"] != "0":
            raise ImportError("CUPY_TF32 is set: unset it to compare against plain SGEMM")
        import cupy

        self.cp = cupy
        self.version = f"cupy {cupy.__version__}"

    def setup(self, layout, A, B, shape):
        cp = self.cp
        a, b = cp.asarray(A), cp.asarray(B)
        c = cp.empty(shape, dtype=cp.float32)
        op = {"nt": lambda: cp.matmul(a, b.T, out=c), "nn": lambda: cp.matmul(a, b, out=c),
              "tn": lambda: cp.matmul(a.T, b, out=c)}[layout]
        return op, lambda: cp.asnumpy(c)

    def time(self, fn, repeat, number=10):
        cp = self.cp
        for _ in range(2):
            fn()
        cp.cuda.Device().synchronize()
        best = float("inf")
        for _ in range(repeat):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for _ in range(number):
                fn()
            stop.record()
            stop.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(start, stop) / 1e3 / number)
        return best


def load_blas(choice):
    errors = []
    for cls in {"torch": [TorchBlas], "cupy": [CupyBlas], "auto": [TorchBlas, CupyBlas]}[choice]:
        try:
            return cls()
        except ImportError as e:
            errors.append(f"{cls.name}: {e}")
    print("cuBLAS comparison skipped (" + "; ".join(errors) + "); timing the library alone")
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="*", default=[1024, 2048, 4096], help="square sizes")
    p.add_argument("--shapes", nargs="*", default=[], help="M x K x N products, e.g. 2048x128x384, or gpt-char")
    p.add_argument("--cublas", choices=["auto", "torch", "cupy"], default="auto")
    p.add_argument("--tile", default=None, help="BM,BN,BK,TM,TN (default: the backend's GPU_TILE)")
    p.add_argument("--repeat", type=int, default=5, help="timed rounds of 10 calls each")
    args = p.parse_args()
    mode = gpu_mode("bench_cuda_gemm")
    tile = GemmTile(*map(int, args.tile.split(","))) if args.tile else None
    be = CudaBackend(tile=tile, gemm="numba")  # the tiled kernel: cuBLAS is timed beside it
    rng = np.random.default_rng(0)
    if mode == "sim":
        M, K, N = 13, 11, 9
        a, b = (rng.standard_normal(s).astype(np.float32) for s in ((M, K), (N, K)))
        want = reference(a, b)
        for layout in LAYOUTS:
            A, B = operands(layout, a, b)
            C = be.empty((M, N))
            library_call(be, layout, be.asarray(A), be.asarray(B), C)()
            check(f"library {layout} at {M}x{K}x{N}", be.to_host(C), want, **gemm_tolerance(K))
        print(f"library GEMM correct in layouts {', '.join(LAYOUTS)} at {M}x{K}x{N} (tile {tuple(be.tile)})")
        return
    blas = load_blas(args.cublas)
    print(f"library tile {tuple(be.tile)}" + (f", cuBLAS through {blas.version}" if blas else ""))
    ratios = {}
    shapes = [(S, S, S) for S in args.sizes]
    for spec in args.shapes:
        shapes += [tuple(map(int, x.split("x"))) for x in (GPT_CHAR if spec == "gpt-char" else (spec,))]
    for M, K, N in shapes:
        a, b = (rng.standard_normal(s).astype(np.float32) for s in ((M, K), (N, K)))
        want = reference(a, b)
        name = f"M=N=K={M:5d}" if M == N == K else f"{M}x{K}x{N}"
        for layout in LAYOUTS:
            A, B = operands(layout, a, b)
            Ad, Bd, C = be.asarray(A), be.asarray(B), be.empty((M, N))
            lib = library_call(be, layout, Ad, Bd, C)
            lib()
            check(f"library {layout} at {name} against numpy", be.to_host(C), want, **gemm_tolerance(K))
            t_lib = time_kernel(lib, repeat=args.repeat, stream=be.stream)
            line = f"{layout}  {name}  library {t_lib * 1e3:8.3f} ms {gflops(M, N, K, t_lib):9.1f} GFLOP/s"
            if blas is not None:
                op, result = blas.setup(layout, A, B, (M, N))
                op()
                check(f"cuBLAS {layout} at {name} against numpy", result(), want, **gemm_tolerance(K))
                t_blas = blas.time(op, args.repeat)
                ratios[(M, K, N, layout)] = t_blas / t_lib
                line += (f"   cuBLAS {t_blas * 1e3:8.3f} ms {gflops(M, N, K, t_blas):9.1f} GFLOP/s"
                         f"   library/cuBLAS {100 * t_blas / t_lib:5.1f} %")
            print(line, flush=True)
    if (4096, 4096, 4096, "nt") in ratios:
        r = ratios[(4096, 4096, 4096, "nt")]
        print(f"target library >= 50 % of cuBLAS SGEMM at 4096² (nt): {100 * r:.1f} % -> "
              f"{'met' if r >= 0.5 else 'NOT met'}")


if __name__ == "__main__":
    main()
