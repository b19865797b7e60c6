"""Flash attention on the CPU: peak RSS, planned activations and step time of a GPT with model.attention =
"math" (the probabilities [B, H, T, T] kept for the backward) and "flash" (each row's log-sum-exp only).

    python bench/bench_attention.py                  # n_layer 4, n_embd 128, n_head 4, block_size 1024, batch 4
    python bench/bench_attention.py --block-size 256 --batch 16 --repeat 5

One process (``hpctrain train``) per setting, alternated over ``--repeat`` rounds (bench/bench_recompute.py's
runner and config: the pydoc character corpus, AdamW). Peak RSS from ``/usr/bin/time -f %M``; step time: the
median over the run's steps (compute + comm + optim, the first step left out), then over rounds; "planned" is
``hpctrain plan``'s activation figure for the config. What "flash" saves is n_layer · B · H · (T² − T) · 4
bytes of kept probabilities plus the backward's [B, H, T, T] scratch, less its own scratch of a few heads'
[T, T]. MB here is 10^6 bytes.

Figure: peak RSS and step time, attention "flash" against "math"; docs/performance.md, "Flash attention on the CPU"
(every run behind it: docs/performance-log.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_recompute import run_once, write_config  # noqa: E402

from hpctrain.config import load_config  # noqa: E402
from hpctrain.plan import plan  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="hpctrain-bench-attention-")
    try:
        got, planned = {"math": [], "flash": []}, {}
        for _ in range(args.repeat):
            for attention in got:
                config = write_config(folder, attention, args, attention=attention)
                planned[attention] = plan(load_config(config), 1)[0].activation_bytes / 1e6
                got[attention].append(run_once(folder, config, attention))
        print(f"GPT n_layer {args.n_layer}, n_embd {args.n_embd}, n_head {args.n_head}, block_size "
              f"{args.block_size}, batch {args.batch}, one process, {args.steps} steps, median of {args.repeat} "
              "rounds:")
        base_rss = statistics.median(p for p, _ in got["math"])
        base_t = statistics.median(t for _, t in got["math"])
        for attention, runs in got.items():
            rss, t = statistics.median(p for p, _ in runs), statistics.median(t for _, t in runs)
            line = (f"  attention {attention!r}: peak RSS {rss:,.0f} MB, activations planned "
                    f"{planned[attention]:,.0f} MB, {t * 1e3:,.0f} ms/step")
            if attention != "math":
                line += f"; {base_rss - rss:,.0f} MB lower, step time {t / base_t:.2f}x"
            print(line)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
