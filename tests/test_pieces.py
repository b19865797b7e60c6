"""checkpoint/pieces.py: what a rank holds of each tensor, and moving values between two layouts' holdings.

Each case is checked against numpy: a piece's rectangles against the shard of a full tensor
(hpctrain/shards.py's ``shard``), and every resharding move against slicing the full tensor.
"""

import itertools

import numpy as np
import pytest

from hpctrain.checkpoint.pieces import Piece, held, matches, segments, strided
from hpctrain.shards import shard

CASES = [((12, 8), "rows", 2), ((12, 8), "cols", 4), ((24, 4), "rows3", 2), ((36, 5), "rows3", 3), ((10,), "rows", 2),
         ((12, 8), None, 1), ((7,), None, 1), ((6, 6), "cols", 3)]


def _held_values(full, p: Piece):
    local = full if p.kind is None else shard(full, p.kind, p.tp_rank, p.tp)
    return local.reshape(-1)[p.lo : p.hi]


@pytest.mark.parametrize("shape,kind,tp", CASES)
def test_segments_cover_the_piece_with_the_full_tensors_values(shape, kind, tp):
    full = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    size = full.size // tp
    rng = np.random.default_rng(0)
    for rank in range(tp):
        for lo, hi in [(0, size), (0, 0), (size - 1, size)] + [tuple(sorted(rng.integers(0, size + 1, 2)))
                                                               for _ in range(20)]:
            p = Piece("t", shape, kind, rank, tp, int(lo), int(hi))
            values = _held_values(full, p)
            got = np.full(p.size, np.nan, dtype=np.float32)
            matrix = full.reshape(shape[0], -1)
            stride = (shape[1] // tp if kind == "cols" else shape[1]) if len(shape) == 2 else 1
            for r, c, h, w, off in segments(p):
                strided(got, (off, h, w, stride))[...] = matrix[r : r + h, c : c + w]
            np.testing.assert_array_equal(got, values)


LAYOUTS = [(None, 1), ("rows", 2), ("rows", 4)], [(None, 1), ("cols", 2), ("cols", 4)], [(None, 1), ("rows3", 2)]


@pytest.mark.parametrize("options", LAYOUTS)
def test_matches_move_any_stored_split_into_any_wanted_split(options):
    shape = (24, 8)
    full = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    for (skind, stp), (wkind, wtp) in itertools.product(options, repeat=2):
        for cuts in (1, 3):  # the stored shard cut into ranges (ZeRO chunks), ragged
            stored = []
            for rank in range(stp):
                n = full.size // stp
                edges = [0] + sorted({(n * k) // cuts + k for k in range(1, cuts)}) + [n]
                stored += [Piece("t", shape, skind, rank, stp, a, b) for a, b in zip(edges, edges[1:]) if b > a]
            for rank in range(wtp):
                n = full.size // wtp
                for lo, hi in [(0, n), (3, n - 5), (n // 2, n // 2 + 1)]:
                    want = Piece("t", shape, wkind, rank, wtp, lo, hi)
                    got = np.full(want.size, np.nan, dtype=np.float32)
                    for s in stored:
                        values = _held_values(full, s)
                        for src, dst in matches(want, s):
                            strided(got, dst)[...] = strided(values, src)
                    np.testing.assert_array_equal(got, _held_values(full, want), err_msg=f"{skind}/{stp} -> {wkind}/{wtp}")


def test_held_lists_owned_tensors_and_the_optimizers_pieces():
    from hpctrain.config import load_config
    from hpctrain.nn.gpt import make_model
    from hpctrain.parallel.zero import ZeroShard

    spec = make_model(load_config("jobs/configs/digits.toml", []).model)
    part = spec.part(0, len(spec.layers) - 1)
    params, slots = held(part)
    assert [p.name for p in params] == spec.layout.names and [p.at for p in params] == [s.offset for s in spec.layout]
    assert slots == params
    shard = ZeroShard([(0, part.layout.size)], dp=3, rank=1)
    _, mine = held(part, shard.pieces)
    assert sum(p.size for p in mine) == shard.size and mine[0].at == 0
    (a, b), = shard.pieces
    assert mine[0].lo + params[[p.name for p in params].index(mine[0].name)].at == a
