"""Time to build and check a pipeline schedule at large pp x micro-batches (every rank does it at start-up).

    python bench/bench_schedule_build.py
    git show f202781:hpctrain/parallel/schedule.py > /tmp/schedule_before.py
    python bench/bench_schedule_build.py --module /tmp/schedule_before.py    # the schedule code of another revision

``--module`` takes a self-contained schedule.py (revisions before parallel/instructions.py and
parallel/schedule_check.py were split out); a later revision is timed from its own checkout.

Each shape once: ``make_schedule`` (the instruction lists, sends that would deadlock under rendezvous sends
fused with a receive) and ``check_schedule`` (the proof the executor relies on), in seconds.

Figure: seconds to build and check a schedule at large pp x micro-batches; docs/performance.md, "Pipeline" (every
run behind it: docs/performance-log.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = [("1f1b", 16, 64, 1), ("zero-bubble", 8, 64, 1), ("zero-bubble", 16, 64, 1),
          ("interleaved-1f1b", 8, 64, 2), ("interleaved-1f1b", 16, 64, 2), ("interleaved-1f1b", 8, 64, 4),
          ("zero-bubble-h2", 16, 64, 1), ("1f1b", 64, 512, 1), ("zero-bubble", 64, 512, 1),
          ("interleaved-1f1b", 64, 512, 2)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--module", help="a schedule.py to time instead of hpctrain's (e.g. from an older revision)")
    args = p.parse_args()
    if args.module:
        spec = importlib.util.spec_from_file_location("hpctrain.parallel._schedule_timed", args.module)
        sched = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = sched
        spec.loader.exec_module(sched)
    else:
        from hpctrain.parallel import schedule as sched
    print(f"schedule code: {args.module or sched.__file__}")
    for name, pp, m, v in SHAPES:
        if name not in sched.SCHEDULES + (sched.INTERLEAVED,):
            continue  # a schedule the timed code does not have
        t0 = time.perf_counter()
        schedule = sched.make_schedule(name, pp, m, v)
        t1 = time.perf_counter()
        sched.check_schedule(schedule)
        t2 = time.perf_counter()
        size = sum(len(stage) for stage in schedule.stages)
        print(f"{name:>16} pp {pp:>2} x m {m} x v {v}: {size:>6,} instructions, build {t1 - t0:8.3f} s, "
              f"check {t2 - t1:6.3f} s", flush=True)


if __name__ == "__main__":
    main()
