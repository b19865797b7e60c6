"""Shards of full tensors (hpctrain/shards.py): each kind cut as Megatron does, and put back exactly."""

import numpy as np
import pytest

from hpctrain.shards import shard, unshard


@pytest.mark.parametrize("kind,shape", [("rows", (8, 3)), ("rows", (4,)), ("cols", (3, 8)), ("rows3", (12, 5)),
                                        ("rows3", (12,))])
@pytest.mark.parametrize("size", [1, 2, 4])
def test_shards_put_back_exactly(kind, shape, size):
    full = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    pieces = [shard(full, kind, r, size) for r in range(size)]
    assert all(p.flags["C_CONTIGUOUS"] for p in pieces)
    np.testing.assert_array_equal(unshard(pieces, kind), full)


def test_rows3_keeps_whole_heads_of_q_k_and_v():
    """c_attn (3C, C) with C = 4, two heads of 2 rows each, tp = 2: rank r keeps head r of q, of k, of v."""
    C = 4
    full = np.repeat(np.arange(3 * C, dtype=np.float32)[:, None], C, axis=1)  # row i holds the value i
    rank1 = shard(full, "rows3", 1, 2)
    np.testing.assert_array_equal(rank1[:, 0], [2, 3, 6, 7, 10, 11])  # q rows 2,3; k rows 6,7; v rows 10,11
    assert shard(full, "cols", 0, 2).shape == (3 * C, C // 2)
