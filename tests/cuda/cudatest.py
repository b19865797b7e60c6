"""Shared bits of the CUDA tests: the simulator flag, the GPU-only marker, tolerances, random arrays."""

import numpy as np
import pytest

from hpctrain.backend.cuda import simulator

SIM = simulator()
F32 = dict(rtol=1e-5, atol=1e-5)  # float32 kernels against float64 references
AGREE = dict(rtol=2e-6, atol=2e-6)  # CUDA against CPU backend, both float32


def needs_gpu(reason):
    """Mark a test that the simulator cannot run, saying why (never a silent skip)."""
    return pytest.mark.skipif(SIM, reason=f"needs a real GPU: {reason}")


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)
