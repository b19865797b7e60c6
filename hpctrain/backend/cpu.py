"""CPU backend: matrix products through numpy's BLAS, everything else ``numba.njit``.

Shape letters: B batch rows, C features (channels), K reduction size,
M/N output rows/columns of a product. All arrays are float32 and C-contiguous
unless a docstring says otherwise (targets are int64). Kernels that produce a
gradient take ``accumulate``: False overwrites, True adds (micro-batches).
Compiled kernels are cached on disk (``cache=True``) so a second run does not
recompile.
"""

from __future__ import annotations

import math

import numba
import numpy as np

from .base import Backend, DecayRuns
from .blas import Sgemm
from .dropout_mask import GOLDEN, MUL1, MUL2, keep_scale, threshold
from .cpu_transformer import TransformerKernels

__all__ = ["CpuBackend"]

# error_model="numpy": a division by zero gives inf/nan (caught by the non-finite checks) instead of
# raising, which is what lets LLVM vectorise the loops (the Adam update runs ~7x faster:
# bench/cpu_adam_variants.py)
_jit = numba.njit(cache=True, nogil=True, error_model="numpy")
# reductions may reassociate their sums so they vectorise; the result is still deterministic
_jit_reduce = numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc"})
_SQRT_HALF = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327


# --------------------------------------------------------------------------- bias


@_jit
def _bias_add(y, bias):
    B, C = y.shape
    for i in range(B):
        for j in range(C):
            y[i, j] += bias[j]


@_jit
def _bias_grad(dout, dbias, accumulate):
    B, C = dout.shape
    acc = np.zeros(C, dtype=np.float64)
    for i in range(B):
        for j in range(C):
            acc[j] += dout[i, j]
    for j in range(C):
        dbias[j] = (dbias[j] + acc[j]) if accumulate else acc[j]


@_jit
def _add_inplace(out, x):
    o = out.ravel()
    v = x.ravel()
    for i in range(o.size):
        o[i] += v[i]


# --------------------------------------------------------------------------- dropout (dropout_mask.py)

_GOLDEN, _MUL1, _MUL2 = np.uint64(GOLDEN), np.uint64(MUL1), np.uint64(MUL2)
_S27, _S30, _S31, _S32 = np.uint64(27), np.uint64(30), np.uint64(31), np.uint64(32)
_ONE64, _LOW32, _S5 = np.uint64(1), np.uint64(0xFFFFFFFF), np.uint64(5)


@_jit
def _dropout(x, out, key, cut, scale, row0, group, stride, causal):
    """out[r, c] = x[r, c] · (scale if the draw of index = global row · W + c is >= cut else 0): one mix64 of
    key ^ (index >> 1) for two neighbouring indices, the even one's draw its high 32 bits, the odd one's the low
    (dropout_mask.py); causal: out = 0 for c > r mod W, nothing drawn."""
    R, W = x.shape
    zero = np.float32(0.0)
    factor = np.empty(W, np.float32)  # a row's factors first: that loop, free of x and out (which may be one
    for r in range(R):                # array), has no branch and vectorises, 3-4x faster than one loop
        base = np.uint64(row0 + (r // group) * stride + r % group) * np.uint64(W)
        n = r % W + 1 if causal else W
        for c in range(n):  # each element hashes its pair again, so that no iteration depends on another
            index = base + np.uint64(c)
            z = (key ^ (index >> _ONE64)) + _GOLDEN
            z = (z ^ (z >> _S30)) * _MUL1
            z = (z ^ (z >> _S27)) * _MUL2
            z = z ^ (z >> _S31)
            draw = (z >> ((_ONE64 - (index & _ONE64)) << _S5)) & _LOW32  # even: the high half, odd: the low
            factor[c] = scale * np.float32(draw >= cut)
        for c in range(n):
            out[r, c] = x[r, c] * factor[c]
        for c in range(n, W):
            out[r, c] = zero


# --------------------------------------------------------------------------- activations


@_jit
def _relu_forward(x, out):
    xs, o = x.ravel(), out.ravel()
    for i in range(xs.size):
        o[i] = np.float32(0.0) if xs[i] <= 0 else xs[i]  # NaN passes through, as in torch


@_jit
def _relu_backward(x, dout, dinp):
    xs, d, di = x.ravel(), dout.ravel(), dinp.ravel()
    for i in range(xs.size):
        di[i] = d[i] if xs[i] > 0 else np.float32(0.0)


# The GELU's erf by Abramowitz & Stegun 7.1.26 (|error| <= 1.5e-7), the formula of torch's vectorised
# CPU erf, so GELU matches torch.nn.GELU on the CPU. Its exp(-x²/2) comes from numpy's SIMD exp,
# written into the output array first; the loops below then vectorise (fast math inside them only).
_jit_fast = numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"contract", "afn", "nsz", "arcp"})
_ERF_P, _ERF_A = 0.3275911, (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


@numba.njit(inline="always", cache=True)
def _gelu_cdf(v, e):
    """Φ(v) = (1 + erf(v/√2)) / 2 of float32 v, given e = exp(-v²/2)."""
    f32 = np.float32
    t = f32(1.0) / (f32(1.0) + f32(_ERF_P * _SQRT_HALF) * abs(v))
    poly = t * (f32(_ERF_A[0]) + t * (f32(_ERF_A[1]) + t * (f32(_ERF_A[2]) + t * (f32(_ERF_A[3])
                                                                                + t * f32(_ERF_A[4])))))
    erf = f32(1.0) - poly * e
    return f32(0.5) * (f32(1.0) + (erf if v >= 0 else -erf))


@_jit_fast
def _gelu_forward_from_exp(x, out):
    """out = x · Φ(x), where out holds exp(-x²/2) on entry."""
    xs, o = x.ravel(), out.ravel()
    for i in range(xs.size):
        o[i] = xs[i] * _gelu_cdf(xs[i], o[i])


@_jit_fast
def _gelu_backward_from_exp(x, dout, dinp):
    """dinp = dout · (Φ(x) + x·φ(x)), where dinp holds exp(-x²/2) on entry."""
    xs, d, di = x.ravel(), dout.ravel(), dinp.ravel()
    for i in range(xs.size):
        e = di[i]
        di[i] = d[i] * (_gelu_cdf(xs[i], e) + xs[i] * np.float32(_INV_SQRT_2PI) * e)


def _exp_neg_half_square(x, out):
    np.multiply(x, x, out=out)
    out *= np.float32(-0.5)
    np.exp(out, out=out)


def _gelu_forward(x, out):
    _exp_neg_half_square(x, out)
    _gelu_forward_from_exp(x, out)


def _gelu_backward(x, dout, dinp):
    _exp_neg_half_square(x, dinp)
    _gelu_backward_from_exp(x, dout, dinp)


@_jit
def _tanh_forward(x, out):
    xs, o = x.ravel(), out.ravel()
    for i in range(xs.size):
        o[i] = math.tanh(xs[i])


@_jit
def _tanh_backward(y, dout, dinp):
    ys, d, di = y.ravel(), dout.ravel(), dinp.ravel()
    for i in range(ys.size):
        di[i] = d[i] * (1.0 - ys[i] * ys[i])


# --------------------------------------------------------------------------- layernorm


@_jit_reduce
def _layernorm_forward(x, weight, bias, eps, out, mean, rstd):
    B, C = x.shape
    for i in range(B):
        m = 0.0
        for j in range(C):
            m += x[i, j]
        m /= C
        v = 0.0
        for j in range(C):
            d = x[i, j] - m
            v += d * d
        v /= C
        s = 1.0 / math.sqrt(v + eps)
        for j in range(C):
            out[i, j] = (x[i, j] - m) * s * weight[j] + bias[j]
        mean[i] = m
        rstd[i] = s


@_jit_reduce
def _layernorm_backward(dout, x, weight, mean, rstd, dinp, dweight, dbias, accumulate):
    B, C = x.shape
    dw = np.zeros(C, dtype=np.float64)
    db = np.zeros(C, dtype=np.float64)
    for i in range(B):
        m = np.float64(mean[i])
        s = np.float64(rstd[i])
        # dnorm = dout * weight; dx = s * (dnorm - mean(dnorm) - norm * mean(dnorm * norm))
        sum_dn = 0.0
        sum_dn_n = 0.0
        for j in range(C):
            n = (x[i, j] - m) * s
            dn = np.float64(dout[i, j]) * weight[j]
            sum_dn += dn
            sum_dn_n += dn * n
            dw[j] += dout[i, j] * n
            db[j] += dout[i, j]
        sum_dn /= C
        sum_dn_n /= C
        for j in range(C):
            n = (x[i, j] - m) * s
            dn = np.float64(dout[i, j]) * weight[j]
            dinp[i, j] = s * (dn - sum_dn - n * sum_dn_n)
    for j in range(C):
        dweight[j] = (dweight[j] + dw[j]) if accumulate else dw[j]
        dbias[j] = (dbias[j] + db[j]) if accumulate else db[j]


# --------------------------------------------------------------------------- losses


@_jit
def _cross_entropy(logits, targets, dlogits, grad_scale):
    """Softmax cross-entropy per row; returns (sum of losses, number correct, bad target or -1)."""
    B, C = logits.shape
    total = 0.0
    correct = 0
    for i in range(B):
        t = targets[i]
        if t < 0 or t >= C:
            return total, correct, i
        mx = np.float64(logits[i, 0])
        arg = 0
        for j in range(1, C):
            if logits[i, j] > mx:
                mx = np.float64(logits[i, j])
                arg = j
        z = 0.0
        for j in range(C):
            z += math.exp(logits[i, j] - mx)
        logz = math.log(z) + mx
        total += logz - logits[i, t]
        if arg == t:
            correct += 1
        for j in range(C):
            p = math.exp(logits[i, j] - logz)
            dlogits[i, j] = (p - (1.0 if j == t else 0.0)) * grad_scale
    return total, correct, -1


@_jit
def _ce_shard_stats(logits, targets, lo, mx, arg, tlogit):
    """Per row of a block of columns [lo, lo + V): its max, its first argmax (a column of the whole logits) and
    the target's logit when the target is one of its columns (else 0)."""
    B, V = logits.shape
    for i in range(B):
        m = logits[i, 0]
        a = 0
        for j in range(1, V):
            if logits[i, j] > m:
                m = logits[i, j]
                a = j
        mx[i], arg[i] = m, lo + a
        u = targets[i] - lo
        tlogit[i] = logits[i, u] if 0 <= u < V else 0.0


@_jit
def _ce_shard_sumexp(logits, mx, sumexp):
    """sumexp[i] = Σ_j exp(logits[i, j] − mx[i]) in float64 (mx: the row's max over every column)."""
    B, V = logits.shape
    for i in range(B):
        m = np.float64(mx[i])
        z = 0.0
        for j in range(V):
            z += math.exp(logits[i, j] - m)
        sumexp[i] = z


@_jit
def _ce_shard_grad(logits, targets, lo, logz, dlogits, grad_scale):
    """dlogits = (softmax − onehot)·grad_scale on a block of columns [lo, lo + V), from each row's log Z."""
    B, V = logits.shape
    for i in range(B):
        u = targets[i] - lo
        for j in range(V):
            p = math.exp(logits[i, j] - logz[i])
            dlogits[i, j] = (p - (1.0 if j == u else 0.0)) * grad_scale


@_jit
def _mse(pred, target, dpred, grad_scale):
    p, t, d = pred.ravel(), target.ravel(), dpred.ravel()
    total = 0.0
    for i in range(p.size):
        diff = np.float64(p[i]) - t[i]
        total += diff * diff
        d[i] = 2.0 * diff * grad_scale
    return total


# --------------------------------------------------------------------------- flat buffers


@_jit_reduce
def _sum_squares(x):
    acc = 0.0
    for i in range(x.size):
        v = np.float64(x[i])
        acc += v * v
    return acc


@_jit
def _scale(x, s):
    for i in range(x.size):
        x[i] *= s


# The updates run in float32 like torch.optim's, with the branches hoisted out of the loops so
# that LLVM vectorises them.


@_jit
def _sgd_plain(p, g, gs, lr, weight_decay):
    for i in range(p.size):
        p[i] -= lr * (g[i] * gs + weight_decay * p[i])


@_jit
def _sgd_momentum(p, g, gs, buf, lr, momentum, weight_decay, nesterov):
    if nesterov:
        for i in range(p.size):
            d = g[i] * gs + weight_decay * p[i]
            b = momentum * buf[i] + d
            buf[i] = b
            p[i] -= lr * (d + momentum * b)
    else:
        for i in range(p.size):
            b = momentum * buf[i] + (g[i] * gs + weight_decay * p[i])
            buf[i] = b
            p[i] -= lr * b


@_jit
def _adam_update(p, g, gs, m, v, step_size, beta1, beta2, omb1, omb2, bc2_sqrt, eps, l2, keep):
    """keep = 1 − lr·wd for AdamW (decoupled), 1 for Adam; l2 = wd for Adam, 0 for AdamW; omb1, omb2 =
    1 − β1, 1 − β2 computed in float64 (torch.optim's Python floats): in float32, 1 − 0.99999 is 0.1% off;
    gs: the clipping factor, applied to each gradient as it is read (the same product scale_ would store)."""
    for i in range(p.size):
        w = p[i] * keep
        d = g[i] * gs + l2 * p[i]
        mi = beta1 * m[i] + omb1 * d
        vi = beta2 * v[i] + omb2 * d * d
        m[i] = mi
        v[i] = vi
        p[i] = w - step_size * mi / (np.sqrt(vi) / bc2_sqrt + eps)


class CpuBackend(TransformerKernels, Backend):
    """Arrays are numpy arrays in host memory."""

    name = "cpu"
    is_device = False

    def __init__(self):
        # out += aᵀ·b inside the GEMM where numpy's BLAS allows it (backend/blas.py); None: a temporary and an add
        self._sgemm = Sgemm.find()

    # -- memory
    def empty(self, shape, dtype=np.float32):
        return np.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype=np.float32):
        return np.zeros(shape, dtype=dtype)

    def asarray(self, host):
        return np.ascontiguousarray(host)

    def to_host(self, arr):
        return np.asarray(arr)

    def copy_(self, dst, src):
        np.copyto(dst, src)

    def synchronize(self):
        pass

    # -- matrix products (X·Wᵀ, dY·W, dYᵀ·X)
    def matmul_nt(self, a, b, out, bias=None):
        """out[M,N] = a[M,K] @ b[N,K]ᵀ (+ bias[N]): the Linear forward."""
        self._matmul_args("matmul_nt", a, b, out, bias)
        np.matmul(a, b.T, out=out)
        if bias is not None:
            _bias_add(out, bias)

    def matmul_nn(self, a, b, out):
        """out[M,N] = a[M,K] @ b[K,N]: the Linear input gradient dY·W."""
        self._matmul_args("matmul_nn", a, b, out)
        np.matmul(a, b, out=out)

    def matmul_tn(self, a, b, out, accumulate=False):
        """out[M,N] (+)= a[K,M]ᵀ @ b[K,N]: the Linear weight gradient dYᵀ·X."""
        self._matmul_args("matmul_tn", a, b, out)
        if accumulate and self._sgemm is not None:
            self._sgemm.tn_accumulate(a, b, out)
        elif accumulate:
            _add_inplace(out, a.T @ b)
        else:
            np.matmul(a.T, b, out=out)

    def bias_grad(self, dout, dbias, accumulate=False):
        self._bias_grad_args(dout, dbias)
        _bias_grad(dout, dbias, accumulate)

    # -- activations
    def relu_forward(self, x, out):
        self._unary_args("relu_forward", x, out)
        _relu_forward(x, out)

    def relu_backward(self, x, dout, dinp):
        self._check_same("relu_backward", x=x, dout=dout, dinp=dinp)
        _relu_backward(x, dout, dinp)

    def gelu_forward(self, x, out):
        self._unary_args("gelu_forward", x, out)
        _gelu_forward(x, out)

    def gelu_backward(self, x, dout, dinp):
        self._check_same("gelu_backward", x=x, dout=dout, dinp=dinp)
        _gelu_backward(x, dout, dinp)

    def tanh_forward(self, x, out):
        self._unary_args("tanh_forward", x, out)
        _tanh_forward(x, out)

    def tanh_backward(self, y, dout, dinp):
        self._check_same("tanh_backward", y=y, dout=dout, dinp=dinp)
        _tanh_backward(y, dout, dinp)

    # -- layernorm
    def layernorm_forward(self, x, weight, bias, eps, out, mean, rstd):
        self._layernorm_forward_args(x, weight, bias, out, mean, rstd)
        _layernorm_forward(x, weight, bias, float(eps), out, mean, rstd)

    def layernorm_backward(self, dout, x, weight, mean, rstd, dinp, dweight, dbias, accumulate=False):
        self._layernorm_backward_args(dout, x, weight, mean, rstd, dinp, dweight, dbias)
        _layernorm_backward(dout, x, weight, mean, rstd, dinp, dweight, dbias, accumulate)

    # -- residual connections
    def add_(self, out, x):
        """out += x (same shapes): a residual connection and its gradient."""
        self._check_same("add_", out=out, x=x)
        _add_inplace(out, x)

    def dropout(self, x, out, rows):
        """out[R, W] = x with the elements ``rows`` (a DropRows) draws dropped and the rest scaled by 1/(1 − p);
        out may be x. The same call on the gradient is the backward pass (dropout_mask.py)."""
        R, W = self._dropout_args(x, out, rows)
        group = rows.group or max(R, 1)
        _dropout(x, out, np.uint64(rows.key), np.uint64(threshold(rows.p)), keep_scale(rows.p), rows.row0, group,
                 rows.stride or group, bool(rows.causal))

    # -- losses
    def cross_entropy(self, logits, targets, dlogits, grad_scale, *, into=None):
        B, C = self._cross_entropy_args(logits, targets, dlogits)
        self._into_arg("cross_entropy", into, 3)
        total, correct, bad = _cross_entropy(logits, targets, dlogits, float(grad_scale))
        if bad >= 0:
            self.bad_target(targets, bad, C)
        if into is not None:
            into[:] = float(total), int(correct), B
            return None
        return float(total), int(correct)

    def ce_shard_stats(self, logits, targets, mx, arg, tlogit, *, vocab_start, vocab):
        """Vocab-parallel cross-entropy, pass 1, on logits[B, V] holding columns [vocab_start, +V) of ``vocab``:
        mx[B] (float32) each row's max, arg[B] (int64) its first argmax as a column of the whole logits,
        tlogit[B] (float32) the target's logit where this block holds the target, else 0."""
        B, V, lo = self._vocab_shard_args("ce_shard_stats", logits, targets, vocab_start, vocab,
                                          mx=(mx, np.float32), arg=(arg, np.int64), tlogit=(tlogit, np.float32))
        if B and V:
            _ce_shard_stats(logits, targets, lo, mx, arg, tlogit)

    def ce_shard_sumexp(self, logits, mx, sumexp):
        """Pass 2: sumexp[B] (float64) = Σ_j exp(logits[i, j] − mx[i]), mx the max over every rank's columns."""
        self._ce_sumexp_args(logits, mx, sumexp)
        _ce_shard_sumexp(logits, mx, sumexp)

    def ce_shard_grad(self, logits, targets, logz, dlogits, grad_scale, *, vocab_start, vocab):
        """Pass 3: dlogits[B, V] = (exp(logits − logz) − onehot(target))·grad_scale on this block of columns;
        logz[B] (float64) = log Σ over every column, the row's log-partition."""
        B, V, lo = self._vocab_shard_args("ce_shard_grad", logits, targets, vocab_start, vocab,
                                          logz=(logz, np.float64))
        self._arg("ce_shard_grad", "dlogits", dlogits, shape=(B, V))
        _ce_shard_grad(logits, targets, lo, logz, dlogits, float(grad_scale))

    def mse(self, pred, target, dpred, grad_scale, *, into=None):
        self._mse_args(pred, target, dpred)
        self._into_arg("mse", into, 3)
        total = float(_mse(pred, target, dpred, float(grad_scale)))
        if into is None:
            return total
        into[0] = total  # a loss row [sum, correct, bad row] of which mse writes the sum

    # -- flat buffers
    def sum_squares(self, x, *, into=None):
        self._into_arg("sum_squares", into, 1)
        total = float(_sum_squares(self._arg("sum_squares", "x", x, ndim=1)))
        if into is None:
            return total
        into[0] = total

    def scale_(self, x, s):
        _scale(self._arg("scale_", "x", x, ndim=1), np.float32(s))

    def fill_(self, x, value):
        self._arg("fill_", "x", x, dtype=x.dtype).fill(value)

    def sgd_update(self, param, grad, momentum_buf, *, lr, momentum, weight_decay, nesterov, grad_scale=1.0):
        self._check_flat("sgd_update", param=param, grad=grad, momentum_buf=momentum_buf)
        self._check_decay("sgd_update", weight_decay, param.shape[0])
        if isinstance(weight_decay, DecayRuns):  # run by run: a call costs microseconds here, not a launch
            for lo, hi, d in weight_decay.runs:
                self.sgd_update(param[lo:hi], grad[lo:hi], momentum_buf[lo:hi], lr=lr, momentum=momentum,
                                weight_decay=d, nesterov=nesterov, grad_scale=grad_scale)
            return
        f32 = np.float32
        if momentum == 0:
            _sgd_plain(param, grad, f32(grad_scale), f32(lr), f32(weight_decay))
        else:
            _sgd_momentum(param, grad, f32(grad_scale), momentum_buf, f32(lr), f32(momentum), f32(weight_decay),
                          bool(nesterov))

    def adam_update(self, param, grad, exp_avg, exp_avg_sq, *, lr, beta1, beta2, eps, weight_decay, step, decoupled,
                    grad_scale=1.0):
        self._check_flat("adam_update", param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
        self._check_decay("adam_update", weight_decay, param.shape[0])
        if isinstance(weight_decay, DecayRuns):
            for lo, hi, d in weight_decay.runs:
                self.adam_update(param[lo:hi], grad[lo:hi], exp_avg[lo:hi], exp_avg_sq[lo:hi], lr=lr, beta1=beta1,
                                 beta2=beta2, eps=eps, weight_decay=d, step=step, decoupled=decoupled,
                                 grad_scale=grad_scale)
            return
        f32 = np.float32
        step_size = lr / (1.0 - beta1**step)
        bc2_sqrt = math.sqrt(1.0 - beta2**step)
        keep, l2 = (1.0 - lr * weight_decay, 0.0) if decoupled else (1.0, weight_decay)
        _adam_update(param, grad, f32(grad_scale), exp_avg, exp_avg_sq, f32(step_size), f32(beta1), f32(beta2),
                     f32(1.0 - beta1), f32(1.0 - beta2), f32(bc2_sqrt), f32(eps), f32(l2), f32(keep))
