"""CUDA kernels for everything but the GEMM and the transformer ops (cuda_transformer.py): element-wise,
reductions, LayerNorm, losses, optimizers.

Shape letters: B rows, C features, n elements of a flat buffer. Forward and
backward kernels sit side by side. Three launch shapes, all with ``NT`` threads
per block (a power of two fixed at construction: shared-array shapes must be
compile-time constants):

* element-wise: a grid-stride loop over the flat array, so any grid size covers
  any n (the backend caps the grid; the simulator runs a tiny one);
* row kernels (LayerNorm, cross-entropy): one block per row (grid-stride over
  rows), the block's threads stride over the C columns and combine with a
  shared-memory tree;
* column sums (bias and LayerNorm parameter gradients), in two passes: a grid of
  RX×RY blocks, RX threads on neighbouring columns (coalesced reads) and RY threads
  over the rows of the block's row group, the RY sums combined in shared memory into
  one float64 partial per (row group, column); then one thread per column adds its
  partials in order. Row groups give the grid enough blocks to fill the GPU (the
  backend picks their number); no atomics, so results are deterministic run to run.

Arithmetic is float32 like the arrays (float32 literals keep numba from promoting
to the slow float64 units), except the scalars handed back to the host (loss
sums, the gradient norm) and the column sums, which accumulate in float64 as the
CPU backend's do.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np
from numba import cuda, float32, float64, int64, uint64

from ..errors import BackendError
from . import cuda_sim
from .cuda_blocks import block_reducers
from .dropout_mask import GOLDEN, MUL1, MUL2

__all__ = ["ops_kernels", "reduce_shape"]

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_HALF = np.float32(0.5)
_SQRT_HALF = np.float32(1.0 / math.sqrt(2.0))
_INV_SQRT_2PI = np.float32(1.0 / math.sqrt(2.0 * math.pi))
_NEG_INF = np.float32(-np.inf)
_GOLDEN, _MUL1, _MUL2 = np.uint64(GOLDEN), np.uint64(MUL1), np.uint64(MUL2)
_S27, _S30, _S31, _S32 = np.uint64(27), np.uint64(30), np.uint64(31), np.uint64(32)
_ONE64, _LOW32 = np.uint64(1), np.uint64(0xFFFFFFFF)


def reduce_shape(nt: int) -> tuple[int, int]:
    """(RX, RY) of the column-sum block: a warp of columns on a GPU, a square-ish block when tiny."""
    rx = 32 if nt >= 64 else max(1, nt // 4)
    return rx, nt // rx


@functools.lru_cache(maxsize=None)
def ops_kernels(nt: int) -> SimpleNamespace:
    """Every kernel but the GEMM and the transformer ops, for blocks of ``nt`` threads; compiled lazily, once."""
    if nt < 2 or nt & (nt - 1) or nt > 1024:
        raise BackendError(f"CUDA block size {nt}: must be a power of two between 2 and 1024")
    cuda_sim.install()  # under the simulator: shared arrays that every thread of a block agrees on
    RX, RY = reduce_shape(nt)
    NT = nt
    kernel = cuda_sim.kernel_jit(NT)  # every kernel here is launched with NT threads per block

    # ------------------------------------------------------------------ block reductions

    block_sum, row_argmax = block_reducers(nt).block_sum, block_reducers(nt).row_argmax

    @cuda.jit(device=True)
    def column_sum(sh, v):
        """Sum of ``v`` over threadIdx.y of a RX×RY block (in ``sh``'s dtype); valid in the ty == 0 threads."""
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        sh[ty, tx] = v
        cuda.syncthreads()
        s = RY // 2
        while s > 0:
            if ty < s:
                sh[ty, tx] += sh[ty + s, tx]
            cuda.syncthreads()
            s //= 2
        return sh[0, tx]

    # ------------------------------------------------------------------ memory and flat buffers

    @kernel
    def fill(x, value):
        """x[n] = value (any dtype)."""
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            x[i] = value

    @kernel
    def scale(x, s):
        """x[n] *= s."""
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            x[i] *= s

    @kernel
    def add(out, x):
        """out[n] += x[n] (a residual connection and its gradient)."""
        for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            out[i] += x[i]

    @kernel
    def dropout(x, out, W, key, cut, scale, row0, group, stride, causal):
        """out[n] = x[n] · (scale if the draw of its global index is >= cut else 0) over a flat (R, W) array, row
        r's elements having the indices (row0 + (r // group)·stride + r % group)·W + c; the draw is a half of
        mix64(key ^ (index >> 1)), the high one for an even index; causal: 0 for c > r mod W (dropout_mask.py:
        the CPU backend's and numpy's draw, bit for bit)."""
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            r = i // W
            c = i - r * W
            if causal and c > r % W:
                out[i] = _ZERO
                continue
            index = uint64(row0 + (r // group) * stride + r % group) * uint64(W) + uint64(c)
            z = (key ^ (index >> _ONE64)) + _GOLDEN
            z = (z ^ (z >> _S30)) * _MUL1
            z = (z ^ (z >> _S27)) * _MUL2
            z = z ^ (z >> _S31)
            draw = (z & _LOW32) if index & _ONE64 else (z >> _S32)
            out[i] = x[i] * (scale if draw >= cut else _ZERO)

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

    @kernel
    def sum_partials(partial, out):
        """out[0] = Σ partial (one block)."""
        sh = cuda.shared.array(NT, float64)
        acc = float64(0.0)
        for i in range(cuda.threadIdx.x, partial.size, NT):
            acc += partial[i]
        total = block_sum(sh, acc)
        if cuda.threadIdx.x == 0:
            out[0] = total

    # ------------------------------------------------------------------ bias gradient

    @kernel
    def bias_grad_partials(dout, partial, rows_per):
        """Column sums, pass 1, for dbias: block (bx, by) adds rows [by·rows_per, +rows_per) of its RX columns of
        dout[B, C] in float64: partial[by, col]."""
        sh = cuda.shared.array((RY, RX), float64)
        B, C = dout.shape
        col = cuda.blockIdx.x * RX + cuda.threadIdx.x
        lo = cuda.blockIdx.y * rows_per
        hi = min(B, lo + rows_per)
        acc = float64(0.0)
        if col < C:
            for i in range(lo + cuda.threadIdx.y, hi, RY):
                acc += float64(dout[i, col])
        total = column_sum(sh, acc)
        if cuda.threadIdx.y == 0 and col < C:
            partial[cuda.blockIdx.y, col] = total

    @kernel
    def column_finish(partial, out, accumulate):
        """Column sums, pass 2: out[C] (+)= Σ_g partial[g, C], added in g order in float64 and rounded once
        (deterministic: no atomics, the same order every run)."""
        G, C = partial.shape
        for col in range(cuda.grid(1), C, cuda.gridsize(1)):
            total = float64(0.0)
            for g in range(G):
                total += partial[g, col]
            if accumulate:
                total += float64(out[col])
            out[col] = float32(total)

    # ------------------------------------------------------------------ activations

    @kernel
    def relu_forward(x, out):
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            v = x[i]
            out[i] = _ZERO if v <= _ZERO else v  # NaN passes through, as in torch

    @kernel
    def relu_backward(x, dout, dinp):
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            dinp[i] = dout[i] if x[i] > _ZERO else _ZERO

    @kernel
    def gelu_forward(x, out):
        """Exact GELU: 0.5·x·(1 + erf(x/√2))."""
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            v = x[i]
            out[i] = _HALF * v * (_ONE + math.erf(v * _SQRT_HALF))

    @kernel
    def gelu_backward(x, dout, dinp):
        """dinp = dout·(Φ(x) + x·φ(x))."""
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            v = x[i]
            cdf = _HALF * (_ONE + math.erf(v * _SQRT_HALF))
            pdf = _INV_SQRT_2PI * math.exp(-_HALF * v * v)
            dinp[i] = dout[i] * (cdf + v * pdf)

    @kernel
    def tanh_forward(x, out):
        for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
            out[i] = math.tanh(x[i])

    @kernel
    def tanh_backward(y, dout, dinp):
        """Takes y = tanh(x), as the layer saves it."""
        for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
            v = y[i]
            dinp[i] = dout[i] * (_ONE - v * v)

    # ------------------------------------------------------------------ layernorm

    @kernel
    def layernorm_forward(x, weight, bias, eps, out, mean, rstd):
        """out[B,C] = (x − mean)·rstd·weight + bias per row; saves mean[B], rstd[B] (two-pass variance)."""
        sh = cuda.shared.array(NT, float32)
        B, C = x.shape
        inv_c = _ONE / float32(C)
        t = cuda.threadIdx.x
        for row in range(cuda.blockIdx.x, B, cuda.gridDim.x):
            acc = float32(0.0)
            for j in range(t, C, NT):
                acc += x[row, j]
            m = block_sum(sh, acc) * inv_c
            acc = float32(0.0)
            for j in range(t, C, NT):
                d = x[row, j] - m
                acc += d * d
            r = _ONE / math.sqrt(block_sum(sh, acc) * inv_c + eps)
            for j in range(t, C, NT):
                out[row, j] = (x[row, j] - m) * r * weight[j] + bias[j]
            if t == 0:
                mean[row] = m
                rstd[row] = r

    @kernel
    def layernorm_backward_rows(dout, x, weight, mean, rstd, dinp):
        """dinp = rstd·(dn − mean(dn) − n·mean(dn·n)) with n the normalised x and dn = dout·weight."""
        sh = cuda.shared.array(NT, float32)
        B, C = x.shape
        inv_c = _ONE / float32(C)
        t = cuda.threadIdx.x
        for row in range(cuda.blockIdx.x, B, cuda.gridDim.x):
            m = mean[row]
            r = rstd[row]
            acc_dn = float32(0.0)
            acc_dn_n = float32(0.0)
            for j in range(t, C, NT):
                dn = dout[row, j] * weight[j]
                acc_dn += dn
                acc_dn_n += dn * (x[row, j] - m) * r
            mean_dn = block_sum(sh, acc_dn) * inv_c
            mean_dn_n = block_sum(sh, acc_dn_n) * inv_c
            for j in range(t, C, NT):
                n = (x[row, j] - m) * r
                dinp[row, j] = r * (dout[row, j] * weight[j] - mean_dn - n * mean_dn_n)

    @kernel
    def layernorm_params_partials(dout, x, mean, rstd, partial, rows_per):
        """Column sums, pass 1, for LayerNorm's dweight and dbias: block (bx, by) adds rows [by·rows_per,
        +rows_per) in float64: partial[by, col] = Σ dout·n, partial[G + by, col] = Σ dout (G = gridDim.y)."""
        sh_w = cuda.shared.array((RY, RX), float64)
        sh_b = cuda.shared.array((RY, RX), float64)
        B, C = x.shape
        col = cuda.blockIdx.x * RX + cuda.threadIdx.x
        lo = cuda.blockIdx.y * rows_per
        hi = min(B, lo + rows_per)
        acc_w = float64(0.0)
        acc_b = float64(0.0)
        if col < C:
            for i in range(lo + cuda.threadIdx.y, hi, RY):
                d = dout[i, col]
                acc_w += float64(d * (x[i, col] - mean[i]) * rstd[i])
                acc_b += float64(d)
        total_w = column_sum(sh_w, acc_w)
        total_b = column_sum(sh_b, acc_b)
        if cuda.threadIdx.y == 0 and col < C:
            partial[cuda.blockIdx.y, col] = total_w
            partial[cuda.gridDim.y + cuda.blockIdx.y, col] = total_b

    # ------------------------------------------------------------------ losses

    @kernel
    def cross_entropy_rows(logits, targets, dlogits, grad_scale, row_loss, row_flag):
        """Per row of logits[B,C]: row_loss = logsumexp − logit[target] (float64),
        row_flag = 1 if argmax == target else 0, or −1 for a target outside [0, C);
        dlogits = (softmax − onehot)·grad_scale."""
        sh_max = cuda.shared.array(NT, float32)
        sh_arg = cuda.shared.array(NT, int64)
        sh_sum = cuda.shared.array(NT, float32)
        B, C = logits.shape
        t = cuda.threadIdx.x
        for row in range(cuda.blockIdx.x, B, cuda.gridDim.x):
            target = targets[row]
            mx, arg = row_argmax(sh_max, sh_arg, logits, row)  # max and first argmax, as numpy's argmax
            acc = float32(0.0)
            for j in range(t, C, NT):
                acc += math.exp(logits[row, j] - mx)
            logz = math.log(block_sum(sh_sum, acc)) + mx
            bad = target < 0 or target >= C
            if t == 0:
                if bad:
                    row_loss[row] = 0.0
                    row_flag[row] = -1
                else:
                    row_loss[row] = float64(logz) - float64(logits[row, target])
                    row_flag[row] = 1 if arg == target else 0
            if not bad:
                for j in range(t, C, NT):
                    p = math.exp(logits[row, j] - logz)
                    if j == target:
                        p -= _ONE
                    dlogits[row, j] = p * grad_scale

    # the vocab-parallel cross-entropy's three passes over a block of columns [lo, lo + V) (cpu.py: _ce_shard_*)

    @kernel
    def ce_shard_stats(logits, targets, lo, mx, arg, tlogit):
        """Per row: mx = its max, arg = its first argmax + lo, tlogit = logits[row, target − lo] or 0."""
        sh_max = cuda.shared.array(NT, float32)
        sh_arg = cuda.shared.array(NT, int64)
        B, V = logits.shape
        t = cuda.threadIdx.x
        for row in range(cuda.blockIdx.x, B, cuda.gridDim.x):
            best, best_j = row_argmax(sh_max, sh_arg, logits, row)
            if t == 0:
                mx[row] = best
                arg[row] = best_j + lo
                u = targets[row] - lo
                tlogit[row] = logits[row, u] if u >= 0 and u < V else _ZERO

    @kernel
    def ce_shard_sumexp(logits, mx, sumexp):
        """sumexp[row] = Σ_j exp(logits[row, j] − mx[row]) (float32 sums, stored as float64)."""
        sh_sum = cuda.shared.array(NT, float32)
        B, V = logits.shape
        t = cuda.threadIdx.x
        for row in range(cuda.blockIdx.x, B, cuda.gridDim.x):
            m = mx[row]
            acc = float32(0.0)
            for j in range(t, V, NT):
                acc += math.exp(logits[row, j] - m)
            total = block_sum(sh_sum, acc)
            if t == 0:
                sumexp[row] = float64(total)

    @kernel
    def ce_shard_grad(logits, targets, lo, logz, dlogits, grad_scale):
        """dlogits = (exp(logits − logz[row]) − onehot(target − lo))·grad_scale, element-wise over the block."""
        B, V = logits.shape
        for i in range(cuda.grid(1), B * V, cuda.gridsize(1)):
            row = i // V
            j = i - row * V
            p = math.exp(logits[row, j] - float32(logz[row]))
            if j == targets[row] - lo:
                p -= _ONE
            dlogits[row, j] = p * grad_scale

    @kernel
    def cross_entropy_finish(row_loss, row_flag, out):
        """out = [Σ row_loss, number correct, first row with a bad target (B if none)] (one block)."""
        sh_loss = cuda.shared.array(NT, float64)
        sh_correct = cuda.shared.array(NT, float64)
        sh_bad = cuda.shared.array(NT, int64)
        B = row_loss.size
        t = cuda.threadIdx.x
        loss = float64(0.0)
        correct = float64(0.0)
        bad = int64(B)
        for i in range(t, B, NT):
            loss += row_loss[i]
            f = row_flag[i]
            if f == 1:
                correct += 1.0
            elif f < 0 and i < bad:
                bad = i
        loss = block_sum(sh_loss, loss)
        correct = block_sum(sh_correct, correct)
        sh_bad[t] = bad
        cuda.syncthreads()
        s = NT // 2
        while s > 0:
            if t < s and sh_bad[t + s] < sh_bad[t]:
                sh_bad[t] = sh_bad[t + s]
            cuda.syncthreads()
            s //= 2
        if t == 0:
            out[0] = loss
            out[1] = correct
            out[2] = float64(sh_bad[0])

    @kernel
    def mse_partial(pred, target, dpred, grad_scale, partial):
        """dpred = 2·(pred − target)·grad_scale over flat [n]; partial[block] = Σ (pred − target)²."""
        sh = cuda.shared.array(NT, float64)
        acc = float64(0.0)
        two_scale = float32(2.0) * grad_scale
        for i in range(cuda.grid(1), pred.size, cuda.gridsize(1)):
            diff = pred[i] - target[i]
            dpred[i] = two_scale * diff
            d64 = float64(diff)
            acc += d64 * d64
        total = block_sum(sh, acc)
        if cuda.threadIdx.x == 0:
            partial[cuda.blockIdx.x] = total

    # ------------------------------------------------------------------ optimizers

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

    @kernel
    def sgd_update(p, g, gs, buf, lr, momentum, weight_decay, use_momentum, nesterov):
        """torch.optim.SGD over flat [n]; gs the clipping factor, applied as the gradients are read."""
        for i in range(cuda.grid(1), p.size, cuda.gridsize(1)):
            sgd_at(p, g, gs, buf, i, lr, momentum, weight_decay, use_momentum, nesterov)

    @kernel
    def adam_update(p, g, gs, m, v, step_size, beta1, beta2, omb1, omb2, bc2_sqrt, eps, l2, keep):
        """torch.optim.Adam/AdamW over flat [n]; omb1, omb2 = 1 − β1, 1 − β2, computed in float64 on the host as
        torch.optim does; gs the clipping factor."""
        for i in range(cuda.grid(1), p.size, cuda.gridsize(1)):
            adam_at(p, g, gs, m, v, i, step_size, beta1, beta2, omb1, omb2, bc2_sqrt, eps, l2, keep)

    # one launch for a slice whose tensors take two weight decays (optim.decay_runs: weight matrices decayed,
    # biases and LayerNorm weights not): ``starts`` the runs' first elements (ascending, starts[0] = 0),
    # ``decayed[r]`` 1 where run r takes the decay; per element the arithmetic of the one-run kernels above

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

    @kernel
    def sgd_update_runs(p, g, gs, buf, starts, decayed, lr, momentum, weight_decay, use_momentum, nesterov):
        """sgd_update with ``weight_decay`` on the decayed runs and 0 elsewhere."""
        for i in range(cuda.grid(1), p.size, cuda.gridsize(1)):
            wd = weight_decay if decayed_at(starts, decayed, i) else float32(0.0)
            sgd_at(p, g, gs, buf, i, lr, momentum, wd, use_momentum, nesterov)

    @kernel
    def adam_update_runs(p, g, gs, m, v, starts, decayed, step_size, beta1, beta2, omb1, omb2, bc2_sqrt, eps, l2,
                         keep):
        """adam_update with ``l2`` and ``keep`` on the decayed runs, 0 and 1 elsewhere."""
        for i in range(cuda.grid(1), p.size, cuda.gridsize(1)):
            on = decayed_at(starts, decayed, i)
            adam_at(p, g, gs, m, v, i, step_size, beta1, beta2, omb1, omb2, bc2_sqrt, eps,
                    l2 if on else float32(0.0), keep if on else float32(1.0))

    return SimpleNamespace(
        NT=NT, RX=RX, RY=RY, fill=fill, scale=scale, add=add, dropout=dropout, sum_squares_partial=sum_squares_partial,
        sum_partials=sum_partials, bias_grad_partials=bias_grad_partials, column_finish=column_finish, relu_forward=relu_forward, relu_backward=relu_backward,
        gelu_forward=gelu_forward, gelu_backward=gelu_backward, tanh_forward=tanh_forward,
        tanh_backward=tanh_backward, layernorm_forward=layernorm_forward,
        layernorm_backward_rows=layernorm_backward_rows, layernorm_params_partials=layernorm_params_partials,
        cross_entropy_rows=cross_entropy_rows, cross_entropy_finish=cross_entropy_finish, mse_partial=mse_partial,
        ce_shard_stats=ce_shard_stats, ce_shard_sumexp=ce_shard_sumexp, ce_shard_grad=ce_shard_grad,
        sgd_update=sgd_update, adam_update=adam_update, sgd_update_runs=sgd_update_runs,
        adam_update_runs=adam_update_runs)
