"""The step arena's plan for a GPT step (hpctrain/backend/arena.py): the slab against the most bytes the step holds
at once, the requests it replays, and the arrays a step allocates with the arena and without.

    NUMBA_ENABLE_CUDASIM=1 python bench/bench_arena.py                       # the simulator: no GPU needed
    NUMBA_ENABLE_CUDASIM=1 python bench/bench_arena.py --micro-batches 1 4 --n-layer 2
    python bench/bench_arena.py --n-layer 6 --n-embd 384 --block-size 256   # on a GPU

The figures in docs/gpu.md ("The step arena") come from the first command.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(os.path.dirname(HERE), "tests")]


def main():
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--micro-batches", type=int, nargs="+", default=[1, 4])
    a.add_argument("--n-layer", type=int, default=2)
    a.add_argument("--n-embd", type=int, default=8)
    a.add_argument("--n-head", type=int, default=2)
    a.add_argument("--block-size", type=int, default=8)
    a.add_argument("--batch", type=int, default=4)
    args = a.parse_args()

    from helpers import gpt_config, make_tokens
    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer

    mesh = Mesh()
    with tempfile.TemporaryDirectory() as tmp:
        make_tokens(f"{tmp}/t.h5", n=max(600, 4 * args.batch * args.block_size))
        for m in args.micro_batches:
            allocs = {}
            for arena in (True, False):
                cfg = gpt_config(f"{tmp}/t.h5", model={"block_size": args.block_size, "n_embd": args.n_embd,
                                                       "n_layer": args.n_layer, "n_head": args.n_head},
                                 data={"val_fraction": 0.0}, cuda={"arena": arena},
                                 train={"steps": 3, "batch_size": args.batch, "micro_batches": m, "backend": "cuda",
                                        "grad_clip": 0.5})
                trainer = Trainer(cfg, mesh=mesh, log=lambda *x: None)
                allocs[arena] = [trainer.train_step(s, 0.01)["device_allocs"] for s in range(3)]
                if arena:
                    plan = trainer.be.arena
                    print(f"GPT {args.n_layer} layers, width {args.n_embd}, {args.batch} x {args.block_size} tokens, "
                          f"{m} micro-batch(es): {len(plan._plan or ())} requests a step; slab {plan.slab_bytes:,} B "
                          f"against a peak of {plan.peak_bytes:,} B alive at once "
                          f"({plan.slab_bytes / max(plan.peak_bytes, 1):.3f})")
                trainer.close()
            print(f"  arrays allocated in steps 1-3: with the arena {allocs[True]}, without {allocs[False]}")
    mesh.free()


if __name__ == "__main__":
    main()
