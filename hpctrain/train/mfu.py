"""Model FLOPs utilisation (MFU): the model's training FLOPs a second against what the hardware can do.

    per_sample = spec.training_flops()                       # nn/: nanoGPT's estimate_mfu for the GPT
    peak = Peak.of(backend, cfg.train.peak_tflops, "fp32")   # the device's table entry, or a measured CPU peak
    mfu = samples_per_s * per_sample / (world_size * peak.flops)

MFU counts the model's FLOPs, not the hardware's: a recomputed forward (``train.recompute``) and the
pipeline's bubble cost time without adding to it, as in nanoGPT and Megatron. Every rank is assumed to
have the same peak (one GPU per rank, or a CPU rank's share of its node's cores).

Peaks are dense (no structured sparsity), per precision: "fp32" is the CUDA cores' rate (hpctrain's
GEMM today), "tf32" and "bf16" the tensor cores'. On the CPU the peak is measured: the best of a few
float32 products of 1024 x 1024 through numpy's BLAS, on the threads this rank was given; it is an
estimate of this rank's share of the node, not a datasheet figure. ``train.peak_tflops`` overrides both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

__all__ = ["DEVICE_PEAK_TFLOPS", "Peak", "device_peak", "measured_cpu_peak"]

# (what the device's name contains, {precision: dense TFLOP/s}), the first match wins: a more specific name
# before the family it belongs to. Figures from NVIDIA's datasheets (SXM boards unless named).
DEVICE_PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"fp32": 51.2, "tf32": 378.0, "bf16": 756.0}),
    ("H100 NVL", {"fp32": 60.0, "tf32": 417.5, "bf16": 835.5}),
    ("GH200", {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4}),
    ("H100", {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4}),
    ("H200", {"fp32": 66.9, "tf32": 494.7, "bf16": 989.4}),
    ("A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0}),
    ("L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.0}),
    ("A10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0}),
    ("V100", {"fp32": 15.7}),
)


def device_peak(name: str, precision: str = "fp32") -> float | None:
    """Dense TFLOP/s of a GPU named ``name`` at ``precision``, or None when the table does not know it."""
    for pattern, figures in DEVICE_PEAK_TFLOPS:
        if pattern.lower() in name.lower():
            return figures.get(precision)
    return None


def measured_cpu_peak(n: int = 1024, repeats: int = 3) -> float:
    """TFLOP/s of the best of ``repeats`` float32 n x n products on this process's BLAS threads."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    out = np.empty((n, n), dtype=np.float32)
    np.matmul(a, b, out=out)  # BLAS's threads started and its buffers allocated before the clock runs
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best / 1e12


@dataclass(frozen=True)
class Peak:
    """One rank's peak FLOP/s and where the figure came from (for the start-up line)."""

    flops: float  # FLOP/s; 0 when unknown (MFU is then not reported)
    source: str

    @classmethod
    def of(cls, backend, override_tflops: float = 0.0, precision: str = "fp32") -> "Peak":
        if override_tflops > 0:
            return cls(override_tflops * 1e12, "train.peak_tflops")
        if not backend.is_device:
            return cls(measured_cpu_peak() * 1e12, "measured: float32 1024² products through numpy's BLAS")
        name = _device_name(backend)
        if not name:
            return cls(0.0, "the device's name is unknown: no MFU (set train.peak_tflops)")
        tflops = device_peak(name, precision)
        if tflops is None:
            return cls(0.0, f"unknown device {name!r}: no MFU (set train.peak_tflops)")
        return cls(tflops * 1e12, f"{name}, {precision} datasheet peak")

    def mfu(self, samples_per_s: float, flops_per_sample: float, ranks: int) -> float | None:
        """The fraction of ``ranks`` such peaks that ``samples_per_s`` samples of ``flops_per_sample`` use."""
        if self.flops <= 0 or flops_per_sample <= 0 or ranks <= 0:
            return None
        return samples_per_s * flops_per_sample / (ranks * self.flops)


def _device_name(backend) -> str:
    """The name of the GPU ``backend`` runs on ("" when it cannot say): a figure for the log is no reason to stop
    a run, and only the logging rank asks, so nothing here may raise."""
    try:
        from numba import cuda

        name = cuda.get_current_device().name
    except Exception:  # noqa: BLE001 - no driver (a test's fake device), or a context not made yet
        return ""
    return name.decode() if isinstance(name, bytes) else str(name)
