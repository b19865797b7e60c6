"""Optimizer kernels on the GPU: torch.optim.SGD and Adam/AdamW as one fused kernel over a flat buffer (also
with per-run weight decay), the sum of squares (the gradient norm²) and the in-place scale.

Shape letter n: elements of the flat buffer; grid-stride loops. The update arithmetic is float32, the bias
corrections float64 on the host as the CPU backend's (cpu/optim.py); the sum of squares accumulates in float64.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np
from numba import cuda, float32, float64

from ..base import DecayRuns
from . import blocks

__all__ = ["kernels", "Optim"]


@functools.cache
def kernels(nt: int) -> SimpleNamespace:
    """The optimizer kernels for blocks of ``nt`` threads; compiled lazily, once per process."""
    return SimpleNamespace(**vars(_update_kernels(nt)), **vars(_flat_kernels(nt)))


# the update's arithmetic per element, shared by the one-decay and the per-run kernels below


@cuda.jit(device=True)
def sgd_at(p, g, gs, buf, i, lr, momentum, weight_decay, use_momentum, nesterov):
    """Element i of torch.optim.SGD (dampening 0): d = gs·g + wd·p; b = μ·b + d; p −= lr·(d + μ·b | b | d)."""
    d = g[i] * gs + weight_decay * p[i]
    if use_momentum:
        b = momentum * buf[i] + d
        buf[i] = b
        if nesterov:
            d = d + momentum * b
        else:
            d = b
    p[i] -= lr * d


@cuda.jit(device=True)
def adam_at(p, g, gs, m, v, i, step_size, beta1, beta2, omb1, omb2, bc2_sqrt, eps, l2, keep):
    """Element i of torch.optim.Adam/AdamW; keep = 1 − lr·wd (AdamW) or 1, l2 = wd (Adam) or 0."""
    w = p[i]
    d = g[i] * gs + l2 * w
    mi = beta1 * m[i] + omb1 * d
    vi = beta2 * v[i] + omb2 * d * d
    m[i] = mi
    v[i] = vi
    p[i] = w * keep - step_size * mi / (math.sqrt(vi) / bc2_sqrt + eps)


@cuda.jit(device=True)
def decayed_at(starts, decayed, i):
    """Whether element i lies in a decayed run (the last run starting at or before i)."""
    lo = 0
    hi = starts.size - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if starts[mid] <= i:
            lo = mid
        else:
            hi = mid - 1
    return decayed[lo] != 0


@functools.cache
def _update_kernels(nt: int) -> SimpleNamespace:
    """torch.optim.SGD and Adam/AdamW over flat [n], with one weight decay or per run."""
    kernel = blocks.kernel_decorator(nt)

    # the step's values (the clipping factor, the learning rate and what it and the step number give) are read
    # from a float32 device array ``h``, not passed by value: the launch is then the same every step, what a CUDA
    # graph replays (issue 49 item 2). SGD's h: gs, lr, momentum, weight decay; Adam's: gs, step size, β1, β2,
    # 1 − β1, 1 − β2, sqrt(1 − β2^t), eps, l2, keep (Optim._step_values); last of both: 1 when the step is
    # skipped (written on the device by ``gate_step`` from the gradient norm: train/step.py's deferred reads)

    @kernel
    def sgd_update(p, g, buf, h, use_momentum, nesterov):
        """torch.optim.SGD over flat [n]; gs the clipping factor, applied as the gradients are read."""
        if h[h.size - 1] != 0:
            return
        gs, lr, momentum, weight_decay = h[0], h[1], h[2], h[3]
        for i in range(cuda.grid(1), p.size, cuda.gridsize(1)):
            sgd_at(p, g, gs, buf, i, lr, momentum, weight_decay, use_momentum, nesterov)

    @kernel
    def adam_update(p, g, m, v, h):
        """torch.optim.Adam/AdamW over flat [n]; omb1, omb2 = 1 − β1, 1 − β2, computed in float64 on the host as
        torch.optim does; gs the clipping factor."""
        if h[h.size - 1] != 0:
            return
        gs, step_size, beta1, beta2, omb1, omb2, bc2_sqrt, eps, l2, keep = (h[0], h[1], h[2], h[3], h[4], h[5], h[6],
                                                                            h[7], h[8], h[9])
        for i in range(cuda.grid(1), p.size, cuda.gridsize(1)):
            adam_at(p, g, gs, m, v, i, step_size, beta1, beta2, omb1, omb2, bc2_sqrt, eps, l2, keep)

    # one launch for a slice whose tensors take two weight decays (optim.decay_runs: weight matrices decayed,
    # biases and LayerNorm weights not): ``starts`` the runs' first elements (ascending, starts[0] = 0),
    # ``decayed[r]`` 1 where run r takes the decay; per element the arithmetic of the one-run kernels above

    @kernel
    def sgd_update_runs(p, g, buf, starts, decayed, h, use_momentum, nesterov):
        """sgd_update with the weight decay on the decayed runs and 0 elsewhere."""
        if h[h.size - 1] != 0:
            return
        gs, lr, momentum, weight_decay = h[0], h[1], h[2], h[3]
        for i in range(cuda.grid(1), p.size, cuda.gridsize(1)):
            wd = weight_decay if decayed_at(starts, decayed, i) else float32(0.0)
            sgd_at(p, g, gs, buf, i, lr, momentum, wd, use_momentum, nesterov)

    @kernel
    def adam_update_runs(p, g, m, v, starts, decayed, h):
        """adam_update with ``l2`` and ``keep`` on the decayed runs, 0 and 1 elsewhere."""
        if h[h.size - 1] != 0:
            return
        gs, step_size, beta1, beta2, omb1, omb2, bc2_sqrt, eps, l2, keep = (h[0], h[1], h[2], h[3], h[4], h[5], h[6],
                                                                            h[7], h[8], h[9])
        for i in range(cuda.grid(1), p.size, cuda.gridsize(1)):
            on = decayed_at(starts, decayed, i)
            adam_at(p, g, gs, m, v, i, step_size, beta1, beta2, omb1, omb2, bc2_sqrt, eps,
                    l2 if on else float32(0.0), keep if on else float32(1.0))

    return SimpleNamespace(sgd_update=sgd_update, adam_update=adam_update, sgd_update_runs=sgd_update_runs,
                           adam_update_runs=adam_update_runs, **vars(_gate_kernels()))


# The gradient norm's consequences decided on the device (train/step.py, when the step's values are read one
# step late): gate = [norm, clipping factor, skip], skip 1 for a non-finite norm, 2 for a finite one so large that
# the update could overflow the optimizer's float32 state (Optimizer.SAFE_NORM); the arithmetic of the host's
# path (train/step.py's _finish, optim.clip_coefficient) in the same float64 order, so both give the same bits.

@functools.cache
def _gate_kernels() -> SimpleNamespace:
    @cuda.jit
    def clip_decide(pieces, max_norm, safe_norm, gate):
        """gate[:3] = norm, clipping factor, skip from the norm² pieces (one thread: a few dozen values)."""
        if cuda.grid(1) != 0:
            return
        s = float64(0.0)
        for i in range(pieces.size):
            s += pieces[i]
        norm = math.sqrt(s) if s >= 0 else math.nan
        coef = float64(1.0)
        if max_norm > 0:
            coef = min(1.0, max_norm / (norm + 1e-6))
        skip = float64(0.0)
        if math.isnan(norm) or math.isinf(norm):
            skip = 1.0
        elif norm * coef >= safe_norm:
            skip = 2.0
        gate[0] = norm
        gate[1] = coef
        gate[2] = skip

    @cuda.jit
    def gate_step(h, gate):
        """An update's values ``h`` take the gate's clipping factor (h[0]) and skip flag (h[-1])."""
        if cuda.grid(1) != 0:
            return
        h[0] = float32(gate[1])
        h[h.size - 1] = float32(1.0) if gate[2] != 0 else float32(0.0)

    return SimpleNamespace(clip_decide=clip_decide, gate_step=gate_step)


@functools.cache
def _flat_kernels(nt: int) -> SimpleNamespace:
    """The in-place scale and the sum of squares' per-block partials."""
    NT, kernel = nt, blocks.kernel_decorator(nt)
    block_sum = blocks.block_reducers(nt).block_sum

    @kernel
    def scale(x, s):
        """x[n] *= s."""
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            x[i] *= s

    @kernel
    def sum_squares_partial(x, partial):
        """partial[block] = Σ x² over the block's share of x[n] (float64)."""
        sh = cuda.shared.array(NT, float64)
        acc = float64(0.0)
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            v = float64(x[i])
            acc += v * v
        total = block_sum(sh, acc)
        if cuda.threadIdx.x == 0:
            partial[cuda.blockIdx.x] = total

    return SimpleNamespace(scale=scale, sum_squares_partial=sum_squares_partial)


class Optim:
    """CudaBackend's optimizer steps and flat-buffer reductions (a mixin)."""

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

    def decay_table(self, runs) -> DecayRuns:
        """DecayRuns with the runs' starts and decayed flags uploaded once (the update looks each element's up)."""
        table = DecayRuns(runs)
        starts = np.array([lo for lo, _, _ in table.runs] or [0], dtype=np.int64)
        decayed = np.array([d != 0 for _, _, d in table.runs] or [0], dtype=np.int64)
        table.device = (self.asarray(starts), self.asarray(decayed))
        return table

    def clip_gate(self, pieces, *, max_norm: float, safe_norm: float, into) -> None:
        """``into`` (a float64 device array of 3) = the gradient norm from its float64 pieces² (summed in order),
        the clipping factor for ``max_norm`` (0: none) and the skip decision (0 update, 1 non-finite, 2 too large
        for the optimizer's float32 state: ``safe_norm``), on the device with no wait; an update given
        ``gate=into`` applies them."""
        self._arg("clip_gate", "pieces", pieces, ndim=1, dtype=np.float64)
        self._into_arg("clip_gate", into, 3)
        self._launch(self._k.clip_decide, 1, 1, pieces, float(max_norm), float(safe_norm), into)

    def _gated(self, h, gate):
        """h with the clipping factor and skip flag of ``gate`` (clip_gate's array) written on the device."""
        if gate is not None:
            self._into_arg("gate", gate, 3)
            self._launch(self._k.gate_step, 1, 1, h, gate)
        return h

    def sgd_update(self, param, grad, momentum_buf, *, lr, momentum, weight_decay, nesterov, grad_scale=1.0,
                   gate=None):
        """torch.optim.SGD step over the flat buffers, one fused kernel (momentum_buf unused if momentum = 0);
        ``grad_scale``: the clipping factor, applied as the gradients are read; ``weight_decay`` a number or a
        ``decay_table``; ``gate``: clip_gate's array, whose factor replaces ``grad_scale`` and whose skip
        decision leaves everything as it was."""
        self._check_flat("sgd_update", param=param, grad=grad, momentum_buf=momentum_buf)
        self._check_decay("sgd_update", weight_decay, param.shape[0])
        runs = weight_decay if isinstance(weight_decay, DecayRuns) else None
        h = self._gated(self._step_values(grad_scale, lr, momentum, runs.value if runs is not None else weight_decay),
                        gate)
        flags = bool(momentum != 0), bool(nesterov)
        if runs is not None:
            self._elementwise(self._k.sgd_update_runs, param.size, param, grad, momentum_buf,
                              *self._decay_arrays(runs), h, *flags)
            return
        self._elementwise(self._k.sgd_update, param.size, param, grad, momentum_buf, h, *flags)

    def _decay_arrays(self, table):
        if table.device is None:  # made by another backend's decay_table
            table = self.decay_table(table.runs)
        return table.device

    def adam_update(self, param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step, decoupled,
                    grad_scale=1.0, gate=None):
        """torch.optim.Adam (L2 decay) / AdamW (decoupled decay) step over the flat buffers, one fused kernel;
        ``grad_scale``: the clipping factor, applied as the gradients are read; ``gate`` as sgd_update's."""
        self._check_flat("adam_update", param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
        self._check_decay("adam_update", weight_decay, param.shape[0])
        step_size = lr / (1.0 - beta1**step)  # bias corrections in float64 on the host, as cpu/optim.py does
        bc2_sqrt = math.sqrt(1.0 - beta2**step)
        runs = weight_decay if isinstance(weight_decay, DecayRuns) else None
        wd = runs.value if runs is not None else weight_decay  # the decayed runs' (the others: 0, as one-run calls)
        keep, l2 = (1.0 - lr * wd, 0.0) if decoupled else (1.0, wd)
        h = self._gated(self._step_values(grad_scale, step_size, beta1, beta2, 1.0 - beta1, 1.0 - beta2, bc2_sqrt, eps,
                                          l2, keep), gate)
        if runs is not None:
            self._elementwise(self._k.adam_update_runs, param.size, param, grad, exp_avg, exp_avg_sq,
                              *self._decay_arrays(runs), h)
            return
        self._elementwise(self._k.adam_update, param.size, param, grad, exp_avg, exp_avg_sq, h)

    def _step_values(self, *values):
        """The update's scalars as a float32 device array (each rounded from float64 as it was when passed by
        value), uploaded through page-locked memory without a wait; inside a training step the step arena gives
        it the same address every step. The last value is the skip flag: 0 here (``_gated`` may set it)."""
        return self.upload(np.array(values + (0.0,), dtype=np.float32))
