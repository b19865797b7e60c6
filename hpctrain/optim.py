"""SGD, Adam and AdamW over the flat buffers, gradient clipping and LR schedules.

The update rules are torch.optim's documented ones: SGD with momentum
(dampening 0), Nesterov and L2 weight decay; Adam with L2 weight decay; AdamW
with decoupled weight decay. Each step is one fused kernel over the whole
flat buffer. Slot names match torch.optim's state (``momentum_buffer``,
``exp_avg``, ``exp_avg_sq``) so checkpoints read like a torch state dict.
"""

from __future__ import annotations

import math

from .params import FlatBuffer, ParamLayout

__all__ = ["Optimizer", "make_optimizer", "lr_at", "clip_coefficient"]


class Optimizer:
    """Holds the optimizer slots and the step count; ``step(lr)`` updates params in place.

    ``pieces``: the [a, b) ranges of the flat buffers this rank updates (ZeRO's chunks, parallel/zero.py;
    or everything but a tied tensor's replica, which its owner updates); the slots then hold those ranges
    only, one after another (one tensor named ``"shard"``), and ``step`` reads the gradients and writes
    the parameters of those ranges alone. Default: the whole buffer, the slots in its layout.
    """

    def __init__(self, cfg, backend, params: FlatBuffer, grads: FlatBuffer, *, pieces=None):
        self.cfg, self.backend, self.params, self.grads = cfg, backend, params, grads
        self.name = cfg.name
        self.weight_decay = cfg.weight_decay
        self.step_count = 0
        self.pieces = [(0, params.layout.size)] if pieces is None else [tuple(p) for p in pieces]
        # each piece as runs [a, b) with one weight decay: with optim.decay_min_ndim, tensors of fewer dimensions
        # (biases, LayerNorm weights) take none; adjacent tensors alike share a run (one kernel launch)
        self._runs = [decay_runs(params.layout, a, b, cfg.decay_min_ndim, cfg.weight_decay) for a, b in self.pieces]
        # a piece of several runs is one update all the same: the backend looks each element's decay up in a
        # table (on a GPU one launch instead of one per run: gpt-char's 34 were a third of its step's host time)
        self._decay = [backend.decay_table([(lo - a, hi - a, d) for lo, hi, d in runs]) if len(runs) > 1 else None
                       for (a, _), runs in zip(self.pieces, self._runs)]
        if cfg.name == "sgd":
            slots = ("momentum_buffer",) if cfg.momentum != 0 else ()
        else:
            slots = ("exp_avg", "exp_avg_sq")
        size = sum(b - a for a, b in self.pieces)
        layout = params.layout if pieces is None else ParamLayout([("shard", (size,))])
        self.slots = {name: FlatBuffer(backend, layout) for name in slots}

    def take(self, full):
        """This optimizer's pieces of ``full`` (a host array in the parameters' layout), one after another: what
        its slots hold of a slot in that layout (``full`` itself when the pieces are the whole buffer)."""
        import numpy as np

        if self.pieces == [(0, self.params.layout.size)]:
            return full
        return np.concatenate([full[a:b] for a, b in self.pieces]) if self.pieces else full[:0].copy()

    @property
    def slot_bytes(self) -> int:
        """Bytes of optimizer state this rank holds."""
        return 4 * sum(buf.layout.size for buf in self.slots.values())

    def step(self, lr: float, after=None, grad_scale: float = 1.0, gate=None) -> None:
        """One update of every piece; ``after(i)``, when given, runs once piece i is updated (ZeRO's
        all-gather of that bucket starts there, while the next piece updates). ``grad_scale``: the clipping
        factor, applied by the update kernel as it reads each gradient (no pass of its own over the buffer).
        ``gate``: a device backend's ``clip_gate`` array, the clipping factor and skip decision made on the
        device (a skipped update changes nothing; the caller then takes back the step count)."""
        self.step_count += 1
        gated = {} if gate is None else {"gate": gate}
        at = 0
        for i, (a, b) in enumerate(self.pieces):
            if self._decay[i] is not None:  # several runs: one update over the piece
                self._update(lr, slice(a, b), slice(at, at + b - a), self._decay[i], grad_scale, gated)
            else:
                for lo, hi, decay in self._runs[i]:  # one run, or none (a ZeRO chunk can be empty)
                    self._update(lr, slice(lo, hi), slice(at + lo - a, at + hi - a), decay, grad_scale, gated)
            if after is not None:
                after(i)
            at += b - a

    def _update(self, lr: float, where: slice, state: slice, decay, grad_scale: float, gated: dict) -> None:
        """One fused kernel over the parameters ``where`` and the slots' values ``state`` (``decay``: a number, or
        the backend's ``decay_table`` of the runs in ``where``)."""
        be, c = self.backend, self.cfg
        p, g = self.params.data[where], self.grads.data[where]
        if self.name == "sgd":
            buf = self.slots["momentum_buffer"].data[state] if self.slots else p  # unused without momentum
            be.sgd_update(p, g, buf, lr=lr, momentum=c.momentum, weight_decay=decay, nesterov=c.nesterov,
                          grad_scale=grad_scale, **gated)
        else:
            be.adam_update(p, g, self.slots["exp_avg"].data[state], self.slots["exp_avg_sq"].data[state], lr=lr,
                           beta1=c.betas[0], beta2=c.betas[1], eps=c.eps, weight_decay=decay,
                           step=self.step_count, decoupled=self.name == "adamw", grad_scale=grad_scale, **gated)

    # a gradient whose norm stays below this cannot overflow the float32 state in one update (checked exactly
    # only above it: ``overflow``); Adam squares it, SGD's momentum adds it
    SAFE_NORM = {"sgd": 1e37, "adam": 1.8e19, "adamw": 1.8e19}

    def overflow(self, grad_scale: float = 1.0) -> tuple[str, str, float]:
        """Whether this rank's next update (``step(lr, grad_scale=...)``) would overflow its float32 state:
        ``(tensor, slot, largest |g|)`` of the first piece where it would (names from the parameters' layout),
        else ``("", "", 0.0)``. The update's
        own arithmetic, in numpy on host copies, a block at a time; called only when the gradient norm passes
        ``SAFE_NORM``, so it costs nothing on a healthy run."""
        import numpy as np

        c, f32 = self.cfg, np.float32
        host = {k: self.backend.to_host(b.data) for k, b in self.slots.items()}
        p_all, g_all = self.backend.to_host(self.params.data), self.backend.to_host(self.grads.data)
        at = 0
        with np.errstate(over="ignore", invalid="ignore"):
            for a, b in self.pieces:
                for lo in range(a, b, 1 << 20):
                    hi = min(b, lo + (1 << 20))
                    g, p = g_all[lo:hi] * f32(grad_scale), p_all[lo:hi]
                    state = slice(at + lo - a, at + hi - a)
                    if self.name == "sgd":
                        d = g + f32(self.weight_decay) * p
                        slot = "momentum_buffer"
                        new = f32(c.momentum) * host[slot][state] + d if self.slots else d
                    else:
                        d = g + (f32(self.weight_decay) * p if self.name == "adam" else f32(0))
                        slot = "exp_avg_sq"
                        new = f32(c.betas[1]) * host[slot][state] + f32(1.0 - c.betas[1]) * d * d
                    if not np.isfinite(new).all():
                        i = lo + int(np.argmax(~np.isfinite(new)))
                        name = next((s.name for s in self.params.layout if s.offset <= i < s.end), "?")
                        return name, slot if self.slots else "update", float(np.abs(g).max())
                at += b - a  # the next piece's optimizer state follows this one's
        return "", "", 0.0

    def warm_up(self) -> None:
        """Compile the update kernel now (or load it from numba's disk cache), with one step on one-element
        scratch buffers: a parameter server's first update would otherwise hold up every worker."""
        layout = ParamLayout([("scratch", (1,))])
        be = self.backend
        Optimizer(self.cfg, be, FlatBuffer(be, layout), FlatBuffer(be, layout)).step(0.0)


def decay_runs(layout: ParamLayout, a: int, b: int, min_ndim: int, weight_decay: float) -> list:
    """[a, b) of the flat buffer as runs (lo, hi, weight decay): ``weight_decay`` on the tensors of at least
    ``min_ndim`` dimensions, 0 on the others, adjacent runs with the same decay merged (the layout's tensors
    tile the buffer, so the runs cover [a, b))."""
    if b <= a:
        return []
    if min_ndim <= 0 or weight_decay == 0:
        return [(a, b, weight_decay)]
    runs = []
    for spec in layout:
        lo, hi = max(a, spec.offset), min(b, spec.end)
        if hi <= lo:
            continue
        decay = weight_decay if len(spec.shape) >= min_ndim else 0.0
        if runs and runs[-1][1] == lo and runs[-1][2] == decay:
            runs[-1] = (runs[-1][0], hi, decay)
        else:
            runs.append((lo, hi, decay))
    return runs or [(a, b, weight_decay)]


def make_optimizer(cfg, backend, params, grads, *, pieces=None) -> Optimizer:
    return Optimizer(cfg, backend, params, grads, pieces=pieces)


def lr_at(cfg, step: int, total_steps: int) -> float:
    """Learning rate for 0-based ``step``: linear warmup over ``warmup_steps``, then the schedule.

    Warmup: lr·(step+1)/warmup_steps. After it, with progress p = (step − warmup) /
    max(1, total − warmup): constant lr; cosine min_lr + (lr − min_lr)·½(1 + cos πp); linear
    lr − (lr − min_lr)·p. ``"nanogpt"`` is nanoGPT's get_lr(it) with lr_decay_iters = total: warmup
    lr·(step+1)/(warmup+1), then the cosine from lr to min_lr (min_lr past the end).
    """
    w, lo = cfg.warmup_steps, cfg.min_lr
    if cfg.schedule == "nanogpt":
        if step < w:
            return cfg.lr * (step + 1) / (w + 1)
        if step > total_steps:
            return lo
        ratio = (step - w) / max(1, total_steps - w)
        return lo + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.lr - lo)
    if step < w:
        return cfg.lr * (step + 1) / w
    p = min(1.0, (step - w) / max(1, total_steps - w))
    if cfg.schedule == "cosine":
        return lo + (cfg.lr - lo) * 0.5 * (1.0 + math.cos(math.pi * p))
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - lo) * p
    return cfg.lr


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when that is below 1."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
