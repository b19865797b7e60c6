"""parallel/wire.py without MPI ranks: the bfloat16 rounding, the config's refusals, what the plan counts."""

import dataclasses

import numpy as np
import pytest

from helpers import config, gpt_config
from hpctrain.errors import ConfigError
from hpctrain.parallel.wire import Wire
from hpctrain.plan import plan


def bf16_bits_by_integers(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even of float32 to bfloat16, on the bits (the reference for ml_dtypes' cast)."""
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), (u >> 16).astype(np.uint16) | 0x0040, rounded)


def test_packing_rounds_to_nearest_even_and_widens_exactly():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(10_000).astype(np.float32) * np.float32(1e-3),
                        np.array([0.0, -0.0, 1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-9, 3.4e38, -3.4e38, 1e-40, -1e-45,
                                  np.inf, -np.inf, np.nan], dtype=np.float32)])
    wire = Wire(x.size)
    packed = wire.pack(x)
    np.testing.assert_array_equal(packed, bf16_bits_by_integers(x))
    back = np.empty_like(x)
    wire.unpack(packed, back)
    np.testing.assert_array_equal(back.view(np.uint32), packed.astype(np.uint32) << 16)
    normal = np.isfinite(x) & (np.abs(x) >= np.finfo(np.float32).tiny) & (np.abs(x) < 3e38)
    assert np.all(np.abs(back[normal] - x[normal]) <= 2.0**-8 * np.abs(x[normal]))  # half a step: 7 mantissa bits
    wire.close()


def test_packing_at_an_offset_leaves_the_rest_of_the_buffer_alone():
    wire = Wire(8)
    wire.packed[:] = 7
    wire.pack(np.ones(3, dtype=np.float32), 2)
    assert list(wire.packed) == [7, 7, 0x3F80, 0x3F80, 0x3F80, 7, 7, 7]
    wire.close()


def test_an_unknown_reduce_dtype_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="parallel.reduce_dtype"):
        config(tmp_path / "d.h5", parallel={"reduce_dtype": "fp16"})


def test_the_deterministic_tree_refuses_bf16_messages(tmp_path):
    with pytest.raises(ConfigError, match='parallel.reduce_dtype: "bf16" is not available with train.deterministic'):
        config(tmp_path / "d.h5", train={"deterministic": True, "batch_size": 8}, parallel={"reduce_dtype": "bf16"})


def test_the_plan_counts_the_packed_buffer_from_dp_2(tmp_path):
    cfg = gpt_config(tmp_path / "t.h5", train={"batch_size": 8})
    packed = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, reduce_dtype="bf16"))
    assert plan(packed, 1)[0].buffer_bytes == plan(cfg, 1)[0].buffer_bytes  # dp 1 sends nothing
    for fp32, bf16 in zip(plan(cfg, 2), plan(packed, 2)):
        assert bf16.buffer_bytes - fp32.buffer_bytes == 2 * (fp32.params_bytes // 4)
