"""Resume only the run you asked for: the checkpoint's settings against this run's.

``checkpoint.resume = "auto"`` picks up whatever checkpoint.dir holds. A run started again with
another learning rate, model or data would silently continue (or, when finished, silently do
nothing) with the old one. Every checkpoint stores its run's resolved config; this compares it
with the new run's and names each setting that changes the result:

    changed = changed_settings(saved_toml, cfg)      # [(key, then, now)], the allowed ones left out
    problem = resume_problem(path, changed)          # one line, or None

May differ (``MAY_DIFFER``): how long and how often (train.steps, the log/eval/checkpoint
cadence), where (paths), how it is laid out on the machine (every parallel.* but the staleness,
micro-batches, recompute, the backend) and what to do about bad steps. Everything
else changes the numbers and must match, unless ``checkpoint.allow_changed`` lists it. A
setting the checkpoint's hpctrain did not have yet is not compared.
"""

from __future__ import annotations

import tomllib

__all__ = ["MAY_DIFFER", "changed_settings", "resume_problem"]

MAY_DIFFER = frozenset({
    "train.steps", "train.log_every", "train.eval_every", "train.metrics", "train.trace", "train.tensorboard",
    "train.backend", "train.micro_batches", "train.recompute", "train.skip_nonfinite", "train.max_skipped_steps",
    "train.debug_collectives", "train.collective_timeout", "train.progress",
    "data.path", "data.allow_external", "data.corpus",
    "parallel.dp", "parallel.pp", "parallel.tp", "parallel.schedule", "parallel.virtual_stages", "parallel.stages",
    "parallel.bucket_mb",
    "parallel.overlap", "parallel.cuda_aware", "parallel.servers", "parallel.zero",
    "parallel.mode",  # staleness 0 is synchronous training in either mode; parallel.staleness changes the math
})  # and every checkpoint.* setting


def _flat(text: str) -> dict:
    return {f"{section}.{key}": value for section, table in tomllib.loads(text).items() if isinstance(table, dict)
            for key, value in table.items()}


def changed_settings(saved_toml: str, cfg) -> list[tuple[str, object, object]]:
    """(setting, the checkpoint's value, this run's) for each result-changing setting that differs."""
    if not saved_toml:
        return []  # a checkpoint written without its config: nothing to compare
    try:
        then = _flat(saved_toml)
    except tomllib.TOMLDecodeError:
        return []  # the checkpoint's digest vouched for its bytes; an unreadable config is not this check's
    now = _flat(cfg.to_toml())
    allowed = MAY_DIFFER | set(cfg.checkpoint.allow_changed)
    return [(key, then[key], value) for key, value in now.items()
            if key in then and then[key] != value and key not in allowed and not key.startswith("checkpoint.")]


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def resume_problem(path: str, changed: list) -> str | None:
    """The one-line refusal naming the changed settings and the ways out, or None."""
    if not changed:
        return None
    shown = "; ".join(f"{k} {_show(a)} then, {_show(b)} now" for k, a, b in changed[:4])
    more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
    keys = ", ".join(f'"{k}"' for k, _, _ in changed)
    return (f"checkpoint.resume = \"auto\" found {path}, written by a run with other settings ({shown}{more}): "
            "give this run a new checkpoint.dir to start afresh, or continue that run with the new settings by "
            f"listing them: --set 'checkpoint.allow_changed=[{keys}]'")
