"""``hpctrain plan`` and start-up derive one RunPlan (hpctrain/run_plan.py): for every bundled config, world size
and layout, the plan ``hpctrain plan`` builds is the one a Trainer on that world would build.

No MPI here: the plan's side runs ``hpctrain.plan.plan`` and keeps the RunPlan it made; the Trainer's side
builds it as ``Trainer._build`` does, ``RunPlan.for_mesh`` of the mesh ``Mesh(dp=p.dp, pp=p.pp, tp=p.tp)``
would make over that many ranks (its sizes worked out here, not by parallel/mesh.py).
"""

import glob
import os
from types import SimpleNamespace

import pytest

from hpctrain.config import load_config
from hpctrain.errors import ConfigError, HpctrainError
from hpctrain.run_plan import RunPlan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "jobs", "configs", "*.toml")))
LAYOUTS = [  # --set overrides on top of each config's own layout
    (),
    ("parallel.zero=2",),
    ("parallel.pp=2", "parallel.stages=[]"),
    ("parallel.tp=2",),
    ("train.deterministic=true", "train.micro_batches=2"),
    ("train.deterministic=true", "parallel.zero=1"),
    ("parallel.reduce_dtype=\"bf16\"", "train.recompute=\"blocks\""),
    ("parallel.pp=2", "parallel.stages=[]", "parallel.schedule=\"interleaved-1f1b\"", "parallel.virtual_stages=2",
     "train.micro_batches=4"),
]
WORLDS = (1, 2, 4, 8)


def plan_side(cfg, world_size, monkeypatch):
    """The RunPlan ``hpctrain plan`` builds for ``cfg`` on ``world_size`` ranks (None: it refused the layout
    before making one), and the error it raised, if any."""
    from hpctrain.plan import plan

    made = []
    real = RunPlan.for_world.__func__

    def keep(cls, cfg, world_size):
        made.append(real(cls, cfg, world_size))
        return made[-1]

    monkeypatch.setattr(RunPlan, "for_world", classmethod(keep))
    try:
        plan(cfg, world_size)
        error = None
    except HpctrainError as e:  # the plan's layout checks, or the model's (tp, stages) after it
        error = e
    monkeypatch.undo()
    return (made[0] if made else None), error


def startup_side(cfg, world_size):
    """The RunPlan a Trainer builds on ``world_size`` ranks, or None where its mesh could not be made."""
    p = cfg.parallel
    mp = p.pp * p.tp
    dp = world_size // mp if p.dp == "auto" else p.dp
    if world_size % mp or dp * mp != world_size:
        return None  # Trainer._mesh_for refuses the layout first
    return RunPlan.for_mesh(cfg, SimpleNamespace(dp=dp, pp=p.pp, tp=p.tp, size=world_size))


def load(path, layout):
    try:
        return load_config(path, list(layout))
    except ConfigError:
        return None  # not a combination this config takes (both sides start from a loaded config)


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_hpctrain_plan_and_start_up_build_the_same_run_plan(path, monkeypatch):
    compared = 0
    for layout in LAYOUTS:
        cfg = load(path, layout)
        if cfg is None:
            continue
        for n in WORLDS:
            if cfg.train.batch_size % n:
                continue  # neither runs: the sampler and the plan refuse such a batch
            planned, error = plan_side(cfg, n, monkeypatch)
            try:
                started = startup_side(cfg, n)
            except ConfigError as e:  # deterministic's shards do not fit: the plan said the same
                assert planned is None and str(error) == str(e), (layout, n)
                continue
            if started is None:
                assert planned is None and error is not None, (layout, n)
                continue
            assert planned == started, (os.path.basename(path), layout, n)
            assert started.world_size == n
            compared += 1
    assert compared >= 4


def test_the_run_plan_holds_what_takes_effect(tmp_path):
    from helpers import config, make_classification

    make_classification(tmp_path / "d.h5")
    cfg = config(tmp_path / "d.h5", train={"batch_size": 16, "micro_batches": 2},
                 parallel={"zero": 2, "reduce_dtype": "bf16"})
    one = RunPlan.for_world(cfg, 1)
    assert (one.dp, one.zero, one.reduce_dtype, one.local_batch, one.micro_batches) == (1, 0, "fp32", 16, 2)
    two = RunPlan.for_world(cfg, 2)
    assert (two.dp, two.zero, two.reduce_dtype, two.local_batch, two.micro_batches) == (2, 2, "bf16", 8, 2)
    assert (two.schedule, two.virtual_stages, two.deterministic, two.deterministic_shards) == ("1f1b", 1, False, 0)
    assert two.resolved(cfg) is cfg


def test_a_trainer_runs_the_plan_hpctrain_plan_makes(tmp_path, mesh):
    from helpers import config, make_classification
    from hpctrain import Trainer

    make_classification(tmp_path / "d.h5")
    cfg = config(tmp_path / "d.h5", train={"batch_size": 16, "deterministic": True, "deterministic_shards": 4,
                                          "steps": 0})
    t = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    try:
        assert t.run_plan == RunPlan.for_world(cfg, mesh.size)
        assert t.cfg.train.micro_batches == t.run_plan.micro_batches == 4 // mesh.dp
        assert t.zero == t.run_plan.zero and t.runner.schedule.name == t.run_plan.schedule
    finally:
        t.close()
