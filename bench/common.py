"""Shared bits of the benchmarks: timing and a synthetic HDF5 data set."""

import os
import shlex
import subprocess
import time

import h5py
import numpy as np


def best_of(fn, repeat=5, number=1, warmup=1):
    """Best per-call time of ``fn`` over ``repeat`` rounds of ``number`` calls (seconds)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def extract_revision(rev: str, folder: str) -> str:
    """Git revision ``rev`` of this repository written into the new folder ``folder`` (``git archive``), for a
    benchmark's ``--before REV`` to run the same code from it; returns ``folder``."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.makedirs(folder)
    subprocess.run(f"git -C {shlex.quote(root)} archive {shlex.quote(rev)} | tar -x -C {shlex.quote(folder)}",
                   shell=True, check=True)
    return folder


def synthetic_classification(path, n, features, classes, seed=0):
    rng = np.random.default_rng(seed)
    with h5py.File(path, "w") as f:
        f["x"] = rng.standard_normal((n, features)).astype(np.float32)
        f["y"] = rng.integers(0, classes, n).astype(np.int64)


def mlp_config(path, sizes, batch, optim="sgd", **train):
    from hpctrain.config import parse_config

    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append({"type": "linear", "in": a, "out": b})
        if i < len(sizes) - 2:
            layers.append({"type": "relu"})
    return parse_config({
        "model": {"layers": layers},
        "data": {"path": str(path), "inputs": "x", "targets": "y", "val_fraction": 0.0, "shuffle": False},
        "train": {"batch_size": batch, "steps": 10**6, "backend": "cpu", "eval_every": 0, **train},
        "optim": {"name": optim, "lr": 1e-3, "momentum": 0.9 if optim == "sgd" else 0.0},
    })


def shared_tempdir(comm):
    """A temporary folder made by rank 0 and named to every rank with a buffer Bcast (they share this node)."""
    import tempfile

    name = np.zeros(256, dtype=np.uint8)
    if comm.rank == 0:
        path = tempfile.mkdtemp(prefix="hpctrain-bench-").encode()
        name[: len(path)] = np.frombuffer(path, dtype=np.uint8)
    comm.Bcast(name, root=0)
    return name.tobytes().rstrip(b"\0").decode()
