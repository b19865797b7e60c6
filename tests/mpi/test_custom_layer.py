"""A registered layer (examples/custom_layer.py's "resmlp") under every layout equals one process: data parallel,
pipelined (a stage cut before it), tensor parallel (it stays whole on each tp rank, between split pairs) and ZeRO.

Run under ``mpiexec -n 1`` and ``-n 2`` by tests/test_suites.py; the reference is each rank training the same
config alone on COMM_SELF.
"""

import dataclasses
import os
import sys

import numpy as np
import pytest
from mpi4py import MPI

from helpers import config, train_params as train

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "examples"))
import custom_layer  # noqa: E402,F401  (registers "resmlp" on every rank)

# Linear 0 -> relu -> Linear 2 is a tensor-parallel pair; the resmlp block after it stays whole
LAYERS = [{"type": "linear", "in": 6, "out": 8}, {"type": "relu"}, {"type": "linear", "in": 8, "out": 8},
          {"type": "resmlp", "dim": 8, "hidden": 12}, {"type": "linear", "in": 8, "out": 3}]


def alone(cfg):
    single = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=1, pp=1, dp="auto", zero=0,
                                                                   stages=()))
    return train(single, MPI.COMM_SELF)


def layouts(size):
    if size == 1:
        return [{}]
    return [{"dp": size}, {"dp": size, "zero": 2}, {"pp": size, "schedule": "1f1b"},
            {"pp": size, "schedule": "zero-bubble"}, {"tp": size}]


@pytest.mark.parametrize("micro", [1, 2])
def test_a_registered_layer_trains_alike_on_every_layout(comm, data, micro):
    for parallel in layouts(comm.size):
        dp = comm.size // (parallel.get("pp", 1) * parallel.get("tp", 1))
        cfg = config(data, model={"layers": LAYERS}, optim={"name": "adamw", "lr": 0.01},
                     train={"steps": 4, "batch_size": 8 * dp, "micro_batches": micro * (2 if "pp" in parallel else 1),
                            "grad_clip": 0.5}, parallel=parallel)
        got, want = train(cfg, comm), alone(cfg)
        assert set(got) == set(want) and {"3.fc.weight", "3.proj.bias"} <= set(got)
        err = max(float(np.abs(got[n] - want[n]).max() / max(np.abs(want[n]).max(), 1e-30)) for n in want)
        assert err < 1e-6, (parallel, err)
