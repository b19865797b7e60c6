"""``parallel.reduce_dtype = "bf16"``: gradient buckets travel over dp as bfloat16 (parallel/wire.py).

Run under ``mpiexec -n 1`` and ``-n 2`` by tests/test_suites.py. At dp 1 nothing is sent and the setting has no
effect; from dp 2 every bucket's payload is half its float32 bytes, the sum is bfloat16's (each rank's values
rounded, the partial sums rounded), and the run stays within bfloat16's rounding of the float32 run.
"""

import dataclasses
import json
import os

import numpy as np
import pytest
from mpi4py import MPI

from helpers import config, gpt_config, train_params as train
from hpctrain.parallel.mesh import Mesh
from hpctrain.parallel.wire import Wire
from hpctrain.plan import plan
from hpctrain.train import Trainer
from hpctrain.train.memory import rank_memory

SGD = {"name": "sgd", "lr": 0.1, "momentum": 0.9}


def bf16(cfg):
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, reduce_dtype="bf16"))


def max_error(got, want) -> float:
    return max(float(np.abs(got[n] - want[n]).max() / max(np.abs(want[n]).max(), 1e-30)) for n in want)


def same_on_every_rank(comm, params) -> bool:
    flat = np.concatenate([params[n].ravel() for n in sorted(params)])
    root = flat.copy()
    comm.Bcast(root, root=0)
    ok = np.array([int(np.array_equal(flat, root))], dtype=np.int32)
    comm.Allreduce(MPI.IN_PLACE, ok, op=MPI.MIN)
    return bool(ok[0])


def test_the_wire_sums_as_bfloat16_adds(comm):
    import ml_dtypes

    rng = np.random.default_rng(comm.rank)
    mine = (rng.standard_normal(1000) * 10.0 ** rng.integers(-3, 3, 1000)).astype(np.float32)
    everyone = np.empty((comm.size, mine.size), dtype=np.float32)
    comm.Allgather(mine, everyone)
    wire = Wire(mine.size)
    packed = wire.pack(mine)
    comm.Allreduce(MPI.IN_PLACE, wire.message(packed), op=wire.op)
    got = np.empty_like(mine)
    wire.unpack(packed, got)
    wire.close()
    rounded = everyone.astype(ml_dtypes.bfloat16)
    if comm.size <= 2:  # one addition per value, whatever MPI's algorithm: exactly bfloat16's
        want = rounded.sum(axis=0, dtype=ml_dtypes.bfloat16) if comm.size == 2 else rounded[0]
        np.testing.assert_array_equal(got, want.astype(np.float32))
    else:  # each partial sum rounded: within a few bfloat16 steps of the exact sum
        exact = everyone.astype(np.float64).sum(axis=0)
        assert np.all(np.abs(got - exact) <= 2.0**-7 * comm.size * np.abs(everyone).max(axis=0))


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_bf16_messages_carry_half_the_bytes_and_stay_near_the_fp32_run(comm, data, zero, overlap):
    cfg = config(data, optim=SGD, train={"steps": 6, "batch_size": 8 * comm.size}, data={"shuffle": True},
                 parallel={"overlap": overlap, "bucket_mb": 0.0002, "zero": zero})  # 50-float buckets
    sent = {}
    params = {}
    for name, c in (("fp32", cfg), ("bf16", bf16(cfg))):
        mesh = Mesh(comm=comm)
        t = Trainer(c, mesh=mesh, log=lambda *a: None)
        t.run()
        t.close()
        mesh.free()
        sent[name], params[name] = t.sync.sent_bytes, t.params.to_host_dict()
    assert same_on_every_rank(comm, params["bf16"])
    if comm.size == 1:  # nothing to send: the setting changes nothing
        assert sent == {"fp32": 0, "bf16": 0}
        assert max_error(params["bf16"], params["fp32"]) == 0.0
        return
    assert sent["fp32"] == 4 * t.part.layout.size  # every bucket once, Allreduced or reduce-scattered
    assert sent["bf16"] == sent["fp32"] // 2
    error = max_error(params["bf16"], params["fp32"])
    assert 0.0 < error < 2e-2, error  # it really rounds, and only by bfloat16's steps


def test_the_nonblocking_path_sums_bf16_as_the_thread_does(comm, data):
    """The Iallreduce path (no MPI_THREAD_MULTIPLE) widens each bucket once its request completes."""
    cfg = bf16(config(data, train={"steps": 4, "batch_size": 8 * comm.size}, parallel={"bucket_mb": 0.0002}))
    runs = []
    for nonblocking in (False, True):
        mesh = Mesh(comm=comm)
        t = Trainer(cfg, mesh=mesh, log=lambda *a: None)
        if nonblocking:
            t.sync._worker = None  # what GradSync does without MPI_THREAD_MULTIPLE
        t.run()
        t.close()
        mesh.free()
        runs.append(t.params.to_host_dict())
    for name in runs[0]:  # the same buckets summed the same way, one addition each at dp <= 2
        if comm.size <= 2:
            np.testing.assert_array_equal(runs[1][name], runs[0][name], err_msg=name)
        else:
            np.testing.assert_allclose(runs[1][name], runs[0][name], rtol=1e-2, atol=1e-4, err_msg=name)


def test_a_gpt_trains_with_bf16_messages_and_logs_dp_bytes(comm, tokens, shared_dir):
    metrics = os.path.join(shared_dir, "m.jsonl")
    cfg = bf16(gpt_config(tokens, train={"steps": 3, "batch_size": 4 * comm.size, "metrics": metrics}))
    mesh = Mesh(comm=comm)
    t = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    t.run()
    mine = rank_memory(t, 0)
    t.close()
    mesh.free()
    want = plan(cfg, comm.size)[comm.rank]
    assert mine.buffer_bytes == want.buffer_bytes  # the packed buffer counted by the plan as allocated
    if comm.size > 1:
        assert mine.buffer_bytes >= 2 * t.part.layout.size
    if comm.rank == 0:
        with open(metrics) as f:
            steps = [r for r in map(json.loads, f) if "loss" in r]
        assert steps and all(np.isfinite(r["loss"]) for r in steps)
        if comm.size > 1:
            assert all(r["dp_bytes"] == 2 * t.part.layout.size for r in steps)
        else:
            assert all("dp_bytes" not in r for r in steps)
