"""train.recompute = "blocks": each partition unit's forward runs again in its backward, bitwise the same training.

The forward keeps each unit's input only (an MLP's Linear or LayerNorm with the activations after it, a GPT
block, the embedding, the head); the backward recomputes a unit's forward just before its backward. The
same kernels on the same values give the same bits, so parameters after training are identical to a run
that stores every activation; the executor's peak of saved activation bytes falls.
"""

import dataclasses
import hashlib

import pytest
from mpi4py import MPI

from helpers import config, gpt_config, make_classification, make_tokens, train_params
from hpctrain.errors import ConfigError


def digest(params) -> str:
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(params[name].tobytes())
    return h.hexdigest()


def with_recompute(cfg, value):
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, recompute=value))


@pytest.mark.parametrize("micro", [1, 2])
def test_mlp_with_recompute_is_bitwise_the_same(tmp_path, micro):
    make_classification(tmp_path / "d.h5", n=64)
    cfg = config(tmp_path / "d.h5", optim={"name": "adamw", "lr": 0.01},
                 train={"steps": 4, "batch_size": 8, "micro_batches": micro, "grad_clip": 0.5})
    assert digest(train_params(with_recompute(cfg, "blocks"), MPI.COMM_SELF)) == \
        digest(train_params(cfg, MPI.COMM_SELF))


def test_gpt_with_recompute_is_bitwise_the_same(tmp_path):
    make_tokens(tmp_path / "t.h5")
    cfg = gpt_config(tmp_path / "t.h5", train={"steps": 3, "micro_batches": 2})
    assert digest(train_params(with_recompute(cfg, "blocks"), MPI.COMM_SELF)) == \
        digest(train_params(cfg, MPI.COMM_SELF))


def test_recompute_keeps_only_the_unit_inputs(tmp_path):
    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer

    make_tokens(tmp_path / "t.h5")
    peaks = {}
    for value in ("none", "blocks"):
        cfg = with_recompute(gpt_config(tmp_path / "t.h5", train={"steps": 1}), value)
        mesh = Mesh(comm=MPI.COMM_SELF)
        t = Trainer(cfg, mesh=mesh, log=lambda *a: None)
        try:
            assert [a for a, _ in t.part.units] == list(range(len(t.part.layers)))  # a GPT unit is one layer
            peaks[value] = t.train_step(0, 0.01)["peak_bytes"]
        finally:
            t.close()
            mesh.free()
    B, T, C = cfg.train.batch_size, cfg.model.block_size, cfg.model.n_embd
    inputs = B * T * 8 + (cfg.model.n_layer + 1) * B * T * C * 4  # token ids, then each block's and the head's input
    assert peaks["blocks"] == inputs < peaks["none"] / 4


def test_units_tile_every_part():
    from hpctrain.nn import make_model
    from helpers import config as mlp_config

    cfg = mlp_config("x.h5")
    model = make_model(cfg.model)
    for pp in (1, 2, 3):
        for lo, hi in model.partition(pp):
            units = model.part(lo, hi).units
            assert units[0][0] == 0 and units[-1][1] == hi - lo
            assert all(a[1] + 1 == b[0] for a, b in zip(units, units[1:]))


def test_unknown_recompute_is_one_line_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="train.recompute"):
        config(tmp_path / "d.h5", train={"recompute": "everything"})
