"""Tensor parallelism on one node: tp = 2 on 2 ranks against tp = 1 on 1 rank, step time and tokens/s.

    python bench/bench_tensor_parallel.py                        # both benchmarks, 3 alternating repeats
    python bench/bench_tensor_parallel.py --only mlp --repeats 5 --mpiexec "mpiexec -bind-to core"

Run it plainly (not under mpiexec): it starts its ranks itself, ``mpiexec -n 1`` and ``-n 2`` in
turn, re-invoking this file with --worker, one rank per core (-bind-to core) and one BLAS thread
per rank (OMP_NUM_THREADS = OPENBLAS_NUM_THREADS = MKL_NUM_THREADS = 1). Each launch builds the
real Trainer over Mesh(tp=T), takes --warmup steps, then times --steps steps (a Barrier before
and after each) and its rank 0 prints one JSON line. Launches alternate tp = 1 and tp = 2,
swapping which goes first each repeat; figures are the medians over repeats of per-launch medians.

1. MLP block: the wide pair Linear 4096 -> 16384, GELU, Linear 16384 -> 4096 (column then row
   parallel), batch 256, SGD with momentum, loss "mse" on 4096 random targets (no head). A cheap
   replicated input, Linear 64 -> 4096 then LayerNorm (~0.2% of the FLOPs), puts the pair inside
   a network, as a block is: its input gradient and the backward Allreduce are then computed, as
   Megatron's count assumes (a model's first layer computes no input gradient). Target: tp1 time /
   tp2 time >= 1.6.
2. The GPT of jobs/configs/gpt-char.toml (its [model], AdamW, grad clip; batch 32) on the bundled
   pydoc corpus in a temporary token file: tokens/s at tp = 2 and tp = 1 and their ratio.

Beside each: the tensor-parallel bytes per step the trainer reports (``tp_bytes``) against
Megatron's count (per pair and micro-batch, an Allreduce of rows · width floats forward and one
backward; the GPT's vocab-parallel embedding and head count as one more pair, and its loss adds 3
Allreduces of one value a row, 28 bytes), and the time of one bare Allreduce of that rows x width float32 array on the 2 ranks.

Figure: tp 2 / tp 1 step time (MLP block) and tokens/s (gpt-char GPT); docs/performance.md, "Tensor parallel"
(every run behind it: docs/performance-log.md).
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
GPT_CONFIG = os.path.join(HERE, "..", "jobs", "configs", "gpt-char.toml")
FEATURES = 64


def mlp_cfg(a, folder, tp):
    from hpctrain.config import parse_config

    layers = [{"type": "linear", "in": FEATURES, "out": a.width}, {"type": "layernorm", "dim": a.width},
              {"type": "linear", "in": a.width, "out": a.hidden}, {"type": "gelu"},
              {"type": "linear", "in": a.hidden, "out": a.width}]
    return parse_config({
        "model": {"layers": layers},
        "data": {"path": f"{folder}/mlp.h5", "inputs": "x", "targets": "y", "val_fraction": 0.0, "shuffle": False},
        "train": {"loss": "mse", "batch_size": a.batch, "steps": 10**6, "backend": "cpu", "eval_every": 0},
        "optim": {"name": "sgd", "lr": 1e-4, "momentum": 0.9},
        "parallel": {"tp": tp},
    })


def gpt_cfg(a, folder, tp):
    from hpctrain.config import load_config

    return load_config(GPT_CONFIG, [f"data.path={json.dumps(folder + '/pydoc.h5')}", 'data.corpus="pydoc"',
                                    f"train.batch_size={a.gpt_batch}", 'train.backend="cpu"', 'train.metrics=""',
                                    "train.eval_every=0", 'checkpoint.dir=""', 'checkpoint.resume="never"',
                                    f"parallel.tp={tp}"])


def worker(a):
    """One launch (collective over COMM_WORLD): warm-up, timed steps, a bare Allreduce; rank 0 prints JSON."""
    import numpy as np  # the BLAS threads are already 1: the launcher's environment says so
    from mpi4py import MPI

    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer

    world, tp = MPI.COMM_WORLD, MPI.COMM_WORLD.size
    mesh = Mesh(tp=tp)
    cfg = (mlp_cfg if a.worker == "mlp" else gpt_cfg)(a, a.dir, tp)
    trainer = Trainer(cfg, mesh=mesh, log=lambda *args: None)
    lr, warmup, steps = cfg.optim.lr, *((a.warmup, a.steps) if a.worker == "mlp" else (a.gpt_warmup, a.gpt_steps))
    times, optim, tp_bytes = [], [], set()
    for s in range(warmup + steps):
        world.Barrier()
        t0 = time.perf_counter()
        timing = trainer.train_step(s, lr)
        world.Barrier()
        if s >= warmup:
            times.append(time.perf_counter() - t0)
            optim.append(timing["optim"])
            tp_bytes.add(timing.get("tp_bytes", 0))
    rows = a.batch if a.worker == "mlp" else a.gpt_batch * cfg.model.block_size
    width = a.width if a.worker == "mlp" else cfg.model.n_embd
    # the GPT: 2 pairs a block, and the vocab-parallel embedding's output with the head's input gradient: one more
    pairs = len(trainer.model.tp_pairs) if a.worker == "mlp" else 2 * cfg.model.n_layer + 1
    trainer.close()
    buf, ar = np.ones((rows, width), dtype=np.float32), []
    for i in range(25 if tp > 1 else 0):  # the activations' Allreduce alone, on the same ranks
        world.Barrier()
        t0 = time.perf_counter()
        mesh.tp_comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        if i >= 5:
            ar.append(time.perf_counter() - t0)
    if world.rank == 0:
        print(json.dumps({"tp": tp, "times": times, "optim": statistics.median(optim), "tp_bytes": sorted(tp_bytes),
                          "rows": rows, "width": width, "pairs": pairs, "params": trainer.part.owned_size,
                          "allreduce": statistics.median(ar) if ar else None,
                          "mpi": MPI.Get_library_version().splitlines()[0].strip(),
                          "threads": os.environ.get("OPENBLAS_NUM_THREADS")}), flush=True)
    mesh.free()


def launch(a, bench, tp, env):
    cmd = shlex.split(a.mpiexec) + ["-n", str(tp), sys.executable, os.path.abspath(__file__), "--worker", bench,
                                    "--dir", a.dir] + a.passthrough
    p = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout}{p.stderr}")
    return json.loads(lines[-1])


def compare(a, bench, env):
    """Alternating launches of tp = 1 and tp = 2; per tp, the per-launch medians of the step time."""
    runs = {1: [], 2: []}
    for r in range(a.repeats):
        for tp in (1, 2) if r % 2 == 0 else (2, 1):
            runs[tp].append(launch(a, bench, tp, env))
    if bench == "mlp" or a.only == "gpt":
        say_header(runs[2][0], a)
    med = {tp: [statistics.median(x["times"]) for x in rs] for tp, rs in runs.items()}
    t1, t2 = statistics.median(med[1]), statistics.median(med[2])
    last = runs[2][-1]
    rows, width, pairs = last["rows"], last["width"], last["pairs"]
    loss_bytes = 0 if bench == "mlp" else 28 * rows  # vocab-parallel cross-entropy: 3 Allreduces of 1 value a row
    megatron = pairs * 2 * rows * width * 4 + loss_bytes  # one micro-batch
    reported = sorted({b for x in runs[2] for b in x["tp_bytes"]})
    ar = statistics.median(x["allreduce"] for x in runs[2])
    opt = {tp: statistics.median(x["optim"] for x in rs) for tp, rs in runs.items()}
    per = ", ".join(f"tp{tp} " + " ".join(f"{m * 1e3:.1f}" for m in ms) for tp, ms in med.items())
    if bench == "mlp":
        print(f"MLP {FEATURES} -> LayerNorm -> [{a.width} -> {a.hidden} -> GELU -> {a.width}], batch {a.batch}, SGD "
              f"momentum 0.9, mse; {a.repeats} launches each of {a.steps} steps after {a.warmup} warm-up")
        print(f"  step time: tp1 on 1 rank {t1 * 1e3:.1f} ms, tp2 on 2 ranks {t2 * 1e3:.1f} ms (per launch, ms: {per})")
        print(f"  speed-up tp1 / tp2: {t1 / t2:.2f} (target >= 1.6)")
    else:
        tokens = rows
        print(f"GPT of gpt-char.toml, batch {a.gpt_batch} = {tokens:,} tokens a step, AdamW; {a.repeats} launches each of "
              f"{a.gpt_steps} steps after {a.gpt_warmup} warm-up")
        print(f"  tokens/s: tp1 on 1 rank {tokens / t1:,.0f}, tp2 on 2 ranks {tokens / t2:,.0f} (step ms: {per})")
        print(f"  ratio tp2 / tp1: {t1 / t2:.2f}")
    print(f"  optimizer step: tp1 {opt[1] * 1e3:.1f} ms, tp2 {opt[2] * 1e3:.1f} ms; parameters per rank: tp1 "
          f"{runs[1][0]['params']:,}, tp2 {last['params']:,}")
    loss_text = f" + the loss's 28 B x {rows} rows" if loss_bytes else ""
    print(f"  tp bytes per step (per rank): trainer {', '.join(f'{b:,}' for b in reported)}; Megatron {pairs} pair(s) x 2 "
          f"Allreduces x {rows} x {width} floats x 4 B{loss_text} = {megatron:,} -> "
          f"{'agree' if reported == [megatron] else 'DIFFER'}")
    print(f"  bare Allreduce of {rows} x {width} float32 on 2 ranks: {ar * 1e3:.2f} ms; x {2 * pairs} a step = "
          f"{2 * pairs * ar * 1e3:.1f} ms = {2 * pairs * ar / t2:.1%} of the tp2 step")


def say_header(info, a):
    print(f"{info['mpi']}; launcher {a.mpiexec!r}; BLAS threads per rank {info['threads']}; "
          f"{os.cpu_count()} cores; python {sys.version.split()[0]}")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=("mlp", "gpt"))
    p.add_argument("--repeats", type=int, default=3, help="launches of each tp per benchmark")
    p.add_argument("--mpiexec", default=f"{os.path.join(os.path.dirname(sys.executable), 'mpiexec')} -bind-to core")
    sizes = [("--width", 4096), ("--hidden", 16384), ("--batch", 256), ("--warmup", 2), ("--steps", 5),
             ("--gpt-batch", 32), ("--gpt-warmup", 3), ("--gpt-steps", 20)]
    for flag, default in sizes:
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--worker", choices=("mlp", "gpt"), help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    a.passthrough = [str(x) for flag, _ in sizes for x in (flag, getattr(a, flag[2:].replace("-", "_")))]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    with tempfile.TemporaryDirectory(prefix="hpctrain-bench-tp-") as folder:
        a.dir = folder
        if a.only != "gpt":
            import h5py
            import numpy as np

            rng = np.random.default_rng(0)
            with h5py.File(f"{folder}/mlp.h5", "w") as f:
                f["x"] = rng.standard_normal((4 * a.batch, FEATURES)).astype(np.float32)
                f["y"] = rng.standard_normal((4 * a.batch, a.width)).astype(np.float32)
            compare(a, "mlp", env)
        if a.only != "mlp":
            compare(a, "gpt", env)


if __name__ == "__main__":
    main()
