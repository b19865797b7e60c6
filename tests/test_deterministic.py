"""The parts of ``train.deterministic`` that need no MPI: the shard tree, the ordered sums, the layout checks.

The multi-rank guarantee itself (the same bits for dp 1/2/4 x pp 1/2) is tests/mpi/test_deterministic.py.
"""

import itertools
import math

import numpy as np
import pytest

from helpers import config
from hpctrain.backend import get_backend
from hpctrain.errors import ConfigError
from hpctrain.parallel.deterministic import ShardTree, norm_of, ordered_sum
from hpctrain.run_plan import RunPlan


def pairwise(leaves):
    """The tree's definition: adjacent pairs summed, level by level (float32, left + right)."""
    level = [np.asarray(x, dtype=np.float32) for x in leaves]
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]


@pytest.mark.parametrize("leaves", [1, 2, 4, 8])
def test_the_shard_tree_sums_pairwise_whatever_the_arrival_order(leaves):
    be = get_backend("cpu")
    rng = np.random.default_rng(leaves)
    grads = [(rng.standard_normal(37) * 10.0 ** rng.integers(-4, 4, 37)).astype(np.float32) for _ in range(leaves)]
    want = pairwise(grads)
    if leaves >= 4:  # the values show the order: left-to-right accumulation gives other bits
        assert not np.array_equal(want, np.sum(np.stack(grads), axis=0, dtype=np.float32))
    orders = list(itertools.permutations(range(leaves)))[:24]
    for order in orders:
        buf = np.zeros(37, dtype=np.float32)
        tree = ShardTree(be, buf, leaves)
        tree.start()
        for k, leaf in enumerate(order):
            buf[:] = grads[leaf]  # the backward writes this shard's gradient
            if k < leaves - 1:
                tree.push(leaf, 0, 37)
            else:  # the last one range by range, from the end, as the "gradients final" events come
                for lo, hi in ((30, 37), (12, 30), (0, 12)):
                    tree.push(leaf, lo, hi, last_slice=False)
        assert np.array_equal(buf, want), order
    assert len(tree._free) + len(tree._parked) <= max(1, leaves.bit_length() - 1) + 1


def test_the_shard_tree_needs_a_power_of_two():
    with pytest.raises(ValueError, match="power-of-two"):
        ShardTree(get_backend("cpu"), np.zeros(3, dtype=np.float32), 3)


def test_ordered_sum_is_a_fixed_pairwise_tree():
    vals = [1e16, 1.0, -1e16, 1.0, 3.0]
    assert ordered_sum(vals) == ((1e16 + 1.0) + (-1e16 + 1.0)) + 3.0
    assert ordered_sum([]) == 0.0


def test_the_norm_is_rounded_once():
    v = np.array([1e20, 1.0, -1e20, 3.0])  # not squares, but fsum's point: independent of the order
    assert norm_of(v) == 2.0
    assert norm_of(v[::-1]) == 2.0
    assert math.isnan(norm_of(np.array([1.0, np.nan])))


def det(tmp_path, **train):
    from helpers import make_classification

    make_classification(tmp_path / "d.h5")
    return config(tmp_path / "d.h5", train={"deterministic": True, "batch_size": 16, **train})


def test_the_run_plan_gives_each_rank_shards_over_dp_micro_batches(tmp_path):
    cfg = det(tmp_path, deterministic_shards=8, micro_batches=2)
    run = RunPlan.derive(cfg, dp=2, pp=1, tp=1)
    assert run.micro_batches == 4 and run.resolved(cfg).train.micro_batches == 4
    lines = run.notes(cfg)
    assert lines[0] == "train.deterministic: train.micro_batches = 2 replaced by 4 (deterministic_shards 8 / dp 2)"
    assert "8 shards of 2 samples, 4 per rank; bitwise the same" in lines[1]
    cfg = det(tmp_path)
    lines = RunPlan.derive(cfg, dp=1, pp=1, tp=2).notes(cfg)
    assert "tp = 2 splits the GEMMs: bitwise the same only among runs at tp = 2" in lines[-1]


def test_the_run_plan_leaves_a_plain_run_alone(tmp_path):
    cfg = config(tmp_path / "d.h5", train={"micro_batches": 2})
    run = RunPlan.derive(cfg, dp=3, pp=1, tp=1)
    assert run.resolved(cfg) is cfg and run.micro_batches == 2 and run.notes(cfg) == []


@pytest.mark.parametrize("dp, parallel, match", [
    (3, {}, "dp = 3 must be a power of two dividing train.deterministic_shards = 4"),
    (8, {}, "dp = 8 must be a power of two dividing"),
    (2, {"zero": 1}, "not with parallel.zero > 0"),
    (1, {"schedule": "zero-bubble", "pp": 2}, 'not with parallel.schedule = "zero-bubble"'),
    (1, {"schedule": "zero-bubble-h2", "pp": 2}, 'not with parallel.schedule = "zero-bubble-h2"'),
])
def test_the_run_plan_refuses_a_layout_the_tree_cannot_cover(tmp_path, dp, parallel, match):
    import dataclasses

    cfg = det(tmp_path)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel))
    with pytest.raises(ConfigError, match=match):
        RunPlan.derive(cfg, dp=dp, pp=cfg.parallel.pp, tp=1)


@pytest.mark.parametrize("train, match", [
    ({"deterministic_shards": 3}, "train.deterministic_shards: must be a power of two >= 1, got 3"),
    ({"deterministic_shards": 0}, "must be a power of two >= 1, got 0"),
    ({"deterministic_shards": 32}, "must divide train.batch_size = 16"),
])
def test_bad_shard_counts_are_refused(tmp_path, train, match):
    with pytest.raises(ConfigError, match=match):
        det(tmp_path, **train)


def test_the_parameter_server_is_refused(tmp_path):
    from helpers import make_classification

    make_classification(tmp_path / "d.h5")
    with pytest.raises(ConfigError, match='train.deterministic: not with parallel.mode = "async_ps"'):
        config(tmp_path / "d.h5", train={"deterministic": True}, parallel={"mode": "async_ps"})


def test_a_resume_refuses_other_shards(tmp_path):
    """Runs compare bitwise only with the same shards: resume = "auto" names a change, as any result-changing one."""
    import dataclasses

    from hpctrain.train.resume_check import changed_settings

    saved = det(tmp_path)
    now = dataclasses.replace(saved, train=dataclasses.replace(saved.train, deterministic_shards=8))
    assert changed_settings(saved.to_toml(), now) == [("train.deterministic_shards", 4, 8)]
    assert changed_settings(saved.to_toml(), dataclasses.replace(
        saved, train=dataclasses.replace(saved.train, micro_batches=4))) == []
