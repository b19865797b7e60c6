"""The model spec and its parts: units, partitions, and parts that chain to the whole model exactly."""

import numpy as np
import pytest

from helpers import config
from hpctrain.backend.cpu import CpuBackend
from hpctrain.errors import LayoutError
from hpctrain.nn import ModelSpec, make_loss
from hpctrain.params import FlatBuffer


def spec_of(widths, activation="relu"):
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append({"type": "linear", "in": a, "out": b})
        if i < len(widths) - 2:
            layers.append({"type": activation})
    return ModelSpec(config("x.h5", model={"layers": layers}).model.layers)


def test_units_are_parameter_layers_with_their_activations():
    spec = ModelSpec(config("x.h5").model.layers)  # linear, tanh, layernorm, gelu, linear, relu, linear
    assert spec.units == [(0, 1), (2, 3), (4, 5), (6, 6)]
    assert spec.partition(1) == [(0, 6)]
    assert spec.partition(4) == [(0, 1), (2, 3), (4, 5), (6, 6)]


def test_partition_balances_parameters():
    spec = spec_of([64, 128, 128, 10])  # units of 8,320, 16,512 and 1,290 parameters
    assert spec.partition(2) == [(0, 1), (2, 4)]  # largest stage 17,802, not 24,832
    spec = spec_of([100] * 9)  # eight equal units
    assert spec.partition(4) == [(0, 3), (4, 7), (8, 11), (12, 14)]
    costs = [spec.param_count(lo, hi) for lo, hi in spec.partition(3)]
    assert max(costs) == 3 * 10_100 and sum(costs) == spec.layout.size


def test_more_stages_than_units_is_an_error():
    spec = spec_of([4, 5, 3])
    with pytest.raises(LayoutError, match="parallel.pp = 3 is more stages than the model has partition units "
                                          r"\(2: a linear or layernorm layer with the activations after it\)"):
        spec.partition(3)
    with pytest.raises(LayoutError, match="parallel.pp × parallel.virtual_stages = 2 × 2 is more stages than the "
                                          r"model has partition units \(2: "):
        spec.partition(2, virtual_stages=2)
    assert spec_of([4, 5, 5, 5, 3]).partition(2, virtual_stages=2) == [(0, 1), (2, 3), (4, 5), (6, 6)]


def test_parts_chain_to_the_whole_model_bit_for_bit():
    """Forward through parts in turn and backward in reverse equals the whole model: same kernels, same order."""
    be = CpuBackend()
    cfg = config("x.h5")
    spec = ModelSpec(cfg.model.layers)
    init = spec.init_params(3)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, spec.in_features)).astype(np.float32)
    y = rng.integers(0, spec.out_features, 5)
    loss = make_loss("cross_entropy")

    def run(parts):
        grads = {}
        bufs = []
        for part in parts:
            params, g = FlatBuffer(be, part.layout), FlatBuffer(be, part.layout)
            part.bind(params, g)
            params.load_host_dict(part.init_params(3))
            bufs.append(g)
        h, saved = x, []
        for part in parts:
            h, s = part.forward(be, h)
            saved.append(s)
        value, _, d = loss(be, h, y, 1 / 5)
        for part, s in zip(reversed(parts), reversed(saved)):
            d = part.backward(be, d, s, need_dinp=not part.is_first)
        for g in bufs:
            grads.update(g.to_host_dict())
        return value, grads

    whole_value, whole = run([spec.part()])
    for stages in ([(0, 1), (2, 6)], [(0, 4), (5, 6)], [(0, 1), (2, 3), (4, 5), (6, 6)]):
        parts = [spec.part(lo, hi) for lo, hi in stages]
        assert sum(p.layout.size for p in parts) == spec.layout.size
        assert [p.global_range for p in parts] == [(spec.layout[p.layout.names[0]].offset,
                                                    spec.layout[p.layout.names[-1]].end) for p in parts]
        value, grads = run(parts)
        assert value == whole_value
        for name in whole:
            np.testing.assert_array_equal(grads[name], whole[name], err_msg=name)
    assert set(init) == set(spec.layout.names)


def test_a_part_of_model_chunks_runs_each_chunk_as_its_own_stage_would():
    """Interleaved 1F1B's parts: stage 0 of 2 with 2 chunks holds virtual stages 0 and 2 of 4. Its chunks' forward
    and backward, chained with stage 1's, give the whole model's loss and gradients bit for bit; its layout holds
    the two chunks' tensors one after the other, each chunk a slice of the global buffer; the "gradients final"
    offsets fall from the end of the buffer as the chunks' backwards run in reverse."""
    be = CpuBackend()
    spec = ModelSpec(config("x.h5").model.layers)  # units (0, 1), (2, 3), (4, 5), (6, 6)
    virtual = spec.partition(4)
    parts = [spec.part(chunks=virtual[s::2]) for s in range(2)]  # stage s holds virtual stages s and s + 2
    assert parts[0].layer_ranges == [(0, 1), (4, 5)] and parts[0].chunk_layers == [(0, 1), (2, 3)]
    assert parts[0].chunk_widths == [(spec.in_features, spec.widths[1]), (spec.widths[3], spec.widths[5])]
    assert parts[0].describe().startswith("layers 0..1, layers 4..5: ")
    assert parts[0].chunk_is_first(0) and not parts[0].chunk_is_first(1) and parts[1].chunk_is_last(1)
    assert sum(p.layout.size for p in parts) == spec.layout.size
    for part in parts:
        assert part.global_ranges == [spec.part(a, b).global_range for a, b in part.layer_ranges]
    with pytest.raises(LayoutError, match="no single global range"):
        parts[0].global_range
    with pytest.raises(LayoutError, match="model order"):
        spec.part(chunks=[(4, 5), (0, 1)])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, spec.in_features)).astype(np.float32)
    y = rng.integers(0, spec.out_features, 5)
    loss = make_loss("cross_entropy")

    def bound(part):
        params, grads = FlatBuffer(be, part.layout), FlatBuffer(be, part.layout)
        part.bind(params, grads)
        params.load_host_dict(part.init_params(3))
        return grads

    whole = spec.part()
    g = bound(whole)
    h, saved = whole.forward(be, x)
    value, _, d = loss(be, h, y, 1 / 5)
    whole.backward(be, d, saved, need_dinp=False)
    want = g.to_host_dict()
    grads = [bound(p) for p in parts]
    order = [(0, 0), (1, 0), (0, 1), (1, 1)]  # (stage, chunk) in virtual stage order
    h, saved = x, {}
    for s, c in order:
        h, saved[s, c] = parts[s].forward(be, h, chunk=c)
    got_value, _, d = loss(be, h, y, 1 / 5)
    events = []
    for s, c in reversed(order):
        d = parts[s].backward(be, d, saved[s, c], need_dinp=not parts[s].chunk_is_first(c), chunk=c,
                              on_final=events.append if s == 0 else None)
    assert got_value == value
    got = {**grads[0].to_host_dict(), **grads[1].to_host_dict()}
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert events == sorted(events, reverse=True) and events[-1] == 0  # chunk 1's offsets, then chunk 0's


def test_gradients_final_events_cover_the_part_from_the_end():
    spec = ModelSpec(config("x.h5").model.layers)
    part = spec.part(2, 6)
    be = CpuBackend()
    params, grads = FlatBuffer(be, part.layout), FlatBuffer(be, part.layout)
    part.bind(params, grads)
    params.load_host_dict(part.init_params(0))
    out, saved = part.forward(be, np.ones((3, part.in_features), np.float32))
    events = []
    part.backward(be, np.ones_like(out), saved, on_final=events.append)
    assert events == sorted(events, reverse=True) and events[-1] == 0
    assert events[0] == part.layout["6.weight"].offset


def test_tensor_parallel_pairs_are_linear_activations_linear():
    from hpctrain.config import LayerSpec

    def spec(*kinds):
        layers = []
        for k in kinds:
            layers.append(LayerSpec("linear", (("bias", True), ("in", 8), ("out", 8))) if k == "L" else
                          LayerSpec("layernorm", (("dim", 8), ("eps", 1e-5))) if k == "N" else LayerSpec(k))
        return ModelSpec(layers)

    assert spec("L", "relu", "L", "gelu", "L").tp_pairs == [(0, 2)]  # the last Linear stays whole
    assert spec("L", "L", "gelu", "L").tp_pairs == [(1, 3)]  # two Linears in a row are no pair
    assert spec("L", "tanh", "N", "gelu", "L", "relu", "tanh", "L").tp_pairs == [(4, 7)]
    assert spec("L", "relu", "L", "relu", "L", "relu", "L").tp_units() == [(0, 3), (4, 6)]
