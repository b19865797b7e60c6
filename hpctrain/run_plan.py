"""The shape of a run, derived once from a config and a layout: ``RunPlan``.

A config says what was asked for; some of it takes effect only in some layouts. ZeRO shards over data
parallelism, so with one data-parallel rank it is off; a pipeline schedule and its model chunks need
pp > 1; ``train.deterministic`` replaces the micro-batch count by its shards over dp. Start-up
(train/startup.py, train/step.py, train/loop.py) and ``hpctrain plan`` (hpctrain/plan.py) read these
from one RunPlan instead of each working them out, so a plan and the run it plans cannot disagree:

    run = RunPlan.for_world(cfg, 4)     # hpctrain plan: a world size, no MPI
    run = RunPlan.for_mesh(cfg, mesh)   # the Trainer: the mesh it runs on (dp, pp, tp)
    cfg = run.resolved(cfg)             # the config the run trains with (deterministic: its micro-batches)

Nothing here communicates or allocates.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .parallel import deterministic
from .parallel.mesh import resolve_layout

__all__ = ["RunPlan"]


@dataclass(frozen=True)
class RunPlan:
    """What a run of a config on a dp × pp × tp layout does, each value as it takes effect.

    ``zero``: the ZeRO stage in effect (``parallel.zero``; 0 with one data-parallel rank); ``micro_batches``: a
    rank's per step (``train.micro_batches``, or deterministic_shards / dp under ``train.deterministic``);
    ``local_batch``: the samples a data-parallel rank takes of a step (batch_size / dp; the sampler refuses a
    batch dp does not divide); ``schedule`` and ``virtual_stages``: the pipeline's ("1f1b" and 1 without one);
    ``stages``: the stage cut asked for (``parallel.stages``; empty: balanced by FLOPs, ``cut``);
    ``reduce_dtype``: the gradients' wire type ("fp32" where nothing is sent over dp); ``bucket_elems``: a
    gradient bucket's float32 elements (``parallel.bucket_mb``)."""

    dp: int
    pp: int
    tp: int
    zero: int
    batch_size: int
    local_batch: int
    micro_batches: int
    deterministic: bool
    deterministic_shards: int  # 0 when not deterministic
    schedule: str
    virtual_stages: int
    stages: tuple[tuple[int, int], ...]
    recompute: bool
    precision: str
    reduce_dtype: str
    bucket_elems: int

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @classmethod
    def derive(cls, cfg, *, dp: int, pp: int, tp: int) -> "RunPlan":
        """The plan of ``cfg`` on a dp × pp × tp layout; ConfigError (naming the setting) when
        ``train.deterministic``'s shards do not fit it (parallel/deterministic.py: ``shards_per_rank``)."""
        t, p = cfg.train, cfg.parallel
        zero = p.zero if dp > 1 else 0
        schedule = p.schedule if pp > 1 else "1f1b"
        micro_batches = t.micro_batches
        if t.deterministic:
            micro_batches = deterministic.shards_per_rank(t.deterministic_shards, dp=dp, zero=zero, schedule=schedule)
        return cls(dp=dp, pp=pp, tp=tp, zero=zero, batch_size=t.batch_size, local_batch=t.batch_size // dp,
                   micro_batches=micro_batches, deterministic=t.deterministic,
                   deterministic_shards=t.deterministic_shards if t.deterministic else 0, schedule=schedule,
                   virtual_stages=p.virtual_stages if pp > 1 else 1, stages=p.stages,
                   recompute=t.recompute == "blocks", precision=t.precision,
                   reduce_dtype=p.reduce_dtype if dp > 1 else "fp32", bucket_elems=max(1, int(p.bucket_mb * 1e6 / 4)))

    @classmethod
    def for_mesh(cls, cfg, mesh) -> "RunPlan":
        """The plan of ``cfg`` on ``mesh`` (its dp, pp and tp), as the Trainer builds it."""
        return cls.derive(cfg, dp=mesh.dp, pp=mesh.pp, tp=mesh.tp)

    @classmethod
    def for_world(cls, cfg, world_size: int) -> "RunPlan":
        """The plan of ``cfg`` on ``world_size`` ranks, as ``hpctrain plan`` builds it: the layout resolved as a
        Mesh resolves it (LayoutError when it does not fit the world size or the batch), then ``derive``."""
        p = cfg.parallel
        dp, pp, tp = resolve_layout(world_size, p.dp, p.pp, p.tp)
        if cfg.train.batch_size % dp:
            from .errors import LayoutError

            raise LayoutError(f"train.batch_size = {cfg.train.batch_size} is not divisible by dp = {dp}")
        return cls.derive(cfg, dp=dp, pp=pp, tp=tp)

    def resolved(self, cfg):
        """``cfg`` as the run trains with it: under ``train.deterministic`` its micro-batches are this plan's
        (``cfg`` itself otherwise)."""
        if not self.deterministic:
            return cfg
        return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batches=self.micro_batches))

    def notes(self, cfg) -> list[str]:
        """The start-up lines ``train.deterministic`` logs: a replaced micro-batch count, what the guarantee
        covers (none without it)."""
        if not self.deterministic:
            return []
        return deterministic.notes(self.deterministic_shards, batch_size=self.batch_size, dp=self.dp, tp=self.tp,
                                   asked=cfg.train.micro_batches)

    def cut(self, model) -> list:
        """The layer ranges of the virtual pipeline stages (stage s runs ``cut[s::pp]``: one range, or interleaved
        1F1B's model chunks): ``parallel.stages``, or the model's balanced cut."""
        return model.partition(self.pp, self.stages, tp=self.tp, virtual_stages=self.virtual_stages)
