"""Resume only the run you asked for: the checkpoint's settings against this run's.

``checkpoint.resume = "auto"`` picks up whatever checkpoint.dir holds. A run started again with
another learning rate, model or data would silently continue (or, when finished, silently do
nothing) with the old one. Every checkpoint stores its run's resolved config; this compares it
with the new run's and names each setting that changes the result:

    changed = changed_settings(saved_toml, cfg)      # [(key, then, now)], the allowed ones left out
    problem = resume_problem(path, changed)          # one line, or None

May differ (``MAY_DIFFER``): how long and how often (train.steps, the log/eval/checkpoint
cadence), where (paths), how it is laid out on the machine (every parallel.* but the staleness,
micro-batches, recompute, attention's memory plan, the backend, the GEMMs' precision) and what to do about bad steps. Everything
else changes the numbers and must match, unless ``checkpoint.allow_changed`` lists it. A
setting the checkpoint's hpctrain did not have yet is not compared, nor one that has no effect in
either run (``_effective``: SGD's momentum under AdamW, the deterministic shards of a run that is not
deterministic, the staleness of synchronous training). The data is compared by its contents
(``data=``, data.fingerprint), not by its path: a moved file resumes, other data under the same
name does not, unless ``allow_changed`` lists ``"data.path"``.
"""

from __future__ import annotations

import tomllib

__all__ = ["MAY_DIFFER", "changed_settings", "resume_problem"]

MAY_DIFFER = frozenset({
    "train.steps", "train.log_every", "train.eval_every", "train.metrics", "train.trace", "train.tensorboard",
    "train.backend", "train.micro_batches", "train.recompute", "train.skip_nonfinite", "train.max_skipped_steps",
    "train.debug_collectives", "train.collective_timeout", "train.progress", "train.peak_tflops", "model.attention",
    "train.precision",  # checkpoints hold the float32 master weights whatever the GEMMs' precision
    "data.path", "data.allow_external", "data.corpus",
    "parallel.dp", "parallel.pp", "parallel.tp", "parallel.schedule", "parallel.virtual_stages", "parallel.stages",
    "parallel.bucket_mb",
    "parallel.overlap", "parallel.cuda_aware", "parallel.servers", "parallel.zero", "parallel.zero_reduce",
    "parallel.reduce_dtype",
    "parallel.mode",  # staleness 0 is synchronous training in either mode; parallel.staleness changes the math
    "cuda.arena",  # where a step's arrays live, not what they hold
    "cuda.graphs",  # how the step's kernels are launched, not what they compute
    "cuda.gemm",  # which library computes the float32 products (cuBLASLt or numba's kernels), not what they are
})  # and every checkpoint.* setting


def _flat(text: str) -> dict:
    return {f"{section}.{key}": value for section, table in tomllib.loads(text).items() if isinstance(table, dict)
            for key, value in table.items()}


DATA = "data.path"  # the key a change of the data's contents is reported under, and allowed by


def _effective(flat: dict) -> dict:
    """The settings of one run less those that have no effect in it (compared, they would refuse a resume for
    nothing); the staleness as the synchronous trainer uses it (0)."""
    out = dict(flat)
    if out.get("parallel.mode", "sync") != "async_ps" and "parallel.staleness" in out:
        out["parallel.staleness"] = 0
    if not out.get("train.deterministic", False):
        out.pop("train.deterministic_shards", None)
    name = out.get("optim.name")
    if name is not None and name != "sgd":
        out.pop("optim.momentum", None)
        out.pop("optim.nesterov", None)
    if name == "sgd":
        out.pop("optim.betas", None)
        out.pop("optim.eps", None)
    return out


def changed_settings(saved_toml: str, cfg, *, data: tuple[str, str] = ("", "")) -> list[tuple[str, object, object]]:
    """(setting, the checkpoint's value, this run's) for each result-changing setting that differs; ``data``:
    (the checkpoint's data fingerprint, this run's), reported as ``data.path`` when both are known and differ."""
    allowed = MAY_DIFFER | set(cfg.checkpoint.allow_changed)
    then_data, now_data = data
    out = []
    comparable = then_data.partition(":")[0] == now_data.partition(":")[0]  # hashed the same way (data.py)
    if then_data and now_data and comparable and then_data != now_data and DATA not in cfg.checkpoint.allow_changed:
        out.append((DATA, then_data, now_data))
    if not saved_toml:
        return out  # a checkpoint written without its config: no settings to compare
    try:
        then = _effective(_flat(saved_toml))
    except tomllib.TOMLDecodeError:
        return out  # the checkpoint's digest vouched for its bytes; an unreadable config is not this check's
    now = _effective(_flat(cfg.to_toml()))
    return out + [(key, then[key], value) for key, value in now.items()
                  if key in then and then[key] != value and key not in allowed and not key.startswith("checkpoint.")]


def _show(value) -> str:
    """A value as the config file writes it (TOML), shortened."""
    text = _toml(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return repr(value)


def resume_problem(path: str, changed: list, allowed=()) -> str | None:
    """The one-line refusal naming the changed settings and the ways out, or None. ``allowed``: what
    ``checkpoint.allow_changed`` lists already (the suggested list keeps it: ``--set`` replaces the list)."""
    if not changed:
        return None
    shown = "; ".join(f"the data at {DATA} (its contents' fingerprint {a} then, {b} now)" if k == DATA
                      else f"{k} {_show(a)} then, {_show(b)} now" for k, a, b in changed[:4])
    more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
    keys = ", ".join(f'"{k}"' for k in dict.fromkeys([*allowed, *(k for k, _, _ in changed)]))
    return (f"checkpoint.resume = \"auto\" found {path}, written by a run with other settings ({shown}{more}): "
            "give this run a new checkpoint.dir to start afresh, or continue that run with the new settings by "
            f"listing them: --set 'checkpoint.allow_changed=[{keys}]'")
