"""Each pipeline schedule's bubble on paper, from its instruction lists (no MPI, no model).

    python bench/schedule_bubbles.py                      # P = 2, 4; m = P, 2P, 4P; v = 2, 4
    python bench/schedule_bubbles.py -p 4 -m 8 16 -v 2 3

A forward, B or W of one chunk is one unit, a whole backward two; each stage runs its list as early as its
messages allow (``schedule.paper_makespan``). The bubble is the share of the makespan a stage spends idle,
1 − 3·m·v / makespan, next to the formula each schedule is known by: (P − 1)/(m + P − 1) for 1F1B and GPipe,
(P − 1)/(v·m + P − 1) for interleaved 1F1B, and for the zero-bubble schedules the floor of a step that ends with
every stage's gradients, (P − 1)/(3m + P − 1). Every schedule listed is proved deadlock-free by the checker first.

Figure: each pipeline schedule's bubble on paper; docs/performance.md, "Pipeline" (every run behind it:
docs/performance-log.md).
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hpctrain.parallel.schedule import check_schedule, make_schedule, paper_makespan  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-p", type=int, nargs="+", default=[2, 4], help="pipeline stages")
    ap.add_argument("-m", type=int, nargs="+", default=None, help="micro-batches (default: P, 2P, 4P)")
    ap.add_argument("-v", type=int, nargs="+", default=[2, 4], help="virtual stages (chunks per stage)")
    args = ap.parse_args()
    print(f"{'P':>2} {'m':>3} {'schedule':<22} {'bubble':>7} {'formula':>8} {'peak live (stage 0)':>20} "
          f"{'peak live (last stage)':>23}")
    for p in args.p:
        for m in args.m or (p, 2 * p, 4 * p):
            floor = (p - 1) / (3 * m + p - 1)
            rows = [("1f1b", 1, (p - 1) / (m + p - 1)), ("zero-bubble", 1, floor), ("zero-bubble-h2", 1, floor)]
            rows += [("interleaved-1f1b", v, (p - 1) / (v * m + p - 1)) for v in args.v if m % p == 0]
            for name, v, formula in rows:
                schedule = make_schedule(name, p, m, v)
                stats = check_schedule(schedule)
                bubble = 1 - 3 * m * v / paper_makespan(schedule)
                label = name if v == 1 else f"{name}, v {v}"
                shown = f"{formula:8.3f}" if formula is not None else f"{'':8}"
                print(f"{p:>2} {m:>3} {label:<22} {bubble:7.3f} {shown} {stats.peak_live[0] / v:20.1f} "
                      f"{stats.peak_live[-1] / v:23.1f}")


if __name__ == "__main__":
    main()
