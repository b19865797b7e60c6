"""cuBLASLt (hpctrain/backend/cuda/gemm/cublaslt.py) in fp32, tf32 and bf16 against the numba GEMM and PyTorch/CuPy.

    python bench/bench_cublaslt.py                        # 4096² and nanoGPT shakespeare-char's products
    python bench/bench_cublaslt.py --sizes 4096 --shapes  # 4096² only
    python bench/bench_cublaslt.py --precisions bf16 --shapes 16384x384x1536

Each product C[M,N] = A·Bᵀ with contraction K ("M x K x N") runs in the three layouts the backend uses:
nt = X·Wᵀ (Linear forward), nn = dY·W (input gradient), tn = dYᵀ·X (weight gradient). Per precision,
cuBLASLt's result is checked against a float64 numpy reference of the same (rounded) inputs before it is
timed (a wrong product is never timed), then timed with CUDA events on one stream. The numba GEMM
(CudaBackend.matmul_*, fp32 only) and PyTorch (TF32 off for fp32, on for tf32, bf16 tensors for bf16; else
CuPy, fp32 only) run the same products. bf16: bf16 inputs and output, fp32 accumulation. nanoGPT's shapes:
batch 64 x block 256 = 16384 rows, n_embd 384 (qkv 1152, MLP 1536), vocab 65.

Prints TFLOP/s per product and one ``summary`` line per precision at 4096² (nt). Needs a GPU, numba-cuda and
nvmath-python with libcublasLt (pip install 'hpctrain[cuda]'); without them it says why and exits 0.
"""

import argparse
import importlib.util
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_common import gpu_mode, time_kernel  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = ("nt", "nn", "tn")
PRECISIONS = ("fp32", "tf32", "bf16")
NANOGPT = ("16384x384x1152", "16384x384x384", "16384x384x1536", "16384x1536x384", "16384x384x65")
TOLERANCE = {"fp32": 1e-5, "tf32": 5e-3, "bf16": 2e-2}  # max |error| / max |reference|


def load_provider():
    try:
        from hpctrain.backend.cuda.gemm import cublaslt
    except ImportError:  # backend/cuda/__init__.py still a module: load the provider by its path
        spec = importlib.util.spec_from_file_location(
            "hpctrain_backend_cuda_gemm_cublaslt",
            os.path.join(ROOT, "hpctrain", "backend", "cuda", "gemm", "cublaslt.py"))
        cublaslt = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = cublaslt
        spec.loader.exec_module(cublaslt)
    return cublaslt


def operands(layout, a, b):
    """(A, B) row-major operands of ``layout`` whose product is C = a·bᵀ."""
    if layout == "nt":
        return a, b
    if layout == "nn":
        return a, np.ascontiguousarray(b.T)
    return np.ascontiguousarray(a.T), np.ascontiguousarray(b.T)


def storage(x, precision):
    """Host array as cuBLASLt reads it (bf16 as its bit pattern in uint16: numba has no bf16 arrays) and the
    float64 values it holds."""
    if precision != "bf16":
        return x, x.astype(np.float64)
    import ml_dtypes

    xb = x.astype(ml_dtypes.bfloat16)
    return xb.view(np.uint16), xb.astype(np.float64)


def from_storage(x, precision):
    if precision != "bf16":
        return x.astype(np.float64)
    import ml_dtypes

    return x.view(ml_dtypes.bfloat16).astype(np.float64)


def check(name, got, want, precision):
    err = float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))
    if not err <= TOLERANCE[precision]:
        print(f"FAIL {name}: max error {err:.2e} of the largest value (allowed {TOLERANCE[precision]:.0e})")
        sys.exit(1)


def tflops(M, N, K, seconds):
    return 2.0 * M * N * K / seconds / 1e12


class Torch:
    name = "PyTorch"

    def __init__(self):
        import torch

        if not torch.cuda.is_available():
            raise ImportError("PyTorch has no CUDA device")
        self.t = torch

    def setup(self, precision, layout, A, B, shape):
        t = self.t
        t.backends.cuda.matmul.allow_tf32 = precision == "tf32"
        dtype = t.bfloat16 if precision == "bf16" else t.float32
        a, b = (t.from_numpy(x).cuda().to(dtype) for x in (A, B))
        c = t.empty(shape, dtype=dtype, device="cuda")
        op = {"nt": lambda: t.matmul(a, b.T, out=c), "nn": lambda: t.matmul(a, b, out=c),
              "tn": lambda: t.matmul(a.T, b, out=c)}[layout]
        return op, lambda: c.float().cpu().numpy().astype(np.float64)

    def time(self, fn, repeat):
        t = self.t
        for _ in range(2):
            fn()
        t.cuda.synchronize()
        best = float("inf")
        for _ in range(repeat):
            start, stop = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                fn()
            stop.record()
            stop.synchronize()
            best = min(best, start.elapsed_time(stop) / 1e4)
        return best


class Cupy:
    name = "CuPy"

    def __init__(self):
        os.environ.setdefault("CUPY_TF32", "0")
        import cupy

        self.cp = cupy

    def setup(self, precision, layout, A, B, shape):
        if precision != "fp32":
            return None, None  # CuPy's TF32 is fixed at import, and it has no bf16 GEMM
        cp = self.cp
        a, b = cp.asarray(A), cp.asarray(B)
        c = cp.empty(shape, dtype=cp.float32)
        op = {"nt": lambda: cp.matmul(a, b.T, out=c), "nn": lambda: cp.matmul(a, b, out=c),
              "tn": lambda: cp.matmul(a.T, b, out=c)}[layout]
        return op, lambda: cp.asnumpy(c).astype(np.float64)

    def time(self, fn, repeat):
        cp = self.cp
        for _ in range(2):
            fn()
        cp.cuda.Device().synchronize()
        best = float("inf")
        for _ in range(repeat):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            for _ in range(10):
                fn()
            stop.record()
            stop.synchronize()
            best = min(best, cp.cuda.get_elapsed_time(start, stop) / 1e4)
        return best


def load_other():
    for cls in (Torch, Cupy):
        try:
            return cls()
        except ImportError:
            pass
    print("neither PyTorch nor CuPy with CUDA: cuBLASLt against the numba GEMM only")
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="*", default=[4096], help="square sizes")
    p.add_argument("--shapes", nargs="*", default=["nanogpt"], help="M x K x N products, or nanogpt")
    p.add_argument("--precisions", nargs="*", default=list(PRECISIONS), choices=PRECISIONS)
    p.add_argument("--repeat", type=int, default=3, help="timed rounds of 10 calls each")
    args = p.parse_args()
    if gpu_mode("bench_cublaslt") == "sim":
        print("bench_cublaslt: cuBLASLt needs a real GPU (tests/test_cublaslt.py proves the plans without one)")
        return
    cublaslt = load_provider()
    reason = cublaslt.unavailable()
    if reason:
        print(f"bench_cublaslt: {reason}; nothing to measure")
        return
    from numba import cuda

    from hpctrain.backend.cuda import CudaBackend

    be = CudaBackend(gemm="numba")  # its matmul_* are "the numba GEMM" below
    lib = cublaslt.Cublaslt()
    other = load_other()
    shapes = [(S, S, S) for S in args.sizes]
    for spec in args.shapes:
        shapes += [tuple(map(int, x.split("x"))) for x in (NANOGPT if spec == "nanogpt" else (spec,))]
    rng = np.random.default_rng(0)
    summary = {}
    for M, K, N in shapes:
        a, b = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((N, K)).astype(np.float32)
        name = f"M=N=K={M}" if M == N == K else f"{M}x{K}x{N}"
        for precision in args.precisions:
            (sa, va), (sb, vb) = storage(a, precision), storage(b, precision)
            want = va @ vb.T
            if precision == "tf32":  # compare with what TF32 can hold: the inputs' 10-bit mantissas
                want = a.astype(np.float64) @ b.astype(np.float64).T
            for layout in LAYOUTS:
                A, B = operands(layout, sa, sb)
                dA, dB = cuda.to_device(A, stream=be.stream), cuda.to_device(B, stream=be.stream)
                dC = cuda.device_array((M, N), dtype=sa.dtype, stream=be.stream)
                req = cublaslt.GemmRequest(layout, M, N, K, precision=precision)
                lt = lambda: lib.gemm(req, a=dA, b=dB, c=dC, stream=be.stream)  # noqa: E731
                lt()
                check(f"cuBLASLt {precision} {layout} {name}", from_storage(dC.copy_to_host(stream=be.stream),
                                                                            precision), want, precision)
                t_lt = time_kernel(lt, repeat=args.repeat, stream=be.stream)
                line = (f"cublaslt {precision:4s} {layout}  {name:18s} {t_lt * 1e3:8.3f} ms "
                        f"{tflops(M, N, K, t_lt):7.1f} TFLOP/s")
                ratios = {}
                if precision == "fp32":
                    fn = {"nt": be.matmul_nt, "nn": be.matmul_nn, "tn": be.matmul_tn}[layout]
                    dN = be.empty((M, N))
                    numba_call = lambda: fn(dA, dB, dN)  # noqa: E731
                    numba_call()
                    check(f"numba {layout} {name}", be.to_host(dN).astype(np.float64), want, "fp32")
                    t_nb = time_kernel(numba_call, repeat=args.repeat, stream=be.stream)
                    ratios["numba"] = t_nb / t_lt
                    line += f"   numba {tflops(M, N, K, t_nb):7.1f} TFLOP/s"
                if other is not None:
                    fa, fb = operands(layout, a, b)  # float32: PyTorch casts to bf16 itself (same rounding)
                    op, result = other.setup(precision, layout, fa, fb, (M, N))
                    if op is not None:
                        op()
                        check(f"{other.name} {precision} {layout} {name}", result(), want, precision)
                        t_o = other.time(op, args.repeat)
                        ratios[other.name] = t_o / t_lt
                        line += f"   {other.name} {tflops(M, N, K, t_o):7.1f} TFLOP/s"
                line += "".join(f"   cuBLASLt/{k} {v:5.2f}x" for k, v in ratios.items())
                print(line, flush=True)
                if (M, N, K, layout) == (4096, 4096, 4096, "nt"):
                    summary[precision] = (tflops(M, N, K, t_lt), ratios)
    for precision, (tf, ratios) in summary.items():
        print(f"summary cuBLASLt {precision} 4096² nt: {tf:.1f} TFLOP/s"
              + "".join(f", {v:.2f}x {k}" for k, v in ratios.items()))
    lib.close()


if __name__ == "__main__":
    main()
