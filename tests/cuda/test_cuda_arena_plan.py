"""``hpctrain plan`` counts the step arena (hpctrain/arena_plan.py, issue 49 item 1): on a GPU with ``cuda.arena``
its activations column is the slab the arena plans from the step's own requests. Under the simulator the
arena runs for real, so its slab after two steps is the figure the plan must meet: the planned slab may be
short only by the reductions' partial sums (sized by the GPU's multiprocessors, a few 512 B pieces), and is
never over."""

import dataclasses

import pytest

from cudatest import SIM
from helpers import config, gpt_config, make_classification, make_tokens
from hpctrain.parallel.mesh import Mesh
from hpctrain.plan import plan
from hpctrain.train import Trainer

pytestmark = pytest.mark.skipif(not SIM, reason="the simulator's slab is the reference (on a GPU: bench/gpu_all.sh)")

SHORT_BY = 4 * 512  # at most four pieces of partial sums the plan leaves out


@pytest.fixture(scope="module")
def mesh():
    m = Mesh()
    yield m
    m.free()


def gpt(tmp_path, model=(), cuda=(), **train):
    make_tokens(tmp_path / "t.h5", n=300)
    return gpt_config(tmp_path / "t.h5", model={"block_size": 4, "n_embd": 8, **dict(model)},
                      data={"val_fraction": 0.0}, cuda={"graphs": False, "gemm": "numba", **dict(cuda)},
                      train={"steps": 2, "batch_size": 4, "backend": "cuda", "grad_clip": 0.5, **train})


def mlp(tmp_path, **train):
    make_classification(tmp_path / "c.h5")
    return config(tmp_path / "c.h5", data={"val_fraction": 0.0}, cuda={"graphs": False},
                  train={"steps": 2, "batch_size": 8, "backend": "cuda", **train})


CASES = {
    "gpt": lambda p: gpt(p),
    "gpt-2-micro-batches": lambda p: gpt(p, micro_batches=2),
    "gpt-recompute": lambda p: gpt(p, recompute="blocks"),
    "gpt-flash-dropout": lambda p: gpt(p, model={"attention": "flash", "dropout": 0.1}),
    "gpt-math-dropout": lambda p: gpt(p, model={"dropout": 0.1}),
    "gpt-bf16-dropout": lambda p: gpt(p, model={"dropout": 0.1}, micro_batches=2, precision="bf16"),
    "mlp": lambda p: mlp(p),
}


@pytest.mark.parametrize("case", CASES)
def test_plan_counts_the_arena_slab(case, tmp_path, mesh):
    cfg = CASES[case](tmp_path)
    planned = plan(cfg, 1, device=True)[0].activation_bytes
    slab = slab_after_two_steps(cfg, mesh)
    assert slab - SHORT_BY <= planned <= slab, (case, planned, slab)


def slab_after_two_steps(cfg, mesh) -> int:
    """The step arena's slab once two training steps of ``cfg`` have run (the second replays the first's plan)."""
    trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    try:
        for step in range(2):
            trainer.train_step(step, 0.01)
        assert trainer.be.arena.replaying or trainer.be.arena.plans == 1
        return trainer.be.arena.slab_bytes
    finally:
        trainer.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_plan_counts_what_the_cublaslt_provider_requests(tmp_path, mesh, monkeypatch, precision):
    """With cuBLASLt (here tests/cublaslt_fake.py's stand-in on the simulated arrays) attention's products take
    contiguous heads, and a bf16 product bfloat16 operands: the plan for cuda.gemm = "auto" counts those
    arrays, not tiled.py's. (The other cases here plan and run cuda.gemm = "numba", the simulator's provider.)"""
    from cublaslt_fake import SimulatorCublaslt
    from cublaslt_load import cublaslt

    from hpctrain.backend.cuda import gemm as gemm_module

    monkeypatch.setattr(gemm_module, "cublaslt_unavailable", lambda simulator: None)
    monkeypatch.setattr(cublaslt, "Cublaslt", SimulatorCublaslt)
    cfg = gpt(tmp_path, model={"dropout": 0.1}, cuda={"gemm": "cublaslt"}, micro_batches=2, precision=precision)
    auto = dataclasses.replace(cfg, cuda=dataclasses.replace(cfg.cuda, gemm="auto"))
    planned = plan(auto, 1, device=True)[0].activation_bytes
    slab = slab_after_two_steps(cfg, mesh)
    assert slab - SHORT_BY <= planned <= slab, (planned, slab)


def test_without_the_arena_the_plan_is_the_pools(tmp_path):
    cfg = gpt(tmp_path)
    off = dataclasses.replace(cfg, cuda=dataclasses.replace(cfg.cuda, arena=False))
    arena, pool = plan(cfg, 1, device=True)[0], plan(off, 1, device=True)[0]
    assert arena.activation_bytes > pool.activation_bytes  # the backward's transients, each rounded to 512 B
    assert plan(cfg, 1)[0].activation_bytes == plan(off, 1)[0].activation_bytes  # the CPU has no arena
