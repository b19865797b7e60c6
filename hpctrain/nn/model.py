"""A model as a spec of partition units, and the part of it one pipeline stage (and tp rank) runs.

``ModelSpec`` is the whole model: its layers, the width after each, and one global,
unsharded parameter layout, named as PyTorch would (the MLP of ``model.layers`` like
``torch.nn.Sequential.state_dict()``: ``"0.weight"``, ``"0.bias"``, ``"2.weight"``; the
GPT of nn/gpt.py like nanoGPT: ``"transformer.h.0.attn.c_attn.weight"``). Each layer has a
name prefix; prefix + a layer's parameter name is the global name. Checkpoints hold these
names and ranks hash this layout. A layer may *tie* a tensor another layer owns (the GPT's
head uses the token embedding); the global layout holds it once.

A partition unit is a range of layers pipeline stages are never cut inside: for the MLP a
layer with parameters (Linear, LayerNorm) with the parameter-free activations after it, for
the GPT the embedding, each block, the head. Stages are cut between units by default
(balanced by estimated FLOPs per row, ``ModelSpec.flops``), or where the user says with
``parallel.stages``; under
tensor parallelism a column/row-parallel pair is one unit.

``ModelPart`` owns a contiguous range of layers, as one tensor-parallel rank runs them: its
own local layout and flat buffers (the tensors its layers own, this rank's shard of each
split one, in the global order: one contiguous range of the global flat buffer,
``global_range``; then a replica of any tied tensor another part owns), the map from its
local names to the global ones, and how each split tensor is cut (``shards``).

    spec = ModelSpec(cfg.model.layers)
    part = spec.part(*spec.partition(pp=2)[stage])
"""

from __future__ import annotations

import contextlib

import numpy as np

from ..errors import ConfigError, LayoutError
from ..layer_kinds import BUILTIN, registered
from ..shards import shard
from ..params import FlatBuffer, ParamLayout
from .checked import CheckedLayer
from .layers import LayerNorm, Linear, Activation, make_layer
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear

__all__ = ["ModelSpec", "ModelPart", "UnitInputs"]


class ModelSpec:
    """The whole model: layers, widths, units and the global parameter layout (no buffers).

    ``ModelSpec(cfg.model.layers)`` is the MLP of ``model.layers``; ``GPTSpec`` (nn/gpt.py) is the
    transformer. Both set, through ``_setup``: ``layers``, ``prefixes`` (a layer's local parameter
    name + its prefix = the global name), ``widths`` (after each layer), ``units``, ``layout`` (the
    tensors each layer owns, in layer order) and ``tied_by`` (a global name -> the layers that use it
    without owning it). ``positions`` is the number of activation rows per sample (1 for the MLP, the
    context length for the GPT); ``input_dtype`` what the first layer takes.
    """

    positions = 1
    input_dtype = np.float32

    def __init__(self, layer_specs):
        layer_specs = list(layer_specs)
        layers = [make_layer(spec) for spec in layer_specs]
        widths = []  # the width after each layer
        width = None
        for i, layer in enumerate(layers):
            if layer.in_features is not None and width is not None and layer.in_features != width:
                key = "dim" if isinstance(layer, LayerNorm) else "in"
                raise ConfigError(f"model.layers[{i}].{key} = {layer.in_features} does not match the previous "
                                  f"output width {width}")
            if layer.out_features is not None:
                width = layer.out_features
            widths.append(width)
        first_width = next((l.in_features for l in layers if l.in_features is not None), None)
        if first_width is None:
            raise ConfigError("model.layers: the model needs at least one linear or layernorm layer to fix its width")
        widths = [w if w is not None else first_width for w in widths]  # leading activations
        for i, spec in enumerate(layer_specs):  # a user's layer: its results checked as it returns them
            kind = registered(spec.type) if spec.type not in BUILTIN else None
            if kind is not None:
                layers[i] = CheckedLayer(layers[i], f"model.layers[{i}] ({spec.type}, plugin {kind.module or '?'})",
                                         widths[i])
        starts = [i for i, layer in enumerate(layers) if layer.params]
        starts[0] = 0  # leading activations join the first unit
        units = [(lo, hi - 1) for lo, hi in zip(starts, starts[1:] + [len(layers)])]
        for i in range(1, len(layers)):  # an activation right after a Linear keeps its product's output as such
            if isinstance(layers[i], Activation) and type(layers[i - 1]) is Linear:
                layers[i] = type(layers[i])(after_product=True)
        self._setup(layers, [f"{i}." for i in range(len(layers))], widths, first_width, units)
        self.tp_pairs = _linear_pairs(layers)

    def check_tp(self, tp: int) -> None:
        """ConfigError naming the first Linear pair whose split widths are not divisible by ``tp``."""
        for col, row in self.tp_pairs:
            width = self.layers[col].out_features
            if tp > 1 and width % tp:
                raise ConfigError(f"parallel.tp = {tp}: model.layers[{col}] and [{row}] are a tensor-parallel "
                                  f"pair (column then row parallel) but their inner width {width} is not divisible "
                                  f"by {tp}")

    def tp_layer(self, i: int, tp):
        """Layer ``i`` as tensor-parallel rank ``tp.rank`` of ``tp.size`` runs it (the layer itself when whole)."""
        for col, row in self.tp_pairs:
            if i == col:
                return ColumnParallelLinear(self.layers[i], tp)
            if i == row:
                return RowParallelLinear(self.layers[i], tp)
            if i == row + 1 and getattr(self.layers[i], "after_product", False):
                return type(self.layers[i])()  # a row-parallel Linear's output is a sum over tp, no product's
        return self.layers[i]

    def tp_units(self) -> list[tuple[int, int]]:
        """The units with each tensor-parallel pair's two units merged: a stage cut may not fall inside a pair."""
        units = list(self.units)
        for col, row in self.tp_pairs:
            a = next(k for k, (lo, hi) in enumerate(units) if lo <= col <= hi)
            b = next(k for k, (lo, hi) in enumerate(units) if lo <= row <= hi)
            units[a : b + 1] = [(units[a][0], units[b][1])]
        return units

    def _setup(self, layers, prefixes, widths, in_features, units):
        """Units: inclusive layer ranges, pipeline stages are cut between them (a layer with parameters
        and the parameter-free layers after it; a transformer block)."""
        self.layers, self.prefixes, self.widths, self.units = layers, prefixes, widths, units
        self.in_features, self.out_features = in_features, widths[-1]
        self.layout = ParamLayout((prefix + name, shape) for layer, prefix in zip(layers, prefixes)
                                  for name, shape in layer.params)
        self.tied_by = {}
        for i, (layer, prefix) in enumerate(zip(layers, prefixes)):
            for name, shape in layer.ties:
                if prefix + name not in self.layout or self.layout[prefix + name].shape != tuple(shape):
                    raise LayoutError(f"layer {i} ties {prefix + name} {shape}, which no layer owns with that shape")
                self.tied_by.setdefault(prefix + name, []).append(i)

    tp_pairs: list[tuple[int, int]] = []  # (column-parallel layer, row-parallel layer) when tp > 1

    def width_before(self, layer: int) -> int:
        return self.in_features if layer == 0 else self.widths[layer - 1]

    def param_count(self, lo: int, hi: int) -> int:
        """Parameters layers lo..hi (inclusive) own."""
        return sum(int(np.prod(shape)) for layer in self.layers[lo : hi + 1] for _, shape in layer.params)

    def flops(self, lo: int, hi: int) -> int:
        """Forward FLOPs per row of layers lo..hi (inclusive): what ``partition`` balances."""
        return sum(layer.flops() for layer in self.layers[lo : hi + 1])

    def training_flops(self) -> int:
        """FLOPs one sample's forward and backward cost the model (MFU's numerator, train/mfu.py): the forward's
        FLOPs per row three times over (the backward costs twice the forward: the input and the weight
        gradients), for every row of the sample; for a dense network 6 per weight, the usual 6N."""
        return 3 * self.flops(0, len(self.layers) - 1) * self.positions

    def partition(self, pp: int, stages=(), tp: int = 1, virtual_stages: int = 1) -> list[tuple[int, int]]:
        """Inclusive layer ranges of the ``pp`` stages (``pp × virtual_stages`` virtual stages, in order, for
        interleaved 1F1B's model chunks): ``stages`` when given, else units balanced by their estimated time, the
        FLOPs per row (``flops``: for a dense layer 2 per weight, so an MLP's cut is its parameters'; a GPT's head
        counts its logits product through the tied table, its embedding only a lookup, its blocks their attention
        too).

        With ``tp > 1`` a tensor-parallel pair is one unit: no stage boundary falls inside it."""
        units = self.tp_units() if tp > 1 else self.units
        what = f"parallel.pp = {pp}" if virtual_stages == 1 else \
            f"parallel.pp × parallel.virtual_stages = {pp} × {virtual_stages}"
        pp *= virtual_stages
        if stages:  # checked against the layers when the config was parsed
            if len(stages) != pp:
                raise ConfigError(f"parallel.stages lists {len(stages)} stage(s) but {what}")
            for s, (lo, hi) in enumerate(stages[:-1]):
                inside = [(a, b) for a, b in self.tp_pairs if a <= hi < b] if tp > 1 else []
                if inside:
                    raise LayoutError(f"parallel.stages[{s}] ends at layer {hi}, inside layers {inside[0][0]}.."
                                      f"{inside[0][1]}: a tensor-parallel pair (column then row parallel) must stay "
                                      "on one stage")
            return [tuple(r) for r in stages]
        if pp > len(units):
            merged = "; with tp > 1 a column/row-parallel pair is one unit" if len(units) < len(self.units) else ""
            raise LayoutError(f"{what} is more stages than the model has partition units "
                              f"({len(units)}: {self.unit_text}{merged})")
        return _balanced([self.flops(lo, hi) for lo, hi in units], units, pp)

    unit_text = "a linear or layernorm layer with the activations after it"

    def init_params(self, seed: int) -> dict[str, np.ndarray]:
        """Every initial parameter: layer i's from its own stream (``init_layer``)."""
        out = {}
        for i in range(len(self.layers)):
            out.update(self.init_layer(i, seed))
        return out

    def init_layer(self, i: int, seed: int) -> dict[str, np.ndarray]:
        """Layer i's initial tensors by global name, from a numpy generator seeded with (``seed``, i): one
        stream per layer, so a rank draws only the layers it holds and every layout starts alike."""
        rng = np.random.default_rng([seed, i])
        return {self.prefixes[i] + name: arr for name, arr in self.layers[i].init(rng).items()}

    def owner_of(self, name: str) -> int:
        """The index of the layer that owns global tensor ``name``."""
        return next(i for i, (layer, prefix) in enumerate(zip(self.layers, self.prefixes))
                    if any(prefix + n == name for n, _ in layer.params))

    def part(self, lo: int = 0, hi: int | None = None, tp=None, *, split_ties: bool = False,
             chunks=None) -> "ModelPart":
        """The part running layers lo..hi (inclusive; the whole model by default), as tensor-parallel
        rank ``tp.rank`` of ``tp.size`` (parallel/tensor.py: ``TensorParallel``) when ``tp`` is given;
        ``split_ties``: see ``ModelPart``. ``chunks``: instead of lo..hi, several inclusive layer ranges in
        model order (interleaved 1F1B's model chunks of one stage)."""
        if chunks is not None:
            return ModelPart(self, chunks[0][0], chunks[-1][1], tp, split_ties=split_ties, chunks=chunks)
        return ModelPart(self, lo, len(self.layers) - 1 if hi is None else hi, tp, split_ties=split_ties)


def _linear_pairs(layers) -> list[tuple[int, int]]:
    """(i, j): Linear i, then one or more element-wise activations, then Linear j; each Linear in one pair
    at most (Linear, Linear with nothing between is not a pair: the two would fold into one product)."""
    pairs, i = [], 0
    while i < len(layers):
        if isinstance(layers[i], Linear):
            j = i + 1
            while j < len(layers) and not layers[j].params and not isinstance(layers[j], LayerNorm):
                j += 1
            if j > i + 1 and j < len(layers) and isinstance(layers[j], Linear):
                pairs.append((i, j))
                i = j + 1
                continue
        i += 1
    return pairs


def _balanced(costs: list[int], units: list[tuple[int, int]], parts: int) -> list[tuple[int, int]]:
    """Cut ``units`` into ``parts`` contiguous groups minimising the largest group's cost (linear partition)."""
    n = len(costs)
    prefix = np.concatenate([[0], np.cumsum(costs)])
    INF = float("inf")
    # best[k][i]: the smallest largest-cost of cutting units[:i] into k groups; cut[k][i]: where the last one starts
    best = [[INF] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds, i = [], n
    for k in range(parts, 0, -1):
        bounds.append((cut[k][i], i))
        i = cut[k][i]
    return [(units[a][0], units[b - 1][1]) for a, b in reversed(bounds)]


class ModelPart:
    """Layers lo..hi of a spec with their own local layout; ``bind`` gives them views into flat buffers.

    The local layout is the tensors these layers own, in the global order (one contiguous range of the
    global flat buffer, ``global_range``), then a replica of each tensor a layer here ties to but another
    part owns (the GPT's head on the last stage holds a copy of the first stage's token embedding).
    ``owned_size`` is where the replicas start: gradient norms and checkpoints see only what is owned.
    ``shared`` names the tensors this part holds in common with another part, whose gradients the two
    sum before the optimizer step (the owner's and the replica's alike).

    ``split_ties`` (train.deterministic): a layer tied to a tensor another layer of this same part owns
    gets a local replica too, ``<name>#tie``, so its half of the gradient is summed apart from the owner's
    half and added after the data-parallel sum, as across two stages (``local_ties``: (owner, replica)).

    ``chunks`` (interleaved 1F1B): several inclusive layer ranges in model order, each run on its own
    (``forward``/``backward`` take ``chunk``); the local layout holds their tensors one chunk after another,
    the global order still, so chunk c's slice of the global buffer is ``global_ranges[c]``. Without it the
    part is one chunk, lo..hi.
    """

    def __init__(self, spec: ModelSpec, lo: int, hi: int, tp=None, *, split_ties: bool = False, chunks=None):
        chunks = [(int(a), int(b)) for a, b in (chunks or [(lo, hi)])]
        if any(a > b for a, b in chunks) or any(b >= a2 for (_, b), (a2, _) in zip(chunks, chunks[1:])):
            raise LayoutError(f"model chunks must be non-empty layer ranges in model order, got {chunks}")
        self.spec, self.lo, self.hi, self.tp = spec, chunks[0][0], chunks[-1][1], tp
        indices = [i for a, b in chunks for i in range(a, b + 1)]
        split = tp is not None and tp.size > 1
        self.layers = [spec.tp_layer(i, tp) if split else spec.layers[i] for i in indices]
        self.prefixes = [spec.prefixes[i] for i in indices]
        self.is_first, self.is_last = self.lo == 0, self.hi == len(spec.layers) - 1
        self.in_features, self.out_features = spec.width_before(self.lo), spec.widths[self.hi]
        # chunk c: local layers [start, end] and the widths it takes and gives (its neighbours' messages)
        self.chunk_layers, at = [], 0
        for a, b in chunks:
            self.chunk_layers.append((at, at + b - a))
            at += b - a + 1
        self.chunk_widths = [(spec.width_before(a), spec.widths[b]) for a, b in chunks]
        self.layer_ranges = chunks
        self.positions = spec.positions
        owned = [(prefix + name, shape) for layer, prefix in zip(self.layers, self.prefixes)
                 for name, shape in layer.params]
        owned_names = {name for name, _ in owned}
        replicas, self._tie_names = [], {}  # a tied layer's name -> its local replica's (split_ties)
        for layer, prefix in zip(self.layers, self.prefixes):
            for n, shape in layer.ties:
                name = prefix + n
                if name in owned_names and split_ties:
                    self._tie_names[name] = name + "#tie"
                if name in owned_names and not split_ties:
                    continue
                local = self._tie_names.get(name, name)
                if (local, shape) not in replicas:
                    replicas.append((local, shape))
        self.layout = ParamLayout(owned + replicas)
        self.owned_size = sum(int(np.prod(shape)) for _, shape in owned)
        self.replicas = [name for name, _ in replicas]
        self.local_ties = sorted(self._tie_names.items())  # (owner, its replica on this same part)
        here = set(indices)
        self.shared = [name for name in owned_names if any(i not in here for i in spec.tied_by.get(name, ()))]
        cross = [name for name in self.replicas if name not in self._tie_names.values()]
        self.shared = sorted(self.shared) + sorted(cross)  # the same order on the owner and the replica
        self.global_names = {name: name for name in self.layout.names}  # local -> global
        self.global_names.update({replica: owner for owner, replica in self.local_ties})
        self._by_global = set(self.global_names.values())
        # how each tensor-parallel tensor is cut (shards.py: shard); absent: whole, replicated
        self.shards = {prefix + name: kind for layer, prefix in zip(self.layers, self.prefixes)
                       for name, kind in getattr(layer, "shards", {}).items()}
        # each chunk's slice of the global flat buffer (empty chunks: (0, 0))
        self.global_ranges = []
        for a, b in chunks:
            names = [prefix + n for i in range(a, b + 1) for prefix in (spec.prefixes[i],)
                     for n, _ in spec.layers[i].params]
            self.global_ranges.append((spec.layout[names[0]].offset, spec.layout[names[-1]].end) if names else (0, 0))
        # the partition units inside each chunk, as layer ranges local to the chunk: what recompute keeps
        units = spec.tp_units() if split else spec.units
        self.chunk_units = [[(max(u, a) - a, min(w, b) - a) for u, w in units if u <= b and w >= a] for a, b in chunks]
        self.units = [(x + start, y + start) for (start, _), us in zip(self.chunk_layers, self.chunk_units)
                      for x, y in us]  # all of them, local to the part
        self.recompute = False  # train.recompute = "blocks": keep each unit's input only, recompute in backward
        self._params = None  # the parameters bound (``bind``)
        self.gather = None  # zero = 3: gathers each unit's parameters over dp around its use (parallel/zero3.py)
        # the local offset from which each layer's backward leaves every gradient final; None: it writes none
        # of its own (a tie to a tensor another layer of this part owns and writes later)
        self._first_offset = [self._first_written(layer, prefix) for layer, prefix in zip(self.layers, self.prefixes)]
        # the local [lo, hi) ranges each layer's backward writes gradients into (its own and its ties'), merged:
        # ZeRO-2 gives released memory back to them just before (``on_write``, parallel/grad_pages.py)
        self._writes = [self._written_ranges(layer, prefix) for layer, prefix in zip(self.layers, self.prefixes)]

    def _first_written(self, layer, prefix: str):
        """The lowest local offset of the gradients ``layer`` writes as their owner (None: none)."""
        mine = [prefix + n for n, _ in layer.params] + [self._tie_names.get(prefix + n, prefix + n)
                                                         for n, _ in layer.ties
                                                         if self._tie_names.get(prefix + n, prefix + n)
                                                         in self.replicas]
        return min((self.layout[n].offset for n in mine), default=None)

    def _written_ranges(self, layer, prefix: str) -> list[tuple[int, int]]:
        """The local [lo, hi) ranges ``layer``'s backward writes (its tensors' and its ties'), merged."""
        names = [prefix + n for n, _ in layer.params] + [self._tie_names.get(prefix + n, prefix + n)
                                                         for n, _ in layer.ties]
        spans = sorted((self.layout[n].offset, self.layout[n].end) for n in names)
        merged = []
        for lo, hi in spans:
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        return merged

    @property
    def global_range(self) -> tuple[int, int]:
        """This part's slice of the global flat buffer (one chunk; ``global_ranges`` has each chunk's)."""
        if len(self.global_ranges) != 1:
            raise LayoutError(f"a part of {len(self.global_ranges)} model chunks has no single global range")
        return self.global_ranges[0]

    def describe(self) -> str:
        """"layers 0..3: 1,234 parameters", one range per model chunk ("layers 0..1, layers 4..5: ...")."""
        return ", ".join(f"layers {a}..{b}" for a, b in self.layer_ranges) + f": {self.layout.size:,} parameters"

    def chunk_is_first(self, chunk: int) -> bool:
        """Whether chunk ``chunk`` starts the model (it takes the inputs)."""
        return self.layer_ranges[chunk][0] == 0

    def chunk_is_last(self, chunk: int) -> bool:
        """Whether chunk ``chunk`` ends the model (its output goes to the loss)."""
        return self.layer_ranges[chunk][1] == len(self.spec.layers) - 1

    def init_params(self, seed: int) -> dict[str, np.ndarray]:
        """This part's initial tensors (this rank's shards) by local name: ``init_tensors``, collected."""
        return dict(self.init_tensors(seed))

    def init_tensors(self, seed: int):
        """(local name, initial tensor) of this part, one layer at a time: each layer it holds a tensor of is
        drawn from that layer's own stream (``ModelSpec.init_layer``), whole, and this rank's shard cut from
        it, so every layout starts from the single-process model and a rank holds one layer's draw at most."""
        for i in sorted({self.spec.owner_of(name) for name in self.global_names.values()}):
            full = self.spec.init_layer(i, seed)
            yield from self.local_tensors({n: a for n, a in full.items() if n in self._by_global}, partial=True).items()

    def local_tensors(self, full: dict[str, np.ndarray], partial: bool = False) -> dict[str, np.ndarray]:
        """This part's tensors (this rank's shards) from the full tensors by global name (``partial``: those
        of ``full`` only)."""
        out = {}
        for local, name in self.global_names.items():
            if partial and name not in full:
                continue
            kind = self.shards.get(name)  # a local tie replica is cut as its owner is
            out[local] = full[name] if kind is None else shard(full[name], kind, self.tp.rank, self.tp.size)
        return out

    def norm_ranges(self) -> list[tuple[int, int]]:
        """Local flat ranges whose squares this rank adds to the gradient norm: every shard; a replicated
        tensor on tensor-parallel rank 0 only; never a tied tensor's replica (its owner counts it)."""
        first = self.tp is None or self.tp.rank == 0
        ranges = []
        for s in self.layout:
            if s.offset >= self.owned_size or not (first or s.name in self.shards):
                continue
            if ranges and ranges[-1][1] == s.offset:
                ranges[-1] = (ranges[-1][0], s.end)
            else:
                ranges.append((s.offset, s.end))
        return ranges

    def bind(self, params: FlatBuffer, grads: FlatBuffer) -> None:
        self._params = params
        written = set()  # gradients written by a layer later in this part: its backward runs first
        for layer, prefix in reversed(list(zip(self.layers, self.prefixes))):
            local = {n: prefix + n for n, _ in layer.params}
            local.update({n: self._tie_names.get(prefix + n, prefix + n) for n, _ in layer.ties})
            layer.bind({n: params[k] for n, k in local.items()}, {n: grads[k] for n, k in local.items()},
                       frozenset(n for n, k in local.items() if k in written))
            written.update(local.values())

    def forward(self, be, x, key=None, chunk: int = 0):
        """Return (output, saved) of chunk ``chunk`` (the whole part unless it has several): ``saved`` holds
        what each layer's backward needs, or, with ``recompute``, each unit's input only (a ``UnitInputs``).
        ``key``: the micro-batch's DropoutKey in training (None: evaluation, no dropout), handed to the layers
        that drop."""
        with self._products(be, refresh=chunk == 0):
            return self._forward(be, x, key, chunk)

    def _products(self, be, refresh: bool):
        """The scope in which this part's products read its weights from the backend's bfloat16 copy under bf16
        (backend/product_weights.py), rounded afresh at ``refresh``: the forward of the first chunk, which begins
        each pass of a micro-batch through the part, the parameters then fixed until after its backward. None
        under ZeRO-3, whose units are gathered around their use."""
        if self.gather is not None or self._params is None:
            return contextlib.nullcontext()
        return be.product_weights(self._params.data, refresh)

    def _forward(self, be, x, key, chunk: int):
        start, end = self.chunk_layers[chunk]
        layers = self.layers[start : end + 1]
        if self.recompute:
            inputs = []
            for u, (a, b) in enumerate(self.chunk_units[chunk]):
                inputs.append(x)
                self._gathered(chunk, u, True)
                for layer in layers[a : b + 1]:
                    x, _ = _forward(layer, be, x, key)  # what the layer saved is dropped and rebuilt in backward
                self._gathered(chunk, u, False)
            return x, UnitInputs(inputs, key)
        saved = []
        for u, (a, b) in enumerate(self.chunk_units[chunk]):
            self._gathered(chunk, u, True)
            for layer in layers[a : b + 1]:
                x, s = _forward(layer, be, x, key)
                saved.append(s)
            self._gathered(chunk, u, False)
        return x, saved

    def _gathered(self, chunk: int, u: int, use: bool) -> None:
        """zero = 3 (parallel/zero3.py, ``gather``): unit u of chunk ``chunk``'s full parameters gathered over dp
        before it runs (``use``), released after (collective over dp then); nothing without ZeRO-3."""
        if self.gather is not None:
            k = sum(len(us) for us in self.chunk_units[:chunk]) + u
            self.gather.use(k) if use else self.gather.done(k)

    def backward(self, be, dout, saved, *, accumulate=False, need_dinp=True, on_final=None, on_write=None,
                 chunk: int = 0):
        """Backward of chunk ``chunk`` in reverse layer order; returns the input gradient (None when not
        ``need_dinp``).

        ``on_final(lo)``, when given, runs as soon as every gradient from local flat offset ``lo``
        to the end of the buffer has its final value for this step (the data-parallel sync's cue; with
        chunks, the later chunks' last backwards have run before). ``on_write(ranges)``, when given, runs
        before each layer writes its gradients, with the local [lo, hi) ranges it writes.
        Under recompute each unit's forward runs again from its saved input just before its backward:
        the same kernels on the same values, so the gradients are bitwise those of a stored forward.
        """
        start = self.chunk_layers[chunk][0]
        units = self.chunk_units[chunk]
        with self._products(be, refresh=False):  # one frame: each gradient goes as the next replaces it
            for u in range(len(units) - 1, -1, -1):
                a, b = units[u]
                self._gathered(chunk, u, True)  # zero = 3: before the recomputed forward too
                mine = self._unit_saved(be, saved, u, chunk)
                for k in range(b, a - 1, -1):
                    last = k == 0 and not need_dinp
                    layer = start + k
                    if on_write is not None:
                        on_write(self._writes[layer])
                    dout = self.layers[layer].backward(be, dout, mine[k - a], accumulate=accumulate,
                                                       need_dinp=not last)
                    mine[k - a] = None  # this layer's activations can go now
                    if on_final is not None and self._first_offset[layer] is not None:
                        on_final(self._first_offset[layer])
                self._gathered(chunk, u, False)
        return dout

    def _unit_saved(self, be, saved, u: int, chunk: int = 0) -> list:
        """What unit u of chunk ``chunk`` saved in forward: stored, or rebuilt from the unit's input under
        recompute."""
        a, b = self.chunk_units[chunk][u]
        if not isinstance(saved, UnitInputs):
            return saved[a : b + 1]
        start = self.chunk_layers[chunk][0]
        x, mine = saved.inputs[u], []
        for layer in self.layers[start + a : start + b + 1]:
            x, s = _forward(layer, be, x, saved.key)  # the same dropout draws as the first forward
            mine.append(s)
        return mine

    def backward_input(self, be, dout, saved, *, accumulate=False, need_dinp=True, on_write=None):
        """The zero-bubble schedule's B, in reverse layer order: (input gradient or None, what
        ``backward_weight`` needs per layer). Layers that do not split write their gradients here;
        ``on_write`` as in ``backward``."""
        wsaved = [None] * len(self.layers)
        with self._products(be, refresh=False):
            for u in range(len(self.units) - 1, -1, -1):
                a, b = self.units[u]
                self._gathered(0, u, True)  # zero = 3: B reads the unit's weights (W reads only saved values)
                mine = self._unit_saved(be, saved, u)
                for k in range(b, a - 1, -1):
                    last = k == 0 and not need_dinp
                    if on_write is not None:
                        on_write(self._writes[k])
                    dout, wsaved[k] = self.layers[k].backward_input(be, dout, mine[k - a], accumulate=accumulate,
                                                                    need_dinp=not last)
                    mine[k - a] = None
                self._gathered(0, u, False)
        return dout, wsaved

    def backward_weight(self, be, wsaved, *, accumulate=False, on_final=None, on_write=None):
        """The zero-bubble schedule's W, in reverse layer order; ``on_final`` and ``on_write`` as in ``backward``
        (the step's last W finishes every gradient: the B passes wrote theirs before it)."""
        for k in range(len(self.layers) - 1, -1, -1):
            if wsaved[k] is not None:
                if on_write is not None:
                    on_write(self._writes[k])
                self.layers[k].backward_weight(be, wsaved[k], accumulate=accumulate)
                wsaved[k] = None
            if on_final is not None and self._first_offset[k] is not None:
                on_final(self._first_offset[k])


def _forward(layer, be, x, key):
    """One layer's forward: with the dropout key when it drops (nn/layers.py: ``Layer.dropout``)."""
    return layer.forward(be, x, key) if layer.dropout else layer.forward(be, x)


class UnitInputs:
    """What a forward under ``recompute = "blocks"`` keeps: each partition unit's input (one array each), and
    the micro-batch's dropout key, so the recomputed forward draws the same masks."""

    __slots__ = ("inputs", "key")

    def __init__(self, inputs, key=None):
        self.inputs, self.key = inputs, key

    @property
    def nbytes(self) -> int:
        return sum(int(getattr(x, "nbytes", 0)) for x in self.inputs)
