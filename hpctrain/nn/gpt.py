"""A GPT-style decoder as a model spec: nanoGPT's ``GPT``, unit by unit.

Units, each one layer of the spec and so a place where pipeline stages may be cut:

    0          Embedding   transformer.wte.weight (vocab, C), transformer.wpe.weight (block_size, C)
    1 .. L     Block       transformer.h.<i>.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}
    L + 1      Head        transformer.ln_f, then logits = ln_f(x) · wteᵀ (tied: no lm_head.weight)

With ``bias = false`` (nanoGPT's option) no Linear or LayerNorm has a bias, and the
names ending in ``.bias`` are absent.

Activations between units are (B·T, C) rows: T = block_size positions per sample, every
sample a full window. The embedding takes token ids (B, T) int64; the head returns logits
(B·T, vocab) for the cross-entropy over every position. Parameter names, shapes, formulas
and initial distributions are nanoGPT's, so a checkpoint's ``/params`` loads into its
``GPT`` with ``load_state_dict(..., strict=False)`` (docs/gpt.md).

The head ties ``transformer.wte.weight``: on one stage both layers share the tensor (the
embedding's backward runs last and adds to the head's gradient); across stages the last one
holds a replica and the two sum their gradients (nn/model.py, train/step.py).

``model.dropout`` = p drops where nanoGPT does (``transformer.drop`` after the embedding, ``attn_dropout`` on
the probabilities, ``resid_dropout`` and the MLP's ``dropout`` on the two residual branches) in training only,
with masks every layout draws alike (nn/dropout.py); a layer's forward then takes the micro-batch's
``DropoutKey`` (None: evaluation, no dropout) and saves the draws its backward redraws.

Under tensor parallelism every layer is split (``split(tp)``): the blocks Megatron's way, the
embedding and the head by vocabulary (``VocabParallelEmbedding``, ``VocabParallelHead``: a block of
wte's rows per rank, uneven when tp does not divide the vocabulary), so the [rows, vocab] logits are
never whole on one rank and the loss is ``VocabParallelCrossEntropy`` (nn/loss.py).
"""

from __future__ import annotations

import copy
import math

import numpy as np

from ..errors import ConfigError
from .dropout import SITES_PER_LAYER
from .layers import GELU, Layer, LayerNorm, Linear
from .model import ModelSpec
from ..parallel.tensor import CopyToTensorParallel, ReduceFromTensorParallel
from ..shards import row_block
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear

__all__ = ["GPTSpec", "Embedding", "Block", "Head", "CausalSelfAttention", "VocabParallelEmbedding",
           "VocabParallelHead"]

INIT_STD = 0.02  # nanoGPT: normal(0, 0.02) for Linear and Embedding weights


def _normal(rng, shape, std):
    return (rng.standard_normal(shape) * std).astype(np.float32)


class Embedding(Layer):
    """x[b·T + t] = wte[idx[b, t]] + wpe[t]."""

    def split(self, tp) -> "Embedding":
        return VocabParallelEmbedding(self, tp)

    def __init__(self, vocab_size: int, block_size: int, n_embd: int, dropout: float = 0.0):
        self.params = (("wte.weight", (vocab_size, n_embd)), ("wpe.weight", (block_size, n_embd)))
        self.in_features, self.out_features = block_size, n_embd
        self.dropout = dropout  # transformer.drop; site 0

    def init(self, rng):
        return {name: _normal(rng, shape, INIT_STD) for name, shape in self.params}

    def flops(self) -> int:
        return 2 * self.out_features  # a row gathered and a position added: the tables' size costs nothing

    def forward(self, be, idx, key=None):
        B, T = idx.shape
        out = be.empty((B * T, self.out_features))
        be.embedding_forward(idx, self.w["wte.weight"], self.w["wpe.weight"], out)
        return out, (idx, self._drop(be, out, key, T))

    def _drop(self, be, out, key, T):
        """transformer.drop on out, in place; returns the draw for the backward (None: no dropout)."""
        draw = key.rows(self.dropout, 0, T) if key is not None and self.dropout else None
        if draw is not None:
            be.dropout(out, out, draw)
        return draw

    def backward(self, be, dout, saved, accumulate=False, need_dinp=True):
        idx, draw = saved
        if draw is not None:  # the gradient through the forward's mask
            dropped = be.empty(dout.shape)
            be.dropout(dout, dropped, draw)
            dout = dropped
        be.embedding_backward(dout, idx, self.g["wte.weight"], self.g["wpe.weight"],
                              accumulate_wte=accumulate or "wte.weight" in self.accumulating,
                              accumulate_wpe=accumulate, **self._vocab_args())
        return None  # token ids have no gradient

    def _vocab_args(self) -> dict:
        return {}

    def backward_input(self, be, dout, saved, accumulate=False, need_dinp=True):
        """B: nothing (token ids have no gradient); the tables' gradients are all W's, so the first stage's B
        is its blocks' alone and the zero-bubble schedule can fill its bubble with the embedding's scatter-add."""
        return None, (dout, saved)

    def backward_weight(self, be, wsaved, accumulate=False):
        self.backward(be, *wsaved, accumulate=accumulate)


class VocabParallelEmbedding(Embedding):
    """Tensor-parallel rank ``tp.rank``'s block of the token table (Megatron's VocabParallelEmbedding): wte rows
    [lo, lo + n) of the vocabulary (``shards.py: row_block``, uneven when tp does not divide it), wpe
    whole. Each rank looks up the ids of its block (a zero row for the others), rank 0 adds the positions, and
    one Allreduce sums the rows: every id is one rank's, so the sum is the single-process value bit for bit."""

    def __init__(self, full: Embedding, tp):
        vocab, C = full.params[0][1]
        self.lo, n = row_block(vocab, tp.size, tp.rank)
        self.vocab, self.tp, self.reduce = vocab, tp, ReduceFromTensorParallel(tp)
        self.vocab_rows = (self.lo, self.lo + n, vocab)  # the ids of this rank's block, of the vocabulary
        self.params = (("wte.weight", (n, C)), full.params[1])
        self.in_features, self.out_features = full.in_features, full.out_features
        self.shards = {"wte.weight": "rows"}
        self.dropout = full.dropout

    def forward(self, be, idx, key=None):
        B, T = idx.shape
        out = be.empty((B * T, self.out_features))
        be.embedding_forward(idx, self.w["wte.weight"], self.w["wpe.weight"], out, vocab_start=self.lo,
                             vocab=self.vocab, add_positions=self.tp.rank == 0)
        out = self.reduce.forward(be, out)
        return out, (idx, self._drop(be, out, key, T))  # whole rows after the sum: every rank the same mask

    def _vocab_args(self) -> dict:
        return dict(vocab_start=self.lo, vocab=self.vocab)


class CausalSelfAttention(Layer):
    """The attention between nanoGPT's c_attn and c_proj: (B·T, 3C) q, k, v -> (B·T, C), no parameters.

    Heads [head0, head0 + n_head) of the model's ``n_head_total`` (a tensor-parallel rank's); ``dropout``:
    attn_dropout on the probabilities, drawn at ``site`` by each head's index in the whole model.
    ``attention`` (model.attention): "math" keeps the probabilities att[B, H, T, T] for the backward pass,
    "flash" only each row's log-sum-exp lse[B, H, T] and the output (which c_proj keeps anyway), and the
    backward recomputes the probabilities: no tensor of T² per head outlives a kernel."""

    def __init__(self, block_size: int, n_head: int, *, dropout: float = 0.0, site: int = 0, head0: int = 0,
                 n_head_total: int | None = None, attention: str = "math"):
        self.T, self.n_head, self.dropout, self.site = block_size, n_head, dropout, site
        self.head0, self.n_head_total = head0, n_head if n_head_total is None else n_head_total
        self.flash = attention == "flash"

    def forward(self, be, qkv, key=None):
        B, C = qkv.shape[0] // self.T, qkv.shape[1] // 3
        draw = (key.attention(self.dropout, self.site, self.T, self.head0, self.n_head, self.n_head_total)
                if key is not None and self.dropout else None)
        out = be.empty((B * self.T, C))
        if self.flash:
            lse = be.empty((B, self.n_head, self.T))
            be.flash_attention_forward(qkv, self.T, self.n_head, out, lse, dropout=draw)
            return out, (be.product_input(qkv), (out, lse), draw)
        att = be.empty((B, self.n_head, self.T, self.T))
        be.attention_forward(qkv, self.T, self.n_head, out, att, dropout=draw)
        return out, (be.product_input(qkv), att, draw)  # the backward reads q, k and v in products only

    def scratch_bytes(self, rows: int, device: bool) -> int:
        """The largest scratch of either pass. math: the backward's datt and dscores [B, H, T, T] on the CPU; on a
        GPU dscores, and the dropped probabilities with dropout. flash: a few heads' [T, T] on the CPU (two
        arrays, three with dropout: backend/cpu/attention.py), a float per row on a GPU."""
        B, H, T = rows // self.T, self.n_head, self.T
        if self.flash:
            if device:
                return B * H * T * 4
            from ..backend.cpu.attention import heads_at_once

            return (3 if self.dropout else 2) * heads_at_once(H, T) * T * T * 4
        return (2 if self.dropout or not device else 1) * B * H * T * T * 4

    def backward(self, be, dout, saved, accumulate=False, need_dinp=True):
        qkv, kept, draw = saved
        dqkv = be.empty(qkv.shape)
        if self.flash:
            out, lse = kept
            be.flash_attention_backward(dout, qkv, out, lse, self.T, self.n_head, dqkv, dropout=draw)
        else:
            be.attention_backward(dout, qkv, kept, self.T, self.n_head, dqkv, dropout=draw)
        return dqkv


class Block(Layer):
    """x + attn(ln_1(x)), then + mlp(ln_2(·)): nanoGPT's pre-LayerNorm ``Block``; with ``dropout``, its
    attn_dropout, resid_dropout and the MLP's dropout, drawn at the sites of layer ``index`` (nn/dropout.py)."""

    def __init__(self, n_embd: int, n_head: int, block_size: int, n_layer: int, bias: bool = True,
                 dropout: float = 0.0, index: int = 1, attention: str = "math"):
        C = n_embd
        self.dropout, self.site = dropout, SITES_PER_LAYER * index
        self._assemble((("ln_1.", LayerNorm(C, bias=bias)), ("attn.c_attn.", Linear(C, 3 * C, bias)),
                        ("attn.c_proj.", Linear(C, C, bias)), ("ln_2.", LayerNorm(C, bias=bias)),
                        ("mlp.c_fc.", Linear(C, 4 * C, bias)), ("mlp.c_proj.", Linear(4 * C, C, bias))),
                       CausalSelfAttention(block_size, n_head, dropout=dropout, site=self.site, attention=attention))
        self.in_features = self.out_features = C
        self.residual_std = INIT_STD / math.sqrt(2 * n_layer)  # nanoGPT's c_proj.weight special case

    def flops(self) -> int:
        C = self.in_features
        return super().flops() + 2 * self.attn.T * C  # q·kᵀ and att·v: 2·T·C each, half of it under the mask

    def scratch_bytes(self, rows: int, device: bool) -> int:
        return self.attn.scratch_bytes(rows, device)

    def _assemble(self, subs, attn):
        self.subs, self.attn, self.gelu = subs, attn, GELU(after_product=True, before_product=True)  # c_fc to c_proj
        self.ln_1, self.c_attn, self.attn_proj, self.ln_2, self.c_fc, self.mlp_proj = (sub for _, sub in subs)
        self.params = tuple((prefix + name, shape) for prefix, sub in subs for name, shape in sub.params)
        self.shards = {prefix + name: kind for prefix, sub in subs for name, kind in getattr(sub, "shards", {}).items()}

    def split(self, tp) -> "Block":
        """This block as tensor-parallel rank ``tp.rank`` of ``tp.size`` runs it (Megatron's split): c_attn
        column parallel by heads (its q, k and v rows of this rank's heads), attention over those heads,
        c_proj row parallel; c_fc column and mlp.c_proj row parallel; LayerNorms replicated."""
        local = copy.copy(self)  # its own LayerNorms too: they are bound to this part's views
        local._assemble((("ln_1.", copy.copy(self.ln_1)),
                         ("attn.c_attn.", ColumnParallelLinear(self.c_attn, tp, groups=3)),
                         ("attn.c_proj.", RowParallelLinear(self.attn_proj, tp)), ("ln_2.", copy.copy(self.ln_2)),
                         ("mlp.c_fc.", ColumnParallelLinear(self.c_fc, tp)),
                         ("mlp.c_proj.", RowParallelLinear(self.mlp_proj, tp))),
                        CausalSelfAttention(self.attn.T, self.attn.n_head // tp.size, dropout=self.dropout,
                                            site=self.site, head0=tp.rank * (self.attn.n_head // tp.size),
                                            n_head_total=self.attn.n_head,
                                            attention="flash" if self.attn.flash else "math"))
        return local

    def init(self, rng):
        out = {}
        for prefix, sub in self.subs:
            if isinstance(sub, LayerNorm):
                out.update({prefix + k: v for k, v in sub.init(rng).items()})
                continue
            std = self.residual_std if prefix.endswith("c_proj.") else INIT_STD
            out[prefix + "weight"] = _normal(rng, (sub.out_features, sub.in_features), std)
            if sub.has_bias:
                out[prefix + "bias"] = np.zeros(sub.out_features, np.float32)
        return out

    def bind(self, weights, grads, accumulating=frozenset()):
        super().bind(weights, grads, accumulating)
        for prefix, sub in self.subs:
            names = [name for name, _ in sub.params]
            sub.bind({n: weights[prefix + n] for n in names}, {n: grads[prefix + n] for n in names})

    def forward(self, be, x, key=None):
        """The residual branches' outputs are dropped (resid_dropout, the MLP's dropout) before they are added;
        the row-parallel c_proj's output is whole after its sum, so every tensor-parallel rank draws alike."""
        resid = self._residual_draws(key)
        h, s_ln1 = self.ln_1.forward(be, x, for_product=True)
        qkv, s_attn_in = self.c_attn.forward(be, h)
        a, s_attn = self.attn.forward(be, qkv, key)
        del qkv  # under bf16 attention keeps its own bfloat16 copy: the float32 one goes now
        x2, s_proj = self.attn_proj.forward(be, a)
        _drop(be, x2, resid[0])
        h2, s_ln2 = self.ln_2.forward_residual(be, x2, x, for_product=True)  # the first residual (x2 += x)
        f, s_fc = self.c_fc.forward(be, h2)
        g, s_gelu = self.gelu.forward(be, f)
        del f  # likewise GELU's input
        out, s_mlp = self.mlp_proj.forward(be, g)
        _drop(be, out, resid[1])
        be.add_(out, x2)  # the second residual
        return out, (s_ln1, s_attn_in, s_attn, s_proj, s_ln2, s_fc, s_gelu, s_mlp, resid)

    def _residual_draws(self, key):
        """(attention branch's draw, MLP branch's draw), or (None, None) without dropout."""
        if key is None or not self.dropout:
            return None, None
        return tuple(key.rows(self.dropout, self.site + k, self.attn.T) for k in (1, 2))

    def backward(self, be, dout, saved, accumulate=False, need_dinp=True):
        s_ln1, s_attn_in, s_attn, s_proj, s_ln2, s_fc, s_gelu, s_mlp, resid = saved
        acc = dict(accumulate=accumulate)
        dg = self.mlp_proj.backward(be, _through(be, dout, resid[1]), s_mlp, **acc)
        df = self.gelu.backward(be, dg, s_gelu)
        dh2 = self.c_fc.backward(be, df, s_fc, **acc)
        dx2 = self.ln_2.backward_residual(be, dh2, s_ln2, dout, **acc)  # + dout: the residual's gradient
        da = self.attn_proj.backward(be, _through(be, dx2, resid[0]), s_proj, **acc)
        dqkv = self.attn.backward(be, da, s_attn)
        dh = self.c_attn.backward(be, dqkv, s_attn_in, **acc)
        dx = self.ln_1.backward_residual(be, dh, s_ln1, dx2, **acc)  # + dx2: the first residual's gradient
        return dx

    def backward_input(self, be, dout, saved, accumulate=False, need_dinp=True):
        """B: ``backward`` with each Linear's weight gradient left for W (the LayerNorms write theirs here)."""
        s_ln1, s_attn_in, s_attn, s_proj, s_ln2, s_fc, s_gelu, s_mlp, resid = saved
        acc = dict(accumulate=accumulate)
        dg, w_mlp = self.mlp_proj.backward_input(be, _through(be, dout, resid[1]), s_mlp, **acc)
        df = self.gelu.backward(be, dg, s_gelu)
        dh2, w_fc = self.c_fc.backward_input(be, df, s_fc, **acc)
        dx2 = self.ln_2.backward_residual(be, dh2, s_ln2, dout, **acc)  # + dout: the residual's gradient
        da, w_proj = self.attn_proj.backward_input(be, _through(be, dx2, resid[0]), s_proj, **acc)
        dqkv = self.attn.backward(be, da, s_attn)
        dh, w_attn = self.c_attn.backward_input(be, dqkv, s_attn_in, **acc)
        dx = self.ln_1.backward_residual(be, dh, s_ln1, dx2, **acc)  # + dx2: the first residual's gradient
        return dx, (w_mlp, w_fc, w_proj, w_attn)

    def backward_weight(self, be, wsaved, accumulate=False):
        for sub, ws in zip((self.mlp_proj, self.c_fc, self.attn_proj, self.c_attn), wsaved):
            sub.backward_weight(be, ws, accumulate=accumulate)


def _drop(be, x, draw) -> None:
    """Dropout on x in place (nothing when ``draw`` is None)."""
    if draw is not None:
        be.dropout(x, x, draw)


def _through(be, dout, draw):
    """The gradient through a dropout: dout itself without one, else a new array (dout is still needed)."""
    if draw is None:
        return dout
    out = be.empty(dout.shape)
    be.dropout(dout, out, draw)
    return out


class Head(Layer):
    """logits = ln_f(x) · wteᵀ: the final LayerNorm and the LM head tied to the token embedding."""

    def __init__(self, vocab_size: int, n_embd: int, bias: bool = True):
        self.ln_f = LayerNorm(n_embd, bias=bias)
        self.params = tuple(("ln_f." + name, shape) for name, shape in self.ln_f.params)
        self.ties = (("wte.weight", (vocab_size, n_embd)),)
        self.in_features, self.out_features = n_embd, vocab_size

    def split(self, tp) -> "Head":
        return VocabParallelHead(self, tp)

    def init(self, rng):
        return {"ln_f." + k: v for k, v in self.ln_f.init(rng).items()}

    def flops(self) -> int:
        return super().flops() + 2 * self.in_features * self.out_features  # the logits through the tied wte

    def bind(self, weights, grads, accumulating=frozenset()):
        super().bind(weights, grads, accumulating)
        names = [name for name, _ in self.ln_f.params]
        self.ln_f.bind({n: weights["ln_f." + n] for n in names}, {n: grads["ln_f." + n] for n in names})

    def forward(self, be, x):
        h, s_ln = self.ln_f.forward(be, x, for_product=True)
        h = be.product_input(h)  # what the table's products read and the backward keeps (under bf16: h itself)
        logits = be.empty((x.shape[0], self.out_features))
        be.matmul_nt(h, self.w["wte.weight"], logits)
        return logits, (s_ln, h)

    def backward(self, be, dlogits, saved, accumulate=False, need_dinp=True):
        dx, wsaved = self.backward_input(be, dlogits, saved, accumulate=accumulate)
        self.backward_weight(be, wsaved, accumulate=accumulate)
        return dx

    def backward_input(self, be, dlogits, saved, accumulate=False, need_dinp=True):
        """B: the input gradient through the tied table and ln_f (which writes its own gradients here); the
        table's gradient dlogitsᵀ·h is W's, as a Linear's weight gradient is."""
        s_ln, h = saved
        dh = be.empty(h.shape)
        be.matmul_nn(dlogits, self.w["wte.weight"], dh)
        return self.ln_f.backward(be, self._summed(be, dh), s_ln, accumulate=accumulate), (dlogits, h)

    def backward_weight(self, be, wsaved, accumulate=False):
        dlogits, h = wsaved
        be.matmul_tn(dlogits, h, self.g["wte.weight"], accumulate=accumulate or "wte.weight" in self.accumulating)

    def _summed(self, be, dh):
        """The input gradient over the whole vocabulary (one table here: already whole)."""
        return dh


class VocabParallelHead(Head):
    """Tensor-parallel rank ``tp.rank``'s columns of the logits: ln_f(x) · wte[lo : lo + n]ᵀ through its block of
    the tied table (the embedding's ``row_block``). The logits stay split into the loss (nn/loss.py:
    ``VocabParallelCrossEntropy``, ``vocab_shard``); the input gradient, a sum over the blocks, is one Allreduce
    (``CopyToTensorParallel``)."""

    def __init__(self, full: Head, tp):
        vocab, C = full.ties[0][1]
        self.lo, n = row_block(vocab, tp.size, tp.rank)
        self.ln_f, self.params, self.copy = copy.copy(full.ln_f), full.params, CopyToTensorParallel(tp)
        self.ties = (("wte.weight", (n, C)),)
        self.in_features, self.out_features = C, n
        self.shards = {"wte.weight": "rows"}
        self.vocab_shard = (tp, self.lo, vocab)  # what the loss needs to see the whole row
        self.vocab_rows = (self.lo, self.lo + n, vocab)

    def _summed(self, be, dh):
        return self.copy.backward(be, dh)  # each rank's block of the vocabulary: one Allreduce sums them


class GPTSpec(ModelSpec):
    """nanoGPT's GPT from a ``[model] kind = "gpt"`` config: embedding, ``n_layer`` blocks, head."""

    input_dtype = np.int64
    unit_text = "the embedding, each transformer block, the final LayerNorm with the head"

    def __init__(self, *, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, bias=True,
                 dropout: float = 0.0, attention: str = "math"):
        if n_embd % n_head:
            raise ConfigError(f"model.n_embd = {n_embd} is not divisible by model.n_head = {n_head}")
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1), got {dropout}")
        if attention not in ("math", "flash"):
            raise ConfigError(f'model.attention: expected "math" or "flash", got {attention!r}')
        self.config = dict(vocab_size=vocab_size, block_size=block_size, n_layer=n_layer, n_head=n_head,
                           n_embd=n_embd, bias=bias, dropout=dropout, attention=attention)
        self.positions, self.vocab_size, self.block_size = block_size, vocab_size, block_size
        layers = ([Embedding(vocab_size, block_size, n_embd, dropout)]
                  + [Block(n_embd, n_head, block_size, n_layer, bias, dropout, index=1 + i, attention=attention)
                     for i in range(n_layer)]
                  + [Head(vocab_size, n_embd, bias)])
        prefixes = ["transformer."] + [f"transformer.h.{i}." for i in range(n_layer)] + ["transformer."]
        widths = [n_embd] * (n_layer + 1) + [vocab_size]
        self._setup(layers, prefixes, widths, block_size, [(i, i) for i in range(len(layers))])

    def training_flops(self) -> int:
        """nanoGPT's ``estimate_mfu`` (PaLM's appendix B): 6 FLOPs per non-embedding parameter and 12·L·C·T for
        attention's two products, per token, over the ``block_size`` tokens of a sample. The position table is
        not counted (a lookup); the token table is, as the head it is tied to."""
        c = self.config
        L, C, T = c["n_layer"], c["n_embd"], c["block_size"]
        N = self.layout.size - self.layout["transformer.wpe.weight"].size
        return (6 * N + 12 * L * C * T) * T

    def check_tp(self, tp: int) -> None:
        H, V = self.config["n_head"], self.config["vocab_size"]
        if tp > 1 and H % tp:
            raise ConfigError(f"parallel.tp = {tp}: model.n_head = {H} is not divisible by it (each rank keeps whole "
                              "attention heads)")
        if tp > V:
            raise ConfigError(f"parallel.tp = {tp} is more ranks than model.vocab_size = {V} has tokens (each rank "
                              "keeps a block of the vocabulary)")

    def tp_layer(self, i: int, tp):
        """Layer ``i`` as tensor-parallel rank ``tp.rank`` runs it: every layer is split (the embedding and the
        head by vocabulary, the blocks Megatron's way), so no tensor but the LayerNorms and wpe is whole."""
        return self.layers[i].split(tp)

    @classmethod
    def from_config(cls, model_cfg) -> "GPTSpec":
        m = model_cfg
        return cls(vocab_size=m.vocab_size, block_size=m.block_size, n_layer=m.n_layer, n_head=m.n_head,
                   n_embd=m.n_embd, bias=m.bias, dropout=m.dropout, attention=m.attention)


def make_model(model_cfg) -> ModelSpec:
    """The model spec of a ``[model]`` config: the ``layers`` MLP, or the GPT."""
    return GPTSpec.from_config(model_cfg) if model_cfg.kind == "gpt" else ModelSpec(model_cfg.layers)
