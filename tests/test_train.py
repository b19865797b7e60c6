"""Whole training steps: a golden check against an independent numpy model, gradients against
finite differences, micro-batches, non-finite gradients, metrics, and a run that learns."""

import json

import numpy as np
import pytest

import reference as ref
from helpers import config, make_classification, make_regression
from hpctrain.errors import ConfigError, NonFiniteError
from hpctrain.train import Trainer
from hpctrain.train.metrics import truncate_after as _truncate_after


def numpy_model_step(layers, params, x, y, loss):
    """Loss and gradients of the sum-over-batch loss / B, in float64, written without the backend."""
    acts, h = [], x.astype(np.float64)
    for i, spec in enumerate(layers):
        acts.append(h)
        if spec.type == "linear":
            h = ref.linear_forward(h, params[f"{i}.weight"], params.get(f"{i}.bias"))
        elif spec.type == "layernorm":
            h = ref.layernorm(h, params[f"{i}.weight"], params[f"{i}.bias"], spec.get("eps"))[0]
        else:
            h = {"relu": ref.relu, "gelu": ref.gelu, "tanh": np.tanh}[spec.type](h)
    B = len(x)
    if loss == "cross_entropy":
        total, _, dout = ref.cross_entropy(h, y)
        dout, value = dout / B, total / B
    else:
        total, dout = ref.mse(h, y)
        dout, value = dout / h.size, total / h.size
    grads = {}
    for i in range(len(layers) - 1, -1, -1):
        spec, a = layers[i], acts[i]
        if spec.type == "linear":
            dinp, grads[f"{i}.weight"], db = ref.linear_backward(dout, a, params[f"{i}.weight"])
            if f"{i}.bias" in params:
                grads[f"{i}.bias"] = db
        elif spec.type == "layernorm":
            dinp, grads[f"{i}.weight"], grads[f"{i}.bias"] = ref.layernorm_backward(dout, a, params[f"{i}.weight"],
                                                                                     spec.get("eps"))
        elif spec.type == "tanh":
            dinp = ref.tanh_backward(np.tanh(a), dout)
        else:
            dinp = {"relu": ref.relu_backward, "gelu": ref.gelu_backward}[spec.type](a, dout)
        dout = dinp
    return value, grads


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_golden_sgd_steps_match_numpy_model(tmp_path, mesh, loss):
    if loss == "mse":
        x, y = make_regression(tmp_path / "d.h5", n=40, features=6, outputs=3)
    else:
        x, y = make_classification(tmp_path / "d.h5", n=40)
    cfg = config(tmp_path / "d.h5", loss=loss, train={"steps": 3, "batch_size": 8},
                 optim={"name": "sgd", "lr": 0.1, "momentum": 0.9})
    trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    params = {k: v.astype(np.float64) for k, v in trainer.params.to_host_dict().items()}
    bufs = {k: np.zeros_like(v) for k, v in params.items()}
    for step in range(3):
        rows = slice(step * 8, step * 8 + 8)
        _, grads = numpy_model_step(cfg.model.layers, params, x[rows], y[rows], loss)
        for k in params:
            params[k], bufs[k] = ref.sgd(params[k], grads[k], bufs[k], 0.1, 0.9, 0.0, False)
    trainer.run()
    got = trainer.params.to_host_dict()
    for k in params:
        np.testing.assert_allclose(got[k], params[k], rtol=1e-4, atol=1e-5, err_msg=k)


def test_model_gradient_matches_finite_differences(tmp_path, mesh):
    """The backend's full-model gradient against central differences of the numpy float64 model."""
    x, y = make_classification(tmp_path / "d.h5", n=40)
    cfg = config(tmp_path / "d.h5", train={"steps": 1, "batch_size": 8}, optim={"lr": 0.0})
    trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    trainer.run()  # lr 0: computes the gradient of step 0 and leaves the parameters alone
    params = {k: v.astype(np.float64) for k, v in trainer.params.to_host_dict().items()}
    got = trainer.grads.to_host_dict()
    rng = np.random.default_rng(0)
    for name in ("0.weight", "2.weight", "2.bias", "6.bias"):
        direction = rng.standard_normal(params[name].shape)
        def f(t):
            p = dict(params, **{name: params[name] + t * direction})
            return numpy_model_step(cfg.model.layers, p, x[:8], y[:8], "cross_entropy")[0]
        numeric = (f(1e-5) - f(-1e-5)) / 2e-5
        assert float((got[name] * direction).sum()) == pytest.approx(numeric, rel=1e-3, abs=1e-6), name


def test_micro_batches_equal_one_batch(tmp_path, mesh):
    make_classification(tmp_path / "d.h5", n=64)
    results = []
    for k in (1, 4):
        cfg = config(tmp_path / "d.h5", train={"steps": 4, "batch_size": 16, "micro_batches": k},
                     optim={"name": "adamw", "lr": 0.01})
        t = Trainer(cfg, mesh=mesh, log=lambda *a: None)
        t.run()
        results.append(t.params.to_host_dict())
    for name in results[0]:
        np.testing.assert_allclose(results[0][name], results[1][name], rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning")
def test_nonfinite_gradients_stop_or_skip(tmp_path, mesh):
    make_classification(tmp_path / "d.h5", n=64)
    cfg = config(tmp_path / "d.h5", train={"steps": 3}, optim={"lr": 1e38})
    with pytest.raises(NonFiniteError, match=r"step \d+: the gradients contain NaN or Inf"):
        Trainer(cfg, mesh=mesh, log=lambda *a: None).run()
    lines = []
    metrics = tmp_path / "m.jsonl"
    cfg = config(tmp_path / "d.h5", train={"steps": 3, "skip_nonfinite": True, "metrics": str(metrics)},
                 optim={"lr": 1e38})
    Trainer(cfg, mesh=mesh, log=lines.append).run()
    assert any("non-finite gradients, step skipped" in line for line in lines)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]  # strict JSON: null, not NaN
    assert any(r.get("skipped") and r["grad_norm"] is None for r in records)


def test_training_learns_and_writes_metrics(tmp_path, mesh):
    make_classification(tmp_path / "d.h5", n=200)
    metrics = tmp_path / "run" / "m.jsonl"
    cfg = config(tmp_path / "d.h5", train={"steps": 60, "batch_size": 16, "log_every": 20, "eval_every": 30,
                                           "metrics": str(metrics)},
                 optim={"name": "adam", "lr": 0.01, "schedule": "cosine", "warmup_steps": 5})
    final = Trainer(cfg, mesh=mesh, log=lambda *a: None).run()
    assert final["val_accuracy"] >= 0.95
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in train] == [20, 40, 60] and [r["step"] for r in evals] == [30, 60]
    assert all({"step", "loss", "lr", "samples_per_s"} <= r.keys() for r in train)
    assert train[-1]["loss"] < train[0]["loss"]


def test_metrics_file_may_not_be_an_input(tmp_path, mesh):
    make_classification(tmp_path / "d.h5", n=48)
    before = (tmp_path / "d.h5").read_bytes()
    with pytest.raises(ConfigError, match=r"train.metrics: .*d.h5 is data.path; the metrics would overwrite it"):
        Trainer(config(tmp_path / "d.h5", train={"metrics": str(tmp_path / "d.h5")}), mesh=mesh, log=lambda *a: None)
    assert (tmp_path / "d.h5").read_bytes() == before


def test_metrics_trim_on_resume_keeps_lines_that_are_not_utf8(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b'{"step": 1}\n\xff\xfe not ours\n{"step": 2}\n{"step": 3}\n')
    _truncate_after(str(path), 2)
    assert path.read_bytes() == b'{"step": 1}\n\xff\xfe not ours\n{"step": 2}\n'


def test_a_trainer_without_a_mesh_makes_one_from_the_config(tmp_path):
    from helpers import config, make_classification
    from hpctrain import Trainer

    make_classification(tmp_path / "d.h5")
    trainer = Trainer(config(tmp_path / "d.h5", train={"steps": 2}), log=lambda *a: None)
    assert trainer.mesh.size == 1 and trainer.mesh.describe().startswith("world 1")
    trainer.run()
    trainer.close()  # frees the mesh it made
