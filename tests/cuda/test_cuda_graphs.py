"""The CUDA backend's step graphs (hpctrain/backend/cuda/graphs.py, issue 49 item 3) under the simulator, whose
emulated replay runs each segment's kernels at the segment's launch, on the recorded addresses: from the third
step no kernel is launched from Python (``python_launches`` 0, ``graph_launches`` the segments), the simulator
still runs every kernel, and the weights equal those of the same run without graphs, bit for bit, also when a
step leaves its segments. The layouts on two ranks are tests/cuda/dp_worker.py's ``arena-*``; the bookkeeping
alone is tests/test_step_graphs.py."""

import dataclasses
import json

import numpy as np
import pytest
from numba.cuda.simulator import kernel as sim_kernel

from cudatest import SIM
from helpers import config, gpt_config, make_classification, make_tokens
from hpctrain.config import CudaConfig
from hpctrain.errors import BackendError, ConfigError
from hpctrain.parallel.mesh import Mesh
from hpctrain.train import Trainer

pytestmark = pytest.mark.skipif(not SIM, reason="emulated replay (on a GPU: bench/gpu_all.sh)")


@pytest.fixture(scope="module")
def mesh():
    m = Mesh()
    yield m
    m.free()


@pytest.fixture
def simulator_launches(monkeypatch):
    count = [0]
    run = sim_kernel.FakeCUDAKernel.__call__

    def counted(self, *args):
        if not self._device and not sim_kernel._kernel_context:
            count[0] += 1
        return run(self, *args)

    monkeypatch.setattr(sim_kernel.FakeCUDAKernel, "__call__", counted)
    return count


def gpt(tmp_path, model=None, **train):
    make_tokens(tmp_path / "t.h5", n=300)
    return gpt_config(tmp_path / "t.h5", model={"block_size": 4, "n_embd": 4, "n_layer": 1, **(model or {})},
                      data={"val_fraction": 0.1},
                      train={"steps": 4, "batch_size": 4, "micro_batches": 2, "backend": "cuda", "grad_clip": 0.5,
                             **train}, optim={"name": "adamw", "lr": 0.01})


def mlp(tmp_path, **train):
    """An MLP (few kernels: the quick runs), micro-batches and clipping, so the step has several segments."""
    make_classification(tmp_path / "d.h5", n=48)
    return config(tmp_path / "d.h5", train={"steps": 4, "batch_size": 8, "micro_batches": 2, "backend": "cuda",
                                            "grad_clip": 0.5, **train}, optim={"name": "adamw", "lr": 0.01})


def train(cfg, mesh, graphs, steps=4, counter=None, between=None, log=None):
    """(trainer, parameters after ``steps``, per step (python_launches, graph_launches, the simulator's))."""
    trainer = Trainer(dataclasses.replace(cfg, cuda=CudaConfig(graphs=graphs)), mesh=mesh,
                      log=log or (lambda *a: None))
    seen = []
    for step in range(steps):
        ran = counter[0] if counter else 0
        out = trainer.train_step(step, 0.01 * (step + 1))
        seen.append((out["python_launches"], out.get("graph_launches"), counter[0] - ran if counter else None))
        if between is not None:
            between(trainer, step)
    params = trainer.be.to_host(trainer.params.data)
    return trainer, params, seen


def test_replayed_steps_launch_nothing_from_python_and_train_to_the_same_bits(tmp_path, mesh, simulator_launches):
    cfg = gpt(tmp_path)
    trainer, with_graphs, seen = train(cfg, mesh, True, counter=simulator_launches)
    graphs = trainer.be.graphs
    assert graphs.captures == 1 and graphs.reason == "" and graphs.off == "" and graphs.segments > 1
    kernels = seen[0][2]
    # step 1: the arena records; step 2: the graphs record; then every kernel in a replayed segment
    assert [s[0] for s in seen] == [kernels, kernels, 0, 0], seen
    assert [s[1] for s in seen] == [0, 0, graphs.segments, graphs.segments]
    assert all(s[2] == kernels for s in seen)  # the simulator ran every kernel of every step
    trainer.close()
    plain, without, seen_without = train(cfg, mesh, False, counter=simulator_launches)
    assert plain.be.graphs is None and [s[1] for s in seen_without] == [None] * 4
    assert np.array_equal(with_graphs, without)
    plain.close()


def test_dropout_and_flash_attention_replay_to_the_same_bits(tmp_path, mesh):
    """The dropout and flash kernels read the step from device memory (issue 49 item 2): the same launch every
    step, so a replayed segment draws the step's own masks."""
    cfg = gpt(tmp_path, model={"dropout": 0.1, "attention": "flash"}, steps=3)
    trainer, with_graphs, seen = train(cfg, mesh, "auto", steps=3)
    assert seen[2][0] == 0 and trainer.be.graphs.captures == 1
    trainer.close()
    plain, without, _ = train(cfg, mesh, False, steps=3)
    assert np.array_equal(with_graphs, without)
    plain.close()


def test_a_step_that_leaves_its_graphs_still_trains_to_the_same_bits_and_says_why_once(tmp_path, mesh):
    """A kernel launched at the start of the fourth step that the recorded step did not launch: the graphs leave
    their segments (the launches matched so far run one by one, the rest are launched from Python), the fifth
    step records again, the sixth replays."""
    cfg = mlp(tmp_path, steps=6)

    def extra(trainer, step):
        if step == 2:
            be, plain = trainer.be, trainer.be._launch

            def once(*args):
                be._launch = plain
                be.fill_(be._no_bias, 0)  # the GEMMs' zero bias, filled with zero: the values stay as they are
                plain(*args)
            be._launch = once

    lines = []
    trainer, with_graphs, seen = train(cfg, mesh, True, steps=6, between=extra, log=lines.append)
    assert seen[2][0] == 0 and seen[3][0] > 0 and seen[4][0] > 0 and seen[5][0] == 0, seen
    said = [line for line in lines if line.startswith("cuda.graphs:")]
    assert len(said) == 1 and "step 4's kernels launched one by one: launch 0 of segment 0 is fill" in said[0], said
    assert trainer.be.graphs.captures == 2
    trainer.close()
    plain, without, _ = train(cfg, mesh, False, steps=6)
    assert np.array_equal(with_graphs, without)
    plain.close()


def test_evaluation_between_steps_leaves_the_graphs_alone(tmp_path, mesh):
    def evaluate(trainer, step):
        assert trainer.runner.evaluate(batches=1)["val_loss"] > 0

    trainer, _, seen = train(mlp(tmp_path), mesh, True, between=evaluate)
    assert [s[0] for s in seen[2:]] == [0, 0] and trainer.be.graphs.reason == ""
    trainer.close()


def test_the_metrics_lines_carry_the_graph_launches(tmp_path, mesh):
    cfg = mlp(tmp_path, log_every=1, metrics=str(tmp_path / "m.jsonl"))
    trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    trainer.run()
    trainer.close()
    steps = [r for r in map(json.loads, open(tmp_path / "m.jsonl")) if "loss" in r and "graph_launches" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert [r["graph_launches"] > 0 for r in steps] == [False, False, True, True]
    assert [r["python_launches"] == 0 for r in steps] == [False, False, True, True]


def test_graphs_true_needs_the_arena(tmp_path, mesh):
    from hpctrain.config.load import parse_config

    with pytest.raises(ConfigError, match="cuda.graphs: true needs cuda.arena = true"):
        parse_config({**_sections(mlp(tmp_path)), "cuda": {"arena": False, "graphs": True}})
    cfg = mlp(tmp_path)
    with pytest.raises(BackendError, match="cuda.graphs = true needs cuda.arena = true"):
        Trainer(dataclasses.replace(cfg, cuda=CudaConfig(arena=False, graphs=True)), mesh=mesh, log=lambda *a: None)
    trainer = Trainer(dataclasses.replace(cfg, cuda=CudaConfig(arena=False)), mesh=mesh, log=lambda *a: None)
    assert trainer.be.graphs is None  # "auto" without the arena: no graphs
    trainer.close()


def _sections(cfg) -> dict:
    import tomllib

    return tomllib.loads(cfg.to_toml())
