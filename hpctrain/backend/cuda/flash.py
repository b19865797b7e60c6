"""Fused causal attention on the GPU (``model.attention = "flash"``): an online softmax over tiles of keys, so no
[B, H, T, T] array exists in either pass. The forward keeps one float per row, its log-sum-exp; the backward
recomputes the probabilities from it (FlashAttention-2's split: one kernel for dq, one for dk and dv, so no
atomics and every result is bit-identical run to run).

Layout (attention.py's): qkv[B·T, 3C] with head h of sample b in columns h·hs.. (q), C + h·hs.. (k) and
2C + h·hs.. (v); out and dout [B·T, C]; for row r = z·T + i of head z = b·H + h

    lse[r] = log Σ_{j≤i} exp(scale · q_i·k_j)          the forward's, kept for the backward
    P[i, j] = exp(scale · q_i·k_j − lse[r])             recomputed, never stored
    dsum[r] = dout_i · out_i = Σ_j P[i, j] · datt[i, j]  the softmax backward's row term (dq kernel writes it)
    datt[i, j] = dout_i · v_j (through dropout's mask)   ds = P · (datt − dsum)
    dq_i = scale · Σ_j ds · k_j,  dk_j = scale · Σ_i ds · q_i,  dv_j = Σ_i dropout(P)[i, j] · dout_i

Launch shape: ``NT`` = 128 threads a block, ``lanes(hs)`` = 1, 2, 4 or 8 threads per row, each holding at most
16 of the row's channels (lane-major: a warp's threads share a lane); a block's rows are of one head, a query row
in the forward and dq kernels (the longest causal rows launched first), a key row in the dk/dv kernel (the
earliest keys, which see the most queries, first). The other operand streams through shared memory in tiles of
``BC`` = 16 rows that a block's threads read at the same address (a broadcast); each lane's part of a dot
product goes to shared memory and the row's lanes add the parts in lane order, so every lane of a row holds the
same score. A thread's accumulators and its own row's channels are registers. The head size is compiled in
(``flash_kernels(hs)``), up to ``MAX_HS`` = 128; every kernel assembles without spills for sm_80 and sm_90
(tests/test_cuda_compile.py, at hs = 64 and 128). Arithmetic is float32.

Dropout (``drop``) draws dropout_mask.py's mask from each element's global index, as ``CudaBackend.dropout``
does on a stored att: row r at (row0 + (r // group)·stride + r % group)·T + j. The forward's normaliser sums
the undropped probabilities, its output the dropped ones; the backward draws the same mask again.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np
from numba import cuda, float32, uint64

from ...errors import BackendError
from ..base import FLASH_MAX_HS
from ..dropout_mask import GOLDEN, MUL1, MUL2, keep_scale, threshold
from . import blocks, sim

__all__ = ["flash_kernels", "MAX_HS", "NT", "rows_per_block", "FlashAttention"]

MAX_HS = FLASH_MAX_HS
NT = 128  # threads per block: ``lanes`` threads per row, NT // lanes rows
BC = 16  # rows of a shared tile of the other operand

_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
_NEG_INF = np.float32(-np.inf)
_GOLDEN, _MUL1, _MUL2 = np.uint64(GOLDEN), np.uint64(MUL1), np.uint64(MUL2)
_S27, _S30, _S31, _S32 = np.uint64(27), np.uint64(30), np.uint64(31), np.uint64(32)
_ONE64, _LOW32 = np.uint64(1), np.uint64(0xFFFFFFFF)


def lanes(hs: int) -> int:
    """Threads per row for heads of ``hs`` channels (1, 2, 4 or 8): each holds at most 16 of a row's channels."""
    n = 1
    while 16 * n < hs:
        n *= 2
    return n


def rows_per_block(hs: int) -> int:
    return NT // lanes(hs)


@functools.lru_cache(maxsize=None)
def flash_kernels(hs: int) -> SimpleNamespace:
    """The three kernels for heads of ``hs`` channels; compiled lazily, once per process and head size."""
    if not 1 <= hs <= MAX_HS:
        raise BackendError(f'model.attention = "flash" on the CUDA backend takes heads of at most {MAX_HS} '
                           f'channels (n_embd / n_head = {hs}); use model.attention = "math"')
    pieces = _pieces(hs)  # the launch shape's constants and device functions, closed over by each kernel
    return SimpleNamespace(flash_forward=_forward(*pieces), flash_backward_dq=_backward_dq(*pieces),
                           flash_backward_dkdv=_backward_dkdv(*pieces))


def _pieces(hs: int) -> tuple:
    """What the three kernels share for heads of ``hs`` channels: the launch shape's constants and the device
    functions (inlined into each kernel)."""
    sim.install()  # under the simulator: shared arrays that every thread of a block agrees on
    HS, TR = hs, lanes(hs)
    HL = -(-hs // TR)  # channels per lane: lane l holds channels l·HL .. l·HL + HL − 1 of its row (those < HS)
    WHOLE = HL * TR == HS
    BR = NT // TR
    SP = BC + 1  # a row of partial sums, padded: conflict-free
    device = sim.inlined_device_jit()

    @device
    def kept(key, cut, index):
        """Whether dropout keeps the element of global index ``index`` (dropout_mask.py: mix64 of key ^ index/2,
        the high half for an even index)."""
        z = (key ^ (index >> _ONE64)) + _GOLDEN
        z = (z ^ (z >> _S30)) * _MUL1
        z = (z ^ (z >> _S27)) * _MUL2
        z = z ^ (z >> _S31)
        draw = (z & _LOW32) if index & _ONE64 else (z >> _S32)
        return draw >= cut

    @device
    def row_start(r, T, row0, group, stride):
        """The global index of element 0 of att row ``r`` (its row's place in the layout-free array, times T)."""
        return uint64(row0 + (r // group) * stride + r % group) * uint64(T)

    @device
    def place(T, H, longest_first):
        """(row, lane, z, h, r0, C, base, i, ok, own): this thread's row in the block and its lane (lane-major, so a
        warp's threads share a lane), the block's head z = b·H + h and its first row r0; the blocks of a head ordered
        with the last rows (the longest causal query rows) first, or else the first rows (the keys most queries see).
        Then C = H·HS, the sample's first row ``base`` = b·T, this thread's row i = r0 + row of the head, whether it
        is one (``ok``: i < T) and the qkv row it reads (``own``: row i, or the last row past T)."""
        tid = cuda.threadIdx.x
        nb = (T + BR - 1) // BR
        z = cuda.blockIdx.x // nb
        k = cuda.blockIdx.x % nb
        r0 = (nb - 1 - k if longest_first else k) * BR
        b = z // H
        row = tid % BR
        base = b * T
        i = r0 + row
        return row, tid // BR, z, z - b * H, r0, H * HS, base, i, i < T, base + min(i, T - 1)

    @device
    def load_own(own, src, r, col, lane, scale):
        """own[k] = scale · src[r, col + d] for this lane's channels d (0 for a channel past HS)."""
        for k in range(HL):
            d = lane * HL + k
            own[k] = src[r, col + d] * scale if WHOLE or d < HS else _ZERO

    @device
    def zero(acc):
        for k in range(HL):
            acc[k] = _ZERO

    @device
    def store_own(dst, r, col, acc, lane, scale):
        """dst[r, col + d] = scale · acc[k] for this lane's channels d (those < HS)."""
        for k in range(HL):
            d = lane * HL + k
            if WHOLE or d < HS:
                dst[r, col + d] = acc[k] * scale

    @device
    def load_tile(tile, src, base, t0, T, col, scale):
        """tile[r, d] = scale · src[base + t0 + r, col + d] for the BC rows of a tile (past T: the last row's copy,
        never read)."""
        for e in range(cuda.threadIdx.x, BC * HS, NT):
            r = e // HS
            d = e - r * HS
            tile[r, d] = src[base + min(t0 + r, T - 1), col + d] * scale

    @device
    def lane_dot(own, tile, c, lane):
        """This lane's part of own · tile[c]."""
        s = _ZERO
        for k in range(HL):
            d = lane * HL + k
            if WHOLE or d < HS:
                s += own[k] * tile[c, d]
        return s

    @device
    def lane_axpy(acc, a, tile, c, lane):
        """acc += a · tile[c] over this lane's channels."""
        for k in range(HL):
            d = lane * HL + k
            if WHOLE or d < HS:
                acc[k] += a * tile[c, d]

    @device
    def row_sum(part, lane_row, c):
        """Σ over the lanes of a row's partial sums, in lane order (every lane of the row gets the same)."""
        s = part[0, lane_row, c]
        for l in range(1, TR):
            s += part[l, lane_row, c]
        return s

    return (HS, TR, HL, WHOLE, BR, SP, sim.kernel_jit(NT), kept, row_start, place, load_own, zero, store_own,
            load_tile, lane_dot, lane_axpy, row_sum)


def _forward(HS, TR, HL, WHOLE, BR, SP, kernel, kept, row_start, place, load_own, zero, store_own,
             load_tile, lane_dot, lane_axpy, row_sum):
    """The forward kernel: out and lse, each block's query rows against every key tile up to the diagonal."""

    @kernel
    def flash_forward(qkv, out, lse, T, H, scale, key, site, steps, derive, cut, kscale, row0, group, stride,
                      drop):
        """out rows and lse of one block of query rows of one head: keys in tiles of BC, an online softmax."""
        key = blocks.site_key(key, steps[0], site) if derive else key
        k_tile = cuda.shared.array((BC, HS), float32)
        v_tile = cuda.shared.array((BC, HS), float32)
        part = cuda.shared.array((TR, BR, SP), float32)  # each lane's part of q_i · k_j
        q = cuda.local.array(HL, float32)
        acc = cuda.local.array(HL, float32)
        row, lane, z, h, r0, C, base, i, ok, own = place(T, H, True)
        load_own(q, qkv, own, h * HS, lane, scale)
        zero(acc)
        m = _NEG_INF
        total = _ZERO
        start = row_start(z * T + i, T, row0, group, stride) if drop else uint64(0)
        last = min(r0 + BR, T)  # the block's keys: j < last
        for t0 in range(0, last, BC):
            cuda.syncthreads()  # the previous tile and its partial sums are read
            load_tile(k_tile, qkv, base, t0, T, C + h * HS, _ONE)
            load_tile(v_tile, qkv, base, t0, T, 2 * C + h * HS, _ONE)
            cuda.syncthreads()
            for c in range(BC):
                part[lane, row, c] = lane_dot(q, k_tile, c, lane)
            cuda.syncthreads()
            n = min(BC, i - t0 + 1) if ok else 0  # this row's keys in the tile: j ≤ i
            top = m
            for c in range(n):
                top = max(top, row_sum(part, row, c))
            if top > m:  # a new maximum: rescale what is summed so far
                corr = math.exp(m - top)
                total *= corr
                for k in range(HL):
                    acc[k] *= corr
                m = top
            for c in range(n):
                p = math.exp(row_sum(part, row, c) - m)
                total += p
                if drop:
                    p = p * kscale if kept(key, cut, start + uint64(t0 + c)) else _ZERO
                lane_axpy(acc, p, v_tile, c, lane)
        if ok:
            store_own(out, base + i, h * HS, acc, lane, _ONE / total)
            if lane == 0:
                lse[z * T + i] = m + math.log(total)

    return flash_forward


def _backward_dq(HS, TR, HL, WHOLE, BR, SP, kernel, kept, row_start, place, load_own, zero, store_own,
                 load_tile, lane_dot, lane_axpy, row_sum):
    """The dq kernel, which also leaves dsum (each row's dout·out) for the dk/dv kernel."""

    @kernel
    def flash_backward_dq(qkv, dout, out, lse, dsum, dqkv, T, H, scale, key, site, steps, derive, cut, kscale,
                          row0, group, stride, drop):
        """dq rows of one block of query rows, and their dsum for the dk/dv kernel: keys in tiles of BC."""
        key = blocks.site_key(key, steps[0], site) if derive else key
        k_tile = cuda.shared.array((BC, HS), float32)
        v_tile = cuda.shared.array((BC, HS), float32)
        s_part = cuda.shared.array((TR, BR, SP), float32)  # each lane's part of q_i · k_j
        g_part = cuda.shared.array((TR, BR, SP), float32)  # and of dout_i · v_j
        q = cuda.local.array(HL, float32)
        dy = cuda.local.array(HL, float32)
        dq = cuda.local.array(HL, float32)
        row, lane, z, h, r0, C, base, i, ok, own = place(T, H, True)
        load_own(q, qkv, own, h * HS, lane, scale)
        load_own(dy, dout, own, h * HS, lane, _ONE)
        zero(dq)
        mine = _ZERO
        for k in range(HL):
            d = lane * HL + k
            mine += dy[k] * out[own, h * HS + d] if WHOLE or d < HS else _ZERO
        s_part[lane, row, 0] = mine
        cuda.syncthreads()
        rsum = row_sum(s_part, row, 0)  # dout_i · out_i
        if ok and lane == 0:
            dsum[z * T + i] = rsum
        log_total = lse[z * T + min(i, T - 1)]
        start = row_start(z * T + i, T, row0, group, stride) if drop else uint64(0)
        last = min(r0 + BR, T)
        for t0 in range(0, last, BC):
            cuda.syncthreads()
            load_tile(k_tile, qkv, base, t0, T, C + h * HS, _ONE)
            load_tile(v_tile, qkv, base, t0, T, 2 * C + h * HS, _ONE)
            cuda.syncthreads()
            for c in range(BC):
                s_part[lane, row, c] = lane_dot(q, k_tile, c, lane)
                g_part[lane, row, c] = lane_dot(dy, v_tile, c, lane)
            cuda.syncthreads()
            n = min(BC, i - t0 + 1) if ok else 0
            for c in range(n):
                p = math.exp(row_sum(s_part, row, c) - log_total)
                dp = row_sum(g_part, row, c)
                if drop:
                    dp = dp * kscale if kept(key, cut, start + uint64(t0 + c)) else _ZERO
                lane_axpy(dq, p * (dp - rsum), k_tile, c, lane)
        if ok:
            store_own(dqkv, base + i, h * HS, dq, lane, scale)

    return flash_backward_dq


def _backward_dkdv(HS, TR, HL, WHOLE, BR, SP, kernel, kept, row_start, place, load_own, zero, store_own,
                   load_tile, lane_dot, lane_axpy, row_sum):
    """The dk/dv kernel: each block's key rows against every query tile from the diagonal on."""

    @kernel
    def flash_backward_dkdv(qkv, dout, lse, dsum, dqkv, T, H, scale, key, site, steps, derive, cut, kscale, row0,
                            group, stride, drop):
        """dk and dv rows of one block of key rows: the queries i ≥ j in tiles of BC (after the dq kernel)."""
        key = blocks.site_key(key, steps[0], site) if derive else key
        q_tile = cuda.shared.array((BC, HS), float32)  # scale · q
        dy_tile = cuda.shared.array((BC, HS), float32)
        lse_tile = cuda.shared.array(BC, float32)
        dsum_tile = cuda.shared.array(BC, float32)
        s_part = cuda.shared.array((TR, BR, SP), float32)  # each lane's part of q_i · k_j
        g_part = cuda.shared.array((TR, BR, SP), float32)  # and of dout_i · v_j
        kr = cuda.local.array(HL, float32)
        vr = cuda.local.array(HL, float32)
        dk = cuda.local.array(HL, float32)
        dv = cuda.local.array(HL, float32)
        row, lane, z, h, r0, C, base, j, ok, own = place(T, H, False)
        for k in range(HL):  # one loop for both rows: as two load_own calls ptxas takes 194 registers on sm_80, not 168
            d = lane * HL + k
            live = WHOLE or d < HS
            kr[k] = qkv[own, C + h * HS + d] if live else _ZERO
            vr[k] = qkv[own, 2 * C + h * HS + d] if live else _ZERO
            dk[k] = _ZERO
            dv[k] = _ZERO
        for t0 in range(r0, T, BC):  # the queries i ≥ the block's first key
            cuda.syncthreads()
            load_tile(q_tile, qkv, base, t0, T, h * HS, scale)
            load_tile(dy_tile, dout, base, t0, T, h * HS, _ONE)
            for r in range(cuda.threadIdx.x, BC, NT):
                i = z * T + min(t0 + r, T - 1)
                lse_tile[r] = lse[i]
                dsum_tile[r] = dsum[i]
            cuda.syncthreads()
            for c in range(BC):
                s_part[lane, row, c] = lane_dot(kr, q_tile, c, lane)
                g_part[lane, row, c] = lane_dot(vr, dy_tile, c, lane)
            cuda.syncthreads()
            lo = max(0, j - t0)  # queries i ≥ j
            hi = min(BC, T - t0) if ok else 0
            for c in range(lo, hi):
                p = math.exp(row_sum(s_part, row, c) - lse_tile[c])
                dp = row_sum(g_part, row, c)
                p_used = p
                if drop:
                    keep = kept(key, cut, row_start(z * T + t0 + c, T, row0, group, stride) + uint64(j))
                    p_used = p * kscale if keep else _ZERO
                    dp = dp * kscale if keep else _ZERO
                lane_axpy(dv, p_used, dy_tile, c, lane)
                lane_axpy(dk, p * (dp - dsum_tile[c]), q_tile, c, lane)
        if ok:
            store_own(dqkv, base + j, C + h * HS, dk, lane, _ONE)
            store_own(dqkv, base + j, 2 * C + h * HS, dv, lane, _ONE)

    return flash_backward_dkdv



class FlashAttention:
    """CudaBackend's fused attention, model.attention = "flash" (a mixin)."""

    def flash_attention_forward(self, qkv, T, n_head, out, lse, *, dropout=None):
        """out as ``attention_forward``'s, keeping lse[B, H, T] instead of att: one fused kernel, an online
        softmax over tiles of keys (flash.py); heads of at most 128 channels."""
        op = "flash_attention_forward"
        B, H, C, hs, T = self._flash_args(op, qkv, T, n_head, lse, out=out)
        if B == 0:
            return
        fk = flash_kernels(hs)
        grid = B * H * -(-T // rows_per_block(hs))
        self._launch(fk.flash_forward, grid, NT, qkv, out, lse.reshape(B * H * T), T, H,
                     np.float32(1.0 / math.sqrt(hs)), *self._flash_draw(dropout, B * H * T))

    def flash_attention_backward(self, dout, qkv, out, lse, T, n_head, dqkv, *, dropout=None):
        """dqkv[B·T, 3C] from dout, the forward's qkv, out and lse: a dq kernel (which leaves each row's
        dout·out), then a dk/dv kernel; overwritten, never accumulated."""
        op = "flash_attention_backward"
        B, H, C, hs, T = self._flash_args(op, qkv, T, n_head, lse, out=out, dout=dout, dqkv=dqkv)
        if B == 0:
            return
        fk = flash_kernels(hs)
        rows = B * H * T
        dsum = self._alloc(op, (rows,), np.float32)
        grid, lse1 = B * H * -(-T // rows_per_block(hs)), lse.reshape(rows)
        scale, draw = np.float32(1.0 / math.sqrt(hs)), self._flash_draw(dropout, rows)
        self._launch(fk.flash_backward_dq, grid, NT, qkv, dout, out, lse1, dsum, dqkv, T, H, scale,
                     *draw)
        self._launch(fk.flash_backward_dkdv, grid, NT, qkv, dout, lse1, dsum, dqkv, T, H, scale, *draw)

    def _flash_draw(self, dropout, rows):
        """The flash kernels' dropout arguments: key, site, steps, derive (dropout.py's ``_site_key``), cut, keep
        scale, row0, group, stride, drop."""
        if dropout is None:
            return np.uint64(0), np.uint64(0), self._step_dev, False, np.uint64(0), np.float32(1.0), 0, 1, 1, False
        group = dropout.group or max(rows, 1)
        return (*self._site_key(dropout), np.uint64(threshold(dropout.p)), keep_scale(dropout.p), dropout.row0, group,
                dropout.stride or group, True)
