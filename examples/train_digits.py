"""Train the bundled digits MLP from Python: a TOML config, overrides, a Trainer.

    mpiexec -n 2 python examples/train_digits.py                  # 2 data-parallel ranks, 600 steps
    python examples/train_digits.py --steps 100 --out /tmp/digits  # one process

Every rank runs this whole script. Building the Trainer, ``run()`` and ``close()`` are collective
over the world communicator: every rank must call each of them, in the same order. Rank 0 prints
the progress lines and writes the metrics; every rank writes its shard of each checkpoint (``--out``,
rank 0 its index); running the script again with the same ``--out`` resumes from the newest
checkpoint there.
"""

import argparse
import os

from hpctrain import Trainer, load_config

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "jobs", "configs", "digits.toml")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600, help="training steps (default 600)")
    p.add_argument("--out", default="runs/examples/digits", help="folder for checkpoints and metrics")
    args = p.parse_args()
    out = os.path.abspath(args.out)  # (relative paths in overrides resolve against the working directory too)
    cfg = load_config(CONFIG, [f"train.steps={args.steps}", f"train.eval_every={args.steps}",
                               f'checkpoint.dir="{out}"', f'train.metrics="{out}/metrics.jsonl"'])
    trainer = Trainer(cfg)  # collective: the mesh comes from [parallel] over COMM_WORLD
    try:
        last = trainer.run()  # collective; the last training and evaluation metrics
    finally:
        trainer.close()  # collective: frees the mesh the Trainer made
    if trainer.mesh.rank == 0:
        loss = f"loss {last['loss']:.4f}, " if "loss" in last else "already trained, "
        print(f"digits: step {trainer.step}, {loss}"
              f"validation accuracy {last['val_accuracy']:.3f}")


if __name__ == "__main__":
    main()
