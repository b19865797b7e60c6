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


def kept_qkv_backward(be, rng, B=2, T=5, H=2, hs=3):
    """Math attention's dqkv on ``be`` from the q, k, v it keeps (``product_input``) and from the float32 qkv they
    were rounded from, after one forward: (the kept's, the float32's) on the host; and the forward's arrays."""
    C = H * hs
    qkv, dout = be.asarray(rand(rng, B * T, 3 * C)), be.asarray(rand(rng, B * T, C))
    out, att = be.empty((B * T, C)), be.empty((B, H, T, T))
    be.attention_forward(qkv, T, H, out, att)
    got, want = be.empty((B * T, 3 * C)), be.empty((B * T, 3 * C))
    be.attention_backward(dout, be.product_input(qkv), att, T, H, got)
    be.attention_backward(dout, qkv, att, T, H, want)
    return be.to_host(got), be.to_host(want), (qkv, out, att)
