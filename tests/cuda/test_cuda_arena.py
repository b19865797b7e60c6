"""The CUDA backend's step arena (hpctrain/backend/arena.py, issue 49 item 1) under the simulator: from the second
step on a training step allocates no device memory and builds no array wrapper, hands out the same arrays step
after step, and trains to the same bits as without the arena. The metrics lines say so (``device_allocs``,
``python_launches``: the simulator's own count of launches). The layouts on two ranks are tests/cuda/dp_worker.py's
``arena-*``."""

import dataclasses
import json

import numpy as np
import pytest
from numba.cuda.simulator import kernel as sim_kernel

from cudatest import SIM
from helpers import gpt_config, make_tokens
from hpctrain.config import CudaConfig
from hpctrain.parallel.mesh import Mesh
from hpctrain.train import Trainer

pytestmark = pytest.mark.skipif(not SIM, reason="counts the simulator's launches (on a GPU: bench/gpu_all.sh)")


@pytest.fixture(scope="module")
def mesh():
    m = Mesh()
    yield m
    m.free()


@pytest.fixture
def simulator_launches(monkeypatch):
    """Kernels the simulator runs, counted where it runs them (not where hpctrain says it launches)."""
    count = [0]
    run = sim_kernel.FakeCUDAKernel.__call__

    def counted(self, *args):
        if not self._device and not sim_kernel._kernel_context:
            count[0] += 1
        return run(self, *args)

    monkeypatch.setattr(sim_kernel.FakeCUDAKernel, "__call__", counted)
    return count


def gpt(tmp_path, val_fraction=0.0, arena=True, **train):
    make_tokens(tmp_path / "t.h5", n=300)
    return gpt_config(tmp_path / "t.h5", model={"block_size": 4, "n_embd": 4}, data={"val_fraction": val_fraction},
                      cuda={"arena": arena, "graphs": False},  # the graphs': test_cuda_graphs.py
                      train={"steps": 3, "batch_size": 4, "micro_batches": 2, "backend": "cuda", "grad_clip": 0.5,
                             **train}, optim={"name": "adamw", "lr": 0.01})


def train(cfg, mesh, arena: bool, steps=3, counter=None):
    """(trainer, parameters after ``steps``, [(device_allocs, python_launches, the simulator's launches)] a step)."""
    trainer = Trainer(dataclasses.replace(cfg, cuda=CudaConfig(arena=arena, graphs=False)), mesh=mesh,
                      log=lambda *a: None)
    seen = []
    for step in range(steps):
        ran = counter[0] if counter else 0
        out = trainer.train_step(step, 0.01)
        seen.append((out["device_allocs"], out["python_launches"], counter[0] - ran if counter else None))
    params = trainer.be.to_host(trainer.params.data)
    return trainer, params, seen


def test_steps_after_the_first_allocate_nothing_and_train_to_the_same_bits(tmp_path, mesh, simulator_launches):
    cfg = gpt(tmp_path)
    trainer, with_arena, seen = train(cfg, mesh, arena=True, counter=simulator_launches)
    arena = trainer.be.arena
    first = seen[0][0]
    assert first > 50 and [a for a, _, _ in seen[1:]] == [0, 0], seen
    assert arena.plans == 1 and arena.escaped == 0 and arena.reason == "" and arena.slab_bytes > 0
    # best fit by lifetime: the slab within a quarter of the most bytes the step holds at once
    assert arena.peak_bytes <= arena.slab_bytes <= 1.25 * arena.peak_bytes, (arena.slab_bytes, arena.peak_bytes)
    assert arena.served == 2 * first  # every request of the recorded step, twice
    trainer.close()
    _, without, plain = train(cfg, mesh, arena=False, counter=simulator_launches)
    assert np.array_equal(with_arena, without)
    assert [a for a, _, _ in plain] == [first] * 3
    # hpctrain's count is the simulator's (every launch goes through the backend's one launch call), the same
    # every step, with the arena or without
    assert all(ours == simulated for _, ours, simulated in seen + plain)
    assert len({ours for _, ours, _ in seen + plain}) == 1


def test_the_same_arrays_every_step(tmp_path, mesh):
    """What a CUDA graph needs: each request of a step gets the array (the address) it got the step before."""
    cfg = gpt(tmp_path, micro_batches=1)
    trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    be = trainer.be
    handed = []
    plain = be._alloc

    def traced(op, shape, dtype=np.float32):
        out = plain(op, shape, dtype)
        handed[-1].append(id(out))
        return out

    be._alloc = traced
    for step in range(4):
        handed.append([])
        trainer.train_step(step, 0.01)
    assert handed[1] != handed[0] and handed[2] == handed[1] == handed[3]
    trainer.close()


def test_the_metrics_lines_carry_the_allocations_and_launches(tmp_path, mesh):
    cfg = gpt(tmp_path, steps=3, log_every=1, metrics=str(tmp_path / "m.jsonl"))
    trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    trainer.run()
    trainer.close()
    lines = [json.loads(line) for line in open(tmp_path / "m.jsonl")]
    steps = [r for r in lines if "loss" in r and "device_allocs" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert steps[0]["device_allocs"] > 0 and [r["device_allocs"] for r in steps[1:]] == [0, 0]
    assert len({r["python_launches"] for r in steps}) == 1 and steps[0]["python_launches"] > 0


def test_evaluation_between_steps_does_not_disturb_the_plan(tmp_path, mesh):
    """Evaluation runs outside the step (other shapes, no backward): its arrays are the pool's, and the training
    steps around it keep replaying."""
    cfg = gpt(tmp_path, val_fraction=0.1)
    trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    allocs = []
    for step in range(3):
        allocs.append(trainer.train_step(step, 0.01)["device_allocs"])
        assert trainer.runner.evaluate(batches=1)["val_loss"] > 0
    assert allocs[1:] == [0, 0] and trainer.be.arena.plans == 1
    trainer.close()


def test_cuda_arena_false_leaves_the_backend_as_it_was(tmp_path, mesh):
    trainer = Trainer(gpt(tmp_path, arena=False), mesh=mesh, log=lambda *a: None)
    be = trainer.be
    assert be.arena is None
    with be.step_scope():
        a = be.empty((3,))
    assert a.shape == (3,) and be.allocs >= 1
    trainer.close()


def launch_traces(cfg, mesh, steps):
    """Each step's launches as a graph would freeze them: (kernel, grid, block, argument addresses and values)."""
    trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    traces = []
    for step in range(steps):
        trainer.be.launch_trace = []
        trainer.train_step(step, 0.01 * (step + 1))  # the learning rate changes every step
        traces.append(trainer.be.launch_trace)
    trainer.close()
    return traces


def test_an_mlp_step_launches_the_same_kernels_with_the_same_arguments_every_step(tmp_path, mesh):
    """From the second step: every kernel, grid, block, array address and scalar the same, though the learning
    rate, Adam's bias corrections and the clipping factor change (the optimizer reads them from a device array:
    issue 49 item 2)."""
    from helpers import config, make_classification

    make_classification(tmp_path / "d.h5", n=32)
    cfg = config(tmp_path / "d.h5", train={"steps": 4, "batch_size": 8, "micro_batches": 2, "backend": "cuda",
                                           "grad_clip": 0.5}, optim={"name": "adamw", "lr": 0.01},
                 cuda={"graphs": False})
    traces = launch_traces(cfg, mesh, 4)
    assert len(traces[1]) > 20 and traces[1] == traces[2] == traces[3]
    assert traces[0] != traces[1]  # the first step's arrays are the pool's


@pytest.mark.parametrize("attention", ["math", "flash"])
def test_a_gpt_step_with_dropout_launches_the_same_every_step(tmp_path, mesh, attention):
    """Dropout's kernels derive each site's key from the step in device memory, and the token embedding's backward
    reads how many distinct ids the batch has from its plan, laid out the same for any batch: the same launches,
    grids and arguments every step from the second on."""
    cfg = gpt(tmp_path, steps=4)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dropout=0.1, attention=attention))
    traces = launch_traces(cfg, mesh, 4)
    differ = {a[0] for a, b in zip(traces[2], traces[3]) if a != b}
    assert len(traces[2]) > 100 and traces[1] == traces[2] == traces[3], differ
