"""Activation recomputation: peak RSS and step time of a GPT with train.recompute = "none" and "blocks".

    python bench/bench_recompute.py                 # n_layer 6, n_embd 128, block_size 256, batch 16, one process
    python bench/bench_recompute.py --repeat 5

One process (``hpctrain train``) per setting, alternated over ``--repeat`` rounds so drift in the
machine's load hits both alike. Peak RSS from ``/usr/bin/time -f %M``; step time: the median over
the run's steps (compute + comm + optim from the metrics file, the first step left out), then the
median over rounds. Targets: peak RSS at least 150 MB lower with "blocks", step time at most 1.35x.
The data: the pydoc character corpus (``data.corpus = "pydoc"``). MB here is 10^6 bytes.

Figure: peak RSS and step time, recompute "blocks" against "none"; docs/performance.md, "Activation recomputation"
(every run behind it: docs/performance-log.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile


def write_config(folder, name, args, *, recompute="none", attention="math"):
    """The bench's GPT config as ``<name>.toml`` in ``folder`` (bench/bench_attention.py uses it too)."""
    path = os.path.join(folder, f"{name}.toml")
    with open(path, "w") as f:
        f.write(f"""[model]
kind = "gpt"
vocab_size = 128
block_size = {args.block_size}
n_layer = {args.n_layer}
n_head = {getattr(args, "n_head", 4)}
n_embd = {args.n_embd}
attention = "{attention}"
[data]
path = "{folder}/pydoc.h5"
corpus = "pydoc"
tokens = "tokens"
val_fraction = 0.0
[train]
batch_size = {args.batch}
steps = {args.steps}
log_every = 1
eval_every = 0
backend = "cpu"
recompute = "{recompute}"
metrics = "m-{name}.jsonl"
[optim]
name = "adamw"
lr = 1e-3
""")
    return path


def run_once(folder, config, name):
    """(peak RSS in MB, median step seconds) of ``hpctrain train config``."""
    hpctrain = os.path.join(os.path.dirname(sys.executable), "hpctrain")
    metrics = os.path.join(folder, f"m-{name}.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    proc = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", "rss", hpctrain, "train", config], cwd=folder,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        sys.exit(f"hpctrain train {config} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    with open(os.path.join(folder, "rss")) as f:
        peak = int(f.read().split()[-1]) * 1024 / 1e6
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if '"loss"' in line][1:]
    return peak, statistics.median(r["compute_s"] + r["comm_s"] + r["optim_s"] for r in rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="hpctrain-bench-recompute-")
    try:
        got = {"none": [], "blocks": []}
        for _ in range(args.repeat):
            for recompute in got:
                config = write_config(folder, recompute, args, recompute=recompute)
                got[recompute].append(run_once(folder, config, recompute))
        print(f"GPT n_layer {args.n_layer}, n_embd {args.n_embd}, block_size {args.block_size}, batch {args.batch}, "
              f"one process, {args.steps} steps, median of {args.repeat} rounds:")
        base_rss = statistics.median(p for p, _ in got["none"])
        base_t = statistics.median(t for _, t in got["none"])
        for recompute, runs in got.items():
            rss, t = statistics.median(p for p, _ in runs), statistics.median(t for _, t in runs)
            line = f"  recompute {recompute!r}: peak RSS {rss:,.0f} MB, {t * 1e3:,.0f} ms/step"
            if recompute != "none":
                line += (f"; {base_rss - rss:,.0f} MB lower (target >= 150), step time {t / base_t:.2f}x "
                         "(target <= 1.35)")
            print(line)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
