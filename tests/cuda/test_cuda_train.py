"""Whole training runs through hpctrain.train.Trainer: backend "cuda" against backend "cpu".

The model (tests/helpers.py) has Linear, Tanh, LayerNorm, GELU and ReLU layers, so a
run goes through every kernel: the three GEMM layouts with the fused bias, the
bias and LayerNorm gradients, the loss, the gradient norm, clipping and the
optimizer. Losses per step, validation metrics and final parameters must agree
with the CPU backend to float tolerance.
"""

import json

import numpy as np
import pytest

from helpers import config, make_classification, make_regression
from hpctrain.parallel.mesh import Mesh
from hpctrain.train import Trainer


@pytest.fixture(scope="module")
def mesh():
    m = Mesh()
    yield m
    m.free()


def _run(cfg, mesh, backend, tmp_path):
    metrics = tmp_path / f"{backend}.jsonl"
    cfg = config(cfg["path"], loss=cfg["loss"], **{**cfg["sections"],
                 "train": {**cfg["sections"]["train"], "backend": backend, "metrics": str(metrics)}})
    trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    final = trainer.run()
    params = trainer.params.to_host_dict()
    trainer.close()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return trainer, final, params, records


@pytest.mark.parametrize("case", [
    dict(loss="cross_entropy", optim={"name": "sgd", "lr": 0.1, "momentum": 0.9, "nesterov": True},
         train={"grad_clip": 0.5}),
    dict(loss="cross_entropy", optim={"name": "adamw", "lr": 0.01}, train={"micro_batches": 2}),
    dict(loss="mse", optim={"name": "adam", "lr": 0.01, "weight_decay": 0.01}, train={}),
], ids=["ce-sgd-nesterov-clip", "ce-adamw-microbatches", "mse-adam"])
def test_cuda_training_matches_cpu(tmp_path, mesh, case):
    path = tmp_path / "d.h5"
    if case["loss"] == "mse":
        make_regression(path, n=32, features=6, outputs=3)
    else:
        make_classification(path, n=32)
    sections = {"train": {"steps": 3, "batch_size": 8, "log_every": 1, **case["train"]}, "optim": case["optim"]}
    if case["loss"] == "mse":
        sections["model"] = {"layers": [{"type": "linear", "in": 6, "out": 8}, {"type": "tanh"},
                                        {"type": "layernorm", "dim": 8}, {"type": "gelu"},
                                        {"type": "linear", "in": 8, "out": 3}]}
    spec = dict(path=path, loss=case["loss"], sections=sections)
    gpu, gpu_final, gpu_params, gpu_records = _run(spec, mesh, "cuda", tmp_path)
    _, cpu_final, cpu_params, cpu_records = _run(spec, mesh, "cpu", tmp_path)
    assert gpu.be.name == "cuda" and gpu.params.data.__class__ is not np.ndarray

    gpu_loss = [r["loss"] for r in gpu_records if "loss" in r]
    cpu_loss = [r["loss"] for r in cpu_records if "loss" in r]
    assert len(gpu_loss) == len(cpu_loss) == 3
    np.testing.assert_allclose(gpu_loss, cpu_loss, rtol=1e-5, atol=1e-6)
    for key in ("val_loss", "val_accuracy", "grad_norm"):
        if key in cpu_final:
            assert gpu_final[key] == pytest.approx(cpu_final[key], rel=1e-5, abs=1e-6), key
    for name in cpu_params:
        np.testing.assert_allclose(gpu_params[name], cpu_params[name], rtol=1e-4, atol=1e-5, err_msg=name)
