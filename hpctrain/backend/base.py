"""The kernel contract both backends implement, and the argument checks they share.

A backend owns where arrays live (host memory or GPU memory) and runs every
kernel of a training step on them. ``CpuBackend`` (numpy BLAS + numba.njit) and
``CudaBackend`` (numba.cuda) implement the same methods with the same
signatures; layers, losses and optimizers call only these methods, so they run
unchanged on either. Arguments are checked where they enter, by the contract
methods below that both backends call first (``_matmul_args``, ``_layernorm_backward_args``,
...): a wrong dtype, a non-contiguous array or a shape that does not fit raises
``BackendError`` naming the op, the argument and the shapes, never a silent wrong
result, and the same on either backend (a device backend's ``_arg`` also refuses a
host array). tests/test_backend_contract.py and tests/cuda/test_cuda_contract.py break
each argument of each op in turn.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from ..errors import BackendError

FLASH_MAX_HS = 128  # the widest head (channels) the CUDA backend's flash attention kernels take (cuda/flash.py)

__all__ = ["Backend", "StreamWaits", "Mark", "DecayRuns", "check_array"]


_F32 = np.dtype(np.float32)


def check_array(op, name, arr, *, ndim=None, shape=None, rows=None, cols=None, dtype=_F32):
    """Raise BackendError unless ``arr`` is a C-contiguous ``dtype`` array of the given shape.

    Every kernel call checks each of its arguments (a small model's step makes hundreds of these calls), so the
    passing case reads each attribute once and builds nothing: a host array that passes returns from the first
    test (a dtype instance compares by identity); the messages are worked out only on failure."""
    if type(arr) is np.ndarray:
        s, dt = arr.shape, arr.dtype
        if ((dt is dtype or dt == dtype) and arr.flags.c_contiguous and (ndim is None or len(s) == ndim)
                and (shape is None or s == shape) and (rows is None or s[0] == rows) and (cols is None or s[1] == cols)):
            return arr
    arr_shape = getattr(arr, "shape", None)
    arr_dtype = getattr(arr, "dtype", None)
    if arr_shape is None or arr_dtype is None:
        raise BackendError(f"{op}: {name} must be an array, got {type(arr).__name__}")
    if arr_dtype != dtype and np.dtype(arr_dtype) != np.dtype(dtype):
        raise BackendError(f"{op}: {name} must be {np.dtype(dtype).name}, got {np.dtype(arr_dtype).name} with shape {tuple(arr_shape)}")
    if not (arr.flags.c_contiguous if type(arr) is np.ndarray else _is_c_contiguous(arr)):
        raise BackendError(f"{op}: {name} must be C-contiguous (shape {tuple(arr_shape)})")
    if ndim is not None and len(arr_shape) != ndim:
        raise BackendError(f"{op}: {name} must have {ndim} dimensions, got shape {tuple(arr_shape)}")
    if shape is not None and tuple(arr_shape) != tuple(shape):
        raise BackendError(f"{op}: {name} has shape {tuple(arr_shape)}, expected {tuple(shape)}")
    if rows is not None and arr_shape[0] != rows:
        raise BackendError(f"{op}: {name} has shape {tuple(arr_shape)}, expected {rows} rows")
    if cols is not None and arr_shape[1] != cols:
        raise BackendError(f"{op}: {name} has shape {tuple(arr_shape)}, expected {cols} columns")
    return arr


def _is_c_contiguous(arr) -> bool:
    flags = getattr(arr, "flags", None)
    if flags is None:
        return True
    try:
        return bool(flags["C_CONTIGUOUS"])
    except (KeyError, TypeError):
        return bool(getattr(flags, "c_contiguous", True))


class DecayRuns:
    """Weight decay by runs of a flat slice, so one update covers it (optim.py): ``runs``, the (lo, hi, decay) of
    ``optim.decay_runs`` counted from the slice's start, cover [0, ``size``) in order, each decay 0 or ``value``.
    A device backend keeps the runs' starts and decayed flags on the device too (``device``: its arrays), and its
    update is one launch instead of one per run (34 a step on gpt-char's GPT)."""

    __slots__ = ("runs", "value", "size", "device")

    def __init__(self, runs, device=None):
        self.runs = tuple((int(lo), int(hi), float(d)) for lo, hi, d in runs)
        values = {d for _, _, d in self.runs if d != 0}
        if len(values) > 1 or any(a[1] != b[0] for a, b in zip(self.runs, self.runs[1:])) or (
                self.runs and self.runs[0][0] != 0):
            raise BackendError(f"decay runs must tile [0, n) with one weight decay and 0, got {self.runs}")
        self.value = values.pop() if values else 0.0
        self.size = self.runs[-1][1] if self.runs else 0
        self.device = device


class Mark:
    """A point of a device stream: its event, and for one recorded on the training stream its number among that
    stream's marks (None for another stream's)."""

    __slots__ = ("event", "seq")

    def __init__(self, event, seq):
        self.event, self.seq = event, seq


class StreamWaits:
    """A device backend's bookkeeping of waits for its training stream (CudaBackend; the tests' fake device).

    ``host_waits``: the training thread's waits for the whole stream (the GPU's queue runs dry);
    ``mark_waits``: its waits for an earlier mark, with later work still queued; ``background_waits``: other
    threads' (a communication thread's staging copies). Marks are numbered as they are made; a wait for the
    whole stream passes every mark made before it began, and ``passed`` says so without asking the device.
    """

    def _init_waits(self) -> None:
        self.host_waits = self.mark_waits = self.background_waits = 0
        self._owner = threading.get_ident()  # the training thread: the one that made the backend
        self._marks_made = 0
        self._marks_done = 0  # marks [0, _marks_done) are complete: a wait for the whole stream followed them

    def _count_wait(self, whole_stream: bool = True) -> None:
        if threading.get_ident() != self._owner:
            self.background_waits += 1
        elif whole_stream:
            self.host_waits += 1
        else:
            self.mark_waits += 1

    def _new_mark(self, event) -> Mark:
        """``event``, just recorded on the training stream, as the next mark."""
        self._marks_made += 1
        return Mark(event, self._marks_made - 1)

    def _stream_wait(self, wait) -> None:
        """``wait()`` waits for the whole training stream: counted, and every mark made before it is passed."""
        self._count_wait()
        covered = self._marks_made  # every mark made so far was recorded before this wait began
        wait()
        self._marks_done = max(self._marks_done, covered)

    def _mark_wait(self, mark, wait) -> None:
        """``wait()`` waits for ``mark``, a training stream's: counted, and it and every mark before it passed
        (the stream completes its work in order)."""
        self._count_wait(whole_stream=False)
        wait()
        if mark.seq is not None and threading.get_ident() == self._owner:
            self._marks_done = max(self._marks_done, mark.seq + 1)

    def passed(self, mark) -> bool:
        """Whether a wait for the whole stream, or for a later mark, has passed ``mark`` (so what was queued
        before it is done)."""
        return mark.seq is not None and mark.seq < self._marks_done


class Backend:
    """Base of CpuBackend and CudaBackend: shared checks; see cpu/ for the kernel list.

    Memory: ``empty``, ``zeros``, ``asarray`` (host -> backend), ``to_host``,
    ``copy_``, ``synchronize``. Products: ``matmul_nt`` (X·Wᵀ + b),
    ``matmul_nn`` (dY·W), ``matmul_tn`` (dYᵀ·X), ``bias_grad``; ``product_input`` (an operand as the products
    read it: a bfloat16 copy under ``train.precision = "bf16"``, what a Linear keeps for its backward; attention
    keeps q, k and v so) and ``kept_output`` (a product's output kept for an activation's backward). Element-wise:
    ``relu/gelu/tanh_forward/backward``, ``add_`` (residuals), ``dropout`` (a counter-based mask, redrawn in
    backward: dropout_mask.py). ``layernorm_forward/backward``, and ``residual_layernorm_forward/backward`` (the
    residual add before a LayerNorm fused in).
    Transformer: ``embedding_forward/backward`` (token + position tables, a deterministic
    scatter-add), ``attention_forward/backward`` (causal multi-head attention on a fused
    q/k/v projection, keeping the probabilities att[B, H, T, T]) and ``flash_attention_forward/backward``
    (the same, keeping each row's log-sum-exp lse[B, H, T] and recomputing the probabilities in backward).
    Losses return host scalars: ``cross_entropy`` -> (loss sum, correct),
    ``mse`` -> loss sum; given ``into`` (a float64 backend array of 3: a loss row) they
    write there instead and return None, so a device backend need not wait: cross_entropy
    [loss sum, correct, first bad row (B if none)], mse the loss sum into[0] only
    (``sum_squares`` likewise, into one float64). Token ids and class targets may be host
    arrays on either backend: a device backend uploads them itself and checks them on the
    host. ``read_host(*arrays)`` copies several arrays to the host with one wait, ``read_later`` queues
    the copies and waits when asked (a step's values read at the next step: train/step.py);
    ``host_waits`` counts a device backend's waits for its whole stream (a training step's
    budget is one), ``mark_waits`` its waits for an earlier point of it.
    The vocab-parallel cross-entropy's three row passes over a block of
    the logits' columns (nn/loss.py combines them over the tensor-parallel group):
    ``ce_shard_stats`` (row max, first argmax, target logit), ``ce_shard_sumexp``,
    ``ce_shard_grad``. Flat buffers: ``sum_squares``, ``scale_``, ``fill_``,
    ``sgd_update``, ``adam_update`` (whose ``weight_decay`` may be ``decay_table(runs)``: one update over tensors
    of two decays). Device backends also stage gradients for an MPI that
    is not CUDA-aware: ``pinned_host(shape)``, ``to_host_into(dev, host)``,
    ``from_host_into(host, dev)``.
    """

    name = "base"
    is_device = False
    host_waits = mark_waits = 0  # the host's waits for the device (a device backend counts them: tests/cuda)
    # a device backend decides a step's clipping and skipping on the device (``clip_gate``; the updates' ``gate``)
    # and its loss and gradient norm reach the host one step later (``read_later``): train/step.py
    defers_step_values = False

    # train.precision = "bf16": the dtype a product's operand may be held in as bfloat16 (None: float32 only)
    bf16_storage = None

    def product_input(self, x):
        """``x`` as a product reads it and a layer keeps it for its backward: ``x`` itself; under
        ``train.precision = "bf16"`` a copy rounded to bfloat16 and held in half the bytes (``bf16_storage``),
        which the products take as it is (precision.py of either backend)."""
        return x

    def product_weights(self, data, refresh: bool):
        """A scope in which the products read a part's weights (views of ``data``, its flat float32 parameters)
        from a bfloat16 copy of ``data``, rounded first when ``refresh`` (nn/model.py opens it around a part's
        forward and backward): nothing here; under bf16 the copy each product would otherwise round its weight
        into anew (backend/product_weights.py)."""
        return contextlib.nullcontext()

    def empty_product_input(self, shape):
        """An array that a kernel writes and only a product reads (a LayerNorm's output before a Linear, the GELU's
        before c_proj): float32; under bf16 ``bf16_storage``, which ``layernorm_forward`` and ``gelu_forward``
        write rounded to bfloat16 as they write it, the products' rounding done there, no float32 copy made."""
        return self.empty(shape)

    def kept_output(self, x):
        """A product's output ``x`` as a layer keeps it for an element-wise backward (an activation's input:
        ``relu_backward`` and ``gelu_backward`` take it as it is): ``product_input(x)``, which under bf16 is exact
        here, since the product rounded ``x`` to bfloat16 already; half the bytes, as autocast keeps a bf16
        matmul's output for the activation after it."""
        return self.product_input(x)

    def read_host(self, *arrays) -> list:
        """Host copies of backend arrays, made together (a device backend waits for its stream once)."""
        return [np.array(a) for a in arrays]

    def read_later(self, *arrays) -> "PendingRead":
        """``read_host`` started now and finished by the returned object's ``wait()`` (a device backend queues the
        copies and waits only then, for them alone); one pending read at a time."""
        return PendingRead(self.read_host(*arrays))

    def step_scope(self):
        """A context manager around a training step: a device backend serves the step's arrays from its step
        arena (backend/arena.py); here nothing."""
        return contextlib.nullcontext()

    def lend(self, arr) -> None:
        """``arr`` goes to another thread (a pipeline send) that lets go of it by the end of the step: a step arena
        keeps its memory to the step's end (backend/arena.py); here nothing."""

    def timer(self):
        """A timing event recorded on the device's stream now (None where host clocks time the kernels: the CPU,
        the CUDA simulator); ``elapsed(a, b)`` gives the seconds between two, once a wait has passed both."""
        return None

    def elapsed(self, start, end) -> float:
        raise NotImplementedError("timer() gave no events to time")

    def upload(self, host):
        """``asarray`` for a step's per-micro-batch uploads (a device backend stages them through page-locked
        memory so the copy is asynchronous)."""
        return self.asarray(host)

    # Events (a device backend's; here the host is the device and every call is immediate): ``mark()`` an event
    # for what is queued so far, ``after(event)`` makes later work wait for it, ``host_wait_for(event)`` waits
    # on the calling thread, ``bind_thread()`` readies a communication thread.
    def mark(self):
        return None

    def after(self, event) -> None:
        pass

    def host_wait_for(self, event) -> None:
        pass

    def passed(self, mark) -> bool:
        """Whether a wait for the whole stream has passed ``mark`` (no stream here: always)."""
        return True

    def bind_thread(self) -> None:
        pass

    def _ids_arg(self, op, name, arr, **kw):
        """Token ids or class targets: int64, in host memory or the backend's (a device backend uploads host ids
        itself and checks their range on the host, without waiting for the device)."""
        return check_array(op, name, arr, dtype=np.int64, **kw)

    def _into_arg(self, op, into, n):
        """``into``: None, or a float64 backend array of ``n`` that a reduction writes its result to."""
        if into is not None:
            self._arg(op, "into", into, shape=(n,), dtype=np.float64)

    # ``_arg(op, name, arr, **kw)``: one argument checked; a device backend's also requires it to live on the
    # device. On the host it is ``check_array`` itself, one Python call per argument rather than two.
    _arg = staticmethod(check_array)

    def _check_same(self, op, **arrays):
        first_name, first = next(iter(arrays.items()))
        shape = self._arg(op, first_name, first).shape
        for name, arr in arrays.items():
            self._arg(op, name, arr, shape=shape)

    def _check_flat(self, op, **arrays):
        first_name, first = next(iter(arrays.items()))
        n = self._arg(op, first_name, first, ndim=1).shape[0]
        for name, arr in arrays.items():
            self._arg(op, name, arr, shape=(n,))

    # A residual add fused with the LayerNorm after it (a GPT block's x2 = x2 + x; h2 = ln_2(x2)), forward and
    # backward side by side. These are the unfused sequence, which the CPU backend runs as they are (a fused loop
    # saves it nothing measurable); the CUDA backend overrides them (cuda/norm.py) with the same results.
    def residual_layernorm_forward(self, x, residual, weight, bias, eps, out, mean, rstd):
        """x[B,C] += residual[B,C] (in place: x is the residual stream after the add), then out = LayerNorm(x)
        as ``layernorm_forward`` (mean[B], rstd[B] saved)."""
        self._residual_layernorm_forward_args(x, residual, weight, bias, out, mean, rstd)
        self.add_(x, residual)
        self.layernorm_forward(x, weight, bias, eps, out, mean, rstd)

    def residual_layernorm_backward(self, dout, dresidual, x, weight, mean, rstd, dinp, dweight, dbias,
                                    accumulate=False):
        """``layernorm_backward`` of dout, then dinp += dresidual: the gradient of the sum that
        ``residual_layernorm_forward`` made, from the LayerNorm and from the residual stream after it."""
        self._residual_layernorm_backward_args(dout, dresidual, x, weight, mean, rstd, dinp, dweight, dbias)
        self.layernorm_backward(dout, x, weight, mean, rstd, dinp, dweight, dbias, accumulate=accumulate)
        self.add_(dinp, dresidual)

    def decay_table(self, runs) -> DecayRuns:
        """The weight decay of ``runs`` ((lo, hi, decay) from the slice's start) for one ``sgd_update`` or
        ``adam_update`` over the slice."""
        return DecayRuns(runs)

    @staticmethod
    def _check_decay(op, weight_decay, n):
        """``weight_decay``: a number, or a DecayRuns of ``n`` values."""
        if isinstance(weight_decay, DecayRuns) and weight_decay.size != n:
            raise BackendError(f"{op}: weight_decay runs cover {weight_decay.size} values, the arrays {n}")

    # ------------------------------------------------------------------ the argument contract of each op
    # Both backends call these first, so a wrongly sized, typed or placed argument is the same BackendError
    # on either (tests/test_backend_contract.py); each returns the sizes its op needs.

    def _matmul_args(self, op, a, b, out, bias=None):
        """(M, N, K) of out[M,N] = a·b in the layout ``op`` names (nt: a[M,K], b[N,K]; nn: a[M,K], b[K,N];
        tn: a[K,M], b[K,N])."""
        self._arg(op, "a", a, ndim=2, dtype=self._operand_dtype(a))
        held = self._operand_dtype(b)
        if op == "matmul_nt":
            self._arg(op, "b", b, ndim=2, cols=a.shape[1], dtype=held)
            M, N, K = a.shape[0], b.shape[0], a.shape[1]
        elif op == "matmul_nn":
            self._arg(op, "b", b, ndim=2, rows=a.shape[1], dtype=held)
            M, N, K = a.shape[0], b.shape[1], a.shape[1]
        else:
            self._arg(op, "b", b, ndim=2, rows=a.shape[0], dtype=held)
            M, N, K = a.shape[1], b.shape[1], a.shape[0]
        self._arg(op, "out", out, shape=(M, N))
        if bias is not None:
            self._arg(op, "bias", bias, shape=(N,))
        return M, N, K

    def _operand_dtype(self, x):
        """The dtype a product's operand ``x`` may have: float32, or this backend's ``bf16_storage`` where it has
        one and ``x`` is held in it (made by ``product_input``)."""
        held = self.bf16_storage
        return held if held is not None and getattr(x, "dtype", None) == held else _F32

    def _bias_grad_args(self, dout, dbias):
        C = self._arg("bias_grad", "dout", dout, ndim=2).shape[1]
        self._arg("bias_grad", "dbias", dbias, shape=(C,))
        return C

    def _unary_args(self, op, x, out):
        self._arg(op, "out", out, shape=self._arg(op, "x", x).shape)

    def _dropout_args(self, x, out, rows):
        """(R, W) of ``dropout``: x and out [R, W] (out may be x), ``rows`` a DropRows with p in [0, 1)."""
        R, W = self._arg("dropout", "x", x, ndim=2).shape
        self._arg("dropout", "out", out, shape=(R, W))
        if not 0.0 <= rows.p < 1.0:
            raise BackendError(f"dropout: p = {rows.p} is outside [0, 1)")
        if rows.group < 0 or rows.stride < 0 or rows.row0 < 0:
            raise BackendError(f"dropout: row0, group and stride must be >= 0, got {rows.row0}, {rows.group}, "
                               f"{rows.stride}")
        return R, W

    def _layernorm_forward_args(self, x, weight, bias, out, mean, rstd, op="layernorm_forward"):
        B, C = self._arg(op, "x", x, ndim=2).shape
        for name, arr in (("weight", weight), ("bias", bias)):
            self._arg(op, name, arr, shape=(C,))
        self._arg(op, "out", out, shape=(B, C), dtype=self._operand_dtype(out))  # bf16: empty_product_input's
        for name, arr in (("mean", mean), ("rstd", rstd)):
            self._arg(op, name, arr, shape=(B,))
        return B, C

    def _layernorm_backward_args(self, dout, x, weight, mean, rstd, dinp, dweight, dbias, op="layernorm_backward"):
        B, C = self._arg(op, "x", x, ndim=2).shape
        for name, arr in (("dout", dout), ("dinp", dinp)):
            self._arg(op, name, arr, shape=(B, C))
        for name, arr in (("weight", weight), ("dweight", dweight), ("dbias", dbias)):
            self._arg(op, name, arr, shape=(C,))
        for name, arr in (("mean", mean), ("rstd", rstd)):
            self._arg(op, name, arr, shape=(B,))
        return B, C

    def _residual_layernorm_forward_args(self, x, residual, weight, bias, out, mean, rstd):
        op = "residual_layernorm_forward"
        B, C = self._layernorm_forward_args(x, weight, bias, out, mean, rstd, op=op)
        self._arg(op, "residual", residual, shape=(B, C))
        return B, C

    def _residual_layernorm_backward_args(self, dout, dresidual, x, weight, mean, rstd, dinp, dweight, dbias):
        op = "residual_layernorm_backward"
        B, C = self._layernorm_backward_args(dout, x, weight, mean, rstd, dinp, dweight, dbias, op=op)
        self._arg(op, "dresidual", dresidual, shape=(B, C))
        return B, C

    def _cross_entropy_args(self, logits, targets, dlogits):
        B, C = self._arg("cross_entropy", "logits", logits, ndim=2).shape
        self._ids_arg("cross_entropy", "targets", targets, shape=(B,))
        self._arg("cross_entropy", "dlogits", dlogits, shape=(B, C))
        return B, C

    def _mse_args(self, pred, target, dpred):
        shape = self._arg("mse", "pred", pred, ndim=2).shape
        self._arg("mse", "target", target, shape=shape)
        self._arg("mse", "dpred", dpred, shape=shape)
        return shape

    def _embedding_args(self, op, idx, table, wpe, rows_out, out_name, vocab_start=0, vocab=None):
        """(B, T, V, C, lo, vocab) of an embedding op: idx[B, T] int64, table[V, C] (wte or dwte), wpe[≥T, C]
        (or dwpe), ``rows_out``[B·T, C] (out or dout). The table holds token ids [lo, lo + V) of a vocabulary of
        ``vocab`` ids (default V: the whole table; a vocab-parallel shard holds a block of it)."""
        B, T = self._ids_arg(op, "idx", idx, ndim=2).shape
        table_name, wpe_name, what = (("wte", "wpe", "position table") if op == "embedding_forward"
                                      else ("dwte", "dwpe", "position gradient"))
        V, C = self._arg(op, table_name, table, ndim=2).shape
        self._arg(op, wpe_name, wpe, ndim=2, cols=C)
        self._arg(op, out_name, rows_out, shape=(B * T, C))
        if wpe.shape[0] < T:
            raise BackendError(f"{op}: {T} positions but the {what} {wpe_name} has {wpe.shape[0]} rows")
        lo, vocab = self._vocab_block(op, table_name, V, vocab_start, vocab)
        return B, T, V, C, lo, vocab

    def _vocab_block(self, op, name, rows, vocab_start, vocab):
        """(lo, vocab): ``rows`` ids [lo, lo + rows) of a vocabulary of ``vocab`` (default lo + rows)."""
        lo = int(vocab_start)
        vocab = lo + rows if vocab is None else int(vocab)
        if lo < 0 or lo + rows > vocab:
            raise BackendError(f"{op}: {name} holds ids [{lo}, {lo + rows}), outside a vocabulary of {vocab}")
        return lo, vocab

    def _vocab_shard_args(self, op, logits, targets, vocab_start, vocab, **rows):
        """(B, V, lo) of a vocab-parallel cross-entropy op: logits[B, V] (ids [lo, lo + V) of ``vocab``), int64
        targets[B], and per-row arrays ``rows`` (name -> (array, dtype))."""
        B, V = self._arg(op, "logits", logits, ndim=2).shape
        self._ids_arg(op, "targets", targets, shape=(B,))
        for name, (arr, dtype) in rows.items():
            self._arg(op, name, arr, shape=(B,), dtype=dtype)
        lo, _ = self._vocab_block(op, "logits", V, vocab_start, vocab)
        return B, V, lo

    def _ce_sumexp_args(self, logits, mx, sumexp):
        """(B, V) of ``ce_shard_sumexp``: logits[B, V], mx[B] float32, sumexp[B] float64."""
        B, V = self._arg("ce_shard_sumexp", "logits", logits, ndim=2).shape
        self._arg("ce_shard_sumexp", "mx", mx, shape=(B,))
        self._arg("ce_shard_sumexp", "sumexp", sumexp, shape=(B,), dtype=np.float64)
        return B, V

    def _attention_args(self, op, qkv, T, n_head, att, **arrays):
        """(B, H, C, hs, T) of an attention op, after checking qkv, att[B, H, T, T] and ``arrays``: out or dout
        [B·T, C], dqkv[B·T, 3C]."""
        B, H, C, hs = self._attention_shapes(op, qkv, T, n_head)
        T = int(T)
        self._arg(op, "att", att, shape=(B, H, T, T))
        for name, arr in arrays.items():
            self._arg(op, name, arr, shape=(B * T, 3 * C if name == "dqkv" else C))
        return B, H, C, hs, T

    def _flash_args(self, op, qkv, T, n_head, lse, **arrays):
        """(B, H, C, hs, T) of a flash attention op, after checking qkv, lse[B, H, T] and ``arrays``: out and
        dout [B·T, C], dqkv[B·T, 3C]."""
        B, H, C, hs = self._attention_shapes(op, qkv, T, n_head)
        T = int(T)
        self._arg(op, "lse", lse, shape=(B, H, T))
        for name, arr in arrays.items():
            self._arg(op, name, arr, shape=(B * T, 3 * C if name == "dqkv" else C))
        return B, H, C, hs, T

    def _attention_shapes(self, op, qkv, T, n_head):
        """(B, H, C, hs) of a fused qkv[B·T, 3C] with ``n_head`` heads; BackendError if they do not fit. A
        backward's qkv may be held in ``bf16_storage`` (what the layer kept: ``product_input``)."""
        dtype = self._operand_dtype(qkv) if op.endswith("_backward") else _F32
        rows, width = self._arg(op, "qkv", qkv, ndim=2, dtype=dtype).shape
        T, H = int(T), int(n_head)
        if T < 1 or rows % T:
            raise BackendError(f"{op}: qkv has {rows} rows, not a multiple of T = {T}")
        if width % 3 or (width // 3) % H:
            raise BackendError(f"{op}: qkv has {width} columns; expected 3·C with C divisible by n_head = {H}")
        C = width // 3
        if C == 0:
            raise BackendError(f"{op}: qkv has no columns")
        return rows // T, H, C, C // H

    def bad_token(self, idx, position, vocab, op="embedding_forward"):
        value = int(self.to_host(idx).reshape(-1)[position])
        raise BackendError(f"{op}: token id {value} at position {position} of the batch is outside "
                           f"[0, {vocab})")

    def bad_target(self, targets, row, classes):
        value = int(self.to_host(targets)[row])
        raise BackendError(f"cross_entropy: target {value} in row {row} is outside [0, {classes})")


class PendingRead:
    """A read of backend arrays that ``wait()`` finishes (here: made already)."""

    def __init__(self, copies, finish=None):
        self._copies, self._finish = copies, finish

    def wait(self) -> list:
        if self._finish is not None:
            self._copies, self._finish = self._finish(), None
        return self._copies
