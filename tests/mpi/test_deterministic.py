"""``train.deterministic``: the same bits on every layout (parallel/deterministic.py).

Run under ``mpiexec -n 1``, ``-n 2`` and ``-n 4`` by tests/test_suites.py. Each run trains dp = world size,
and dp = world / 2 with pp = 2 where the world size is even, with ``train.micro_batches`` 1 and 2 (both
replaced by shards / dp), and compares with one process training the same config alone on COMM_SELF
(dp 1, pp 1, four micro-batches): every parameter bitwise (sha256), every logged loss, gradient norm and
evaluation exactly. Together the runs at 1, 2 and 4 ranks cover dp 1/2/4 x pp 1/2 x micro-batches 1/2.
"""

import dataclasses
import glob
import hashlib
import json
import os

import numpy as np
import pytest
from mpi4py import MPI

from helpers import config, copy_checkpoint, gpt_config, train_params as train

ADAMW = {"name": "adamw", "lr": 0.01, "weight_decay": 0.01}
DET = {"steps": 20, "batch_size": 16, "deterministic": True, "deterministic_shards": 4, "grad_clip": 0.5,
       "log_every": 1, "eval_every": 5}
SMALL_BUCKETS = {"bucket_mb": 0.0002}  # several buckets: the tree runs bucket by bucket


def layouts(comm):
    """(dp, pp) this world size runs."""
    return [(comm.size, 1)] + ([(comm.size // 2, 2)] if comm.size % 2 == 0 else [])


def digest(params) -> str:
    return hashlib.sha256(b"".join(params[n].tobytes() for n in sorted(params))).hexdigest()


def records(path) -> list[dict]:
    """The metrics file's results (timings left out)."""
    keep = ("step", "loss", "grad_norm", "lr", "val_loss", "val_accuracy")
    with open(path) as f:
        return [{k: r[k] for k in keep if k in r} for r in map(json.loads, f) if "loss" in r or "val_loss" in r]


def with_(cfg, **sections):
    return dataclasses.replace(cfg, **{name: dataclasses.replace(getattr(cfg, name), **values)
                                       for name, values in sections.items()})


def run(cfg, comm, metrics):
    """(sha256 of the final parameters, the metrics file's results on rank 0 of ``comm``) on every rank."""
    cfg = with_(cfg, train={"metrics": metrics})
    params = train(cfg, comm)
    text = json.dumps(records(metrics)) if comm.rank == 0 else None
    return digest(params), json.loads(comm.bcast(text, root=0))


def alone(cfg, comm, folder):
    """The reference: this rank trains ``cfg`` alone, dp 1 and pp 1."""
    cfg = with_(cfg, parallel={"dp": "auto", "pp": 1, "stages": ()})
    return run(cfg, MPI.COMM_SELF, f"{folder}/alone-{comm.rank}.jsonl")


def agree(comm, problem):
    """Every rank fails with rank 0's finding, or none does (a lone failing rank would leave the others waiting)."""
    problem = comm.bcast(problem, root=0)
    assert problem is None, problem


def mlp(data, **parallel):
    return config(data, optim=ADAMW, train=DET, data={"shuffle": True, "val_fraction": 0.25},
                  parallel={**SMALL_BUCKETS, **parallel})


def gpt(tokens, **parallel):
    return gpt_config(tokens, optim=ADAMW, train=DET, parallel={**SMALL_BUCKETS, **parallel})


def gpt_dropout(tokens, **parallel):
    return with_(gpt(tokens, **parallel), model={"dropout": 0.2})


def gpt_flash(tokens, **parallel):
    return with_(gpt(tokens, **parallel), model={"dropout": 0.2, "attention": "flash"})


@pytest.mark.parametrize("kind", ["mlp", "gpt", "gpt-dropout", "gpt-flash"])
@pytest.mark.parametrize("micro", [1, 2], ids=["1-micro", "2-micro"])
def test_every_layout_gives_the_bits_of_one_process(comm, shared_dir, data, tokens, kind, micro):
    """With dropout too: every layout draws one process's masks (nn/dropout.py); flash attention computes a
    sample's heads alike whatever micro-batch holds it."""
    make = {"mlp": mlp, "gpt": gpt, "gpt-dropout": gpt_dropout, "gpt-flash": gpt_flash}[kind]
    want = alone(make(data if kind == "mlp" else tokens), comm, shared_dir)
    for dp, pp in layouts(comm):
        cfg = make(data if kind == "mlp" else tokens, pp=pp)
        got = run(with_(cfg, train={"micro_batches": micro}), comm, f"{shared_dir}/{kind}-dp{dp}-pp{pp}.jsonl")
        agree(comm, None if got == want else f"{kind} dp {dp} pp {pp} micro {micro}: {got} != {want}")


def test_the_comparison_sees_the_last_bit(comm, shared_dir, data):
    """Without the mode, dp = 2 and more differ from one process in the last bits: the test above can fail."""
    if comm.size < 2:
        pytest.skip("needs two data-parallel ranks")
    cfg = with_(mlp(data), train={"deterministic": False})
    want, _ = alone(cfg, comm, shared_dir)
    got, _ = run(cfg, comm, f"{shared_dir}/plain.jsonl")
    agree(comm, "the plain run matched bitwise" if got == want else None)


def test_deterministic_training_equals_plain_training_to_float_noise(comm, shared_dir, data):
    """The fixed tree sums the same numbers in another order: plain training (checked against PyTorch in
    tests/test_train.py) and the deterministic run agree at the float32 noise floor."""
    det = mlp(data)
    a = train(with_(det, parallel={"dp": "auto"}), MPI.COMM_SELF)
    b = train(with_(det, train={"deterministic": False, "micro_batches": 4}), MPI.COMM_SELF)
    worst = max(float(np.abs(a[n] - b[n]).max() / max(np.abs(b[n]).max(), 1e-30)) for n in b)
    agree(comm, None if worst < 1e-5 else f"relative error {worst}")


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_a_checkpoint_resumes_on_one_process_with_the_same_bits(comm, shared_dir, data, tokens, kind):
    """10 steps on this layout, then 10 more from its checkpoint on one process = 20 steps on one process."""
    make = mlp if kind == "mlp" else gpt
    cfg = make(data if kind == "mlp" else tokens)
    want, want_records = alone(cfg, comm, shared_dir)
    first = with_(cfg, train={"steps": 10}, checkpoint={"dir": f"{shared_dir}/ck", "every": 10, "async_": False})
    train(first, comm)
    mine = f"{shared_dir}/resume-{comm.rank}"
    os.makedirs(mine)
    copy_checkpoint(sorted(glob.glob(f"{shared_dir}/ck/ckpt-*.h5"))[-1], mine)
    second = with_(cfg, checkpoint={"dir": mine, "every": 0, "async_": False})
    got, got_records = alone(second, comm, mine)
    problem = None if got == want else f"{kind}: resumed {got} != {want}"
    if problem is None and got_records != [r for r in want_records if r["step"] > 10]:
        problem = f"{kind}: the resumed run's losses differ"
    agree(comm, problem)
