"""MFU under mpiexec: the world's samples a second against every rank's peak (tests/test_mfu.py: the figures)."""

import json
import os

import pytest

from helpers import gpt_config, make_tokens, run_trainer
from hpctrain.parallel.mesh import Mesh


@pytest.fixture(scope="module")
def mesh():
    m = Mesh()
    yield m
    m.free()


def test_training_lines_carry_mfu_against_the_configured_peak(shared_dir, mesh, comm):
    tokens, metrics = os.path.join(shared_dir, "t.h5"), os.path.join(shared_dir, "m.jsonl")
    if comm.rank == 0:
        make_tokens(tokens)
    comm.Barrier()
    lines = []
    cfg = gpt_config(tokens, train={"metrics": str(metrics), "peak_tflops": 1e-3, "steps": 3})
    t = run_trainer(cfg, mesh, log=lines.append)
    if mesh.rank != 0:
        return  # rank 0 writes the metrics and the log
    with open(metrics) as f:
        records = [json.loads(line) for line in f]
    steps = [r for r in records if "loss" in r]
    assert steps and all("mfu" in r for r in steps)
    per_sample = t.model.training_flops()
    for r in steps:
        assert r["mfu"] == pytest.approx(r["samples_per_s"] * per_sample / (mesh.size * 1e9), rel=1e-12)
    assert any("MFU against 0.001 TFLOP/s a rank (train.peak_tflops)" in line for line in lines)
    assert all("MFU " in line for line in lines if line.startswith("step "))
