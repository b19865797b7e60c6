#!/bin/bash
# The table of a sweep: one row per run folder under ROOT (each with a metrics.jsonl), its last validation
# metrics, best validation loss first.
#   bash jobs/slurm/sweep-summary.sh runs/sweep-lr
#SBATCH --job-name=hpctrain-sweep-summary
#SBATCH --ntasks=1
#SBATCH --time=00:05:00
#SBATCH --output=%x-%j.out
set -euo pipefail
ROOT=${1:-runs/sweep-lr}
if [[ ! -d $ROOT ]]; then
    echo "hpctrain: error: $ROOT is not a folder (the sweep's runs: one folder per task)" >&2
    exit 2
fi
python3 - "$ROOT" <<'PY'
import json
import math
import pathlib
import sys



def number(record, key):
    """A metric's value; NaN where it is missing or went NaN or infinite (written as null: JSON has neither)."""
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) else math.nan


root = pathlib.Path(sys.argv[1])
rows = []
for metrics in sorted(root.glob("*/metrics.jsonl")):
    last, step = {}, 0
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by a stopped job
        step = max(step, int(record.get("step", 0)))
        if "val_loss" in record:
            last = record
    rows.append((metrics.parent.name, step, last.get("step", "-"), number(last, "val_loss"),
                 number(last, "val_accuracy")))
if not rows:
    sys.exit(f"hpctrain: error: no */metrics.jsonl under {root}")
rows.sort(key=lambda r: (math.isnan(r[3]), r[3]))
print(f"{'run':<24} {'steps':>7} {'eval at':>8} {'val_loss':>9} {'val_acc':>8}")
for name, steps, at, loss, acc in rows:
    print(f"{name:<24} {steps:>7} {at!s:>8} {loss:>9.4f} {acc:>8.4f}")
PY
