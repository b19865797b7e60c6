"""The commands that are one library call each: ``inspect``, ``export``, ``sample``, ``predict``, ``plot``, ``config``,
``env``. None starts MPI (hpctrain env only asks the library which it is).

    hpctrain inspect runs/digits/ckpt-00000300.h5
    hpctrain export runs/gpt-char/ckpt-00001500.h5 gpt.safetensors
    hpctrain sample runs/gpt-char/ckpt-00001500.h5 --prompt "The " --tokens 300
    hpctrain predict runs/digits/ckpt-00000600.h5 --data new.h5 --out p.h5
    hpctrain plot runs/digits/metrics.jsonl -o loss.png
    hpctrain config jobs/configs/gpt-char.toml --set parallel.tp=2
    hpctrain env
"""

from __future__ import annotations

import os

__all__ = ["run_inspect", "run_export", "run_sample", "run_predict", "run_plot", "run_config", "run_env"]


def run_inspect(args) -> int:
    from ..checkpoint import inspect, list_checkpoints
    from ..errors import CheckpointError

    if not os.path.lexists(args.path):  # a wrong path is the command line's error (2), not a failed check (1)
        folder = os.path.dirname(args.path) or "."
        held = [os.path.basename(p) for _, p in list_checkpoints(folder)] if os.path.isdir(folder) else []
        error = CheckpointError(f"{args.path} does not exist" + (f"; {folder} holds {', '.join(held)}" if held else ""))
        error.collective = True  # no other rank to stop
        raise error
    report, ok = inspect(args.path)
    print(report)
    return 0 if ok else 1


def run_export(args) -> int:
    from ..export import export

    print(export(args.checkpoint, args.output, args.format, force=args.force, dtype=args.dtype))
    return 0


def run_sample(args) -> int:
    from ..sample import sample

    print(sample(args.checkpoint, args.prompt, args.tokens, temperature=args.temperature, top_k=args.top_k,
                 seed=args.seed, vocab=args.vocab, backend=args.backend, cache=not args.no_cache,
                 tokens_only=args.tokens_only, tokenizer=args.tokenizer))
    return 0


def run_predict(args) -> int:
    from ..predict import predict

    print(predict(args.checkpoint, args.data, args.out, inputs=args.inputs, batch=args.batch, backend=args.backend,
                  force=args.force))
    return 0


def run_plot(args) -> int:
    from ..plot import plot

    print(plot(args.file, args.output, steps=args.steps))
    return 0


def run_config(args) -> int:
    from ..config import load_config

    print(load_config(args.config, args.overrides).to_toml(), end="")
    return 0


def run_env(args) -> int:
    from ..envinfo import report

    print(report())
    return 0
