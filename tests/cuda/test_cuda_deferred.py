"""A device step's values read one step late (issue 49 item 2; train/step.py's ``_finish_on_device``).

On one stage with no tensor parallelism and no ZeRO, the CUDA backend decides clipping and the non-finite
skip on the device (``clip_gate``; the update kernels' ``gate``) and copies the loss and the gradient norm
back without a wait; the host reads them at the next step's optimizer, so it queues a step while the device
finishes the one before. These tests run that path under the simulator against the same backend reading
every step's values at once (``runner.defer = False``: train/step.py's ``_finish``), bit for bit, with
clipping active and with skipped steps, and count the waits.
"""

import numpy as np
import pytest

from helpers import config, gpt_config, make_classification, make_tokens
from hpctrain.errors import NonFiniteError
from hpctrain.parallel.mesh import Mesh
from hpctrain.train import Trainer
from hpctrain.train.step import StepRunner


@pytest.fixture(scope="module")
def mesh():
    m = Mesh()
    yield m
    m.free()


def poison(monkeypatch, steps, value=np.nan):
    """``value`` in the first gradient at these 0-based steps, before the norm sees it."""
    finish = StepRunner._finish

    def poisoned(self, step, lr):
        if step in steps:
            self.be.fill_(self.grads.data[:1], value)
        return finish(self, step, lr)

    monkeypatch.setattr(StepRunner, "_finish", poisoned)


def run(cfg, mesh, *, defer):
    lines = []
    trainer = Trainer(cfg, mesh=mesh, log=lines.append)
    assert trainer.runner.defer  # one stage, no tp, no ZeRO, a device backend
    trainer.runner.defer = defer
    trainer.run()
    out = trainer.params.to_host_dict(), trainer.optim.step_count, lines
    trainer.close()
    return out


def mlp(tmp_path, **train):
    make_classification(tmp_path / "d.h5", n=64)
    return config(tmp_path / "d.h5", train={"steps": 9, "batch_size": 8, "micro_batches": 2, "backend": "cuda",
                                            "grad_clip": 0.05, "log_every": 4, **train},
                  optim={"name": "adamw", "lr": 0.01})


def same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def test_clipping_decided_on_the_device_gives_the_hosts_bits(tmp_path, mesh):
    cfg = mlp(tmp_path)
    late, count, _ = run(cfg, mesh, defer=True)
    now, count_now, _ = run(cfg, mesh, defer=False)
    same(late, now)
    assert count == count_now == 9


def test_skipped_steps_are_reported_at_their_own_step_and_give_the_hosts_bits(tmp_path, mesh, monkeypatch):
    poison(monkeypatch, {3, 4, 6})  # steps 4, 5 and 7; log lines at 4 and 8 only
    cfg = mlp(tmp_path, skip_nonfinite=True, max_skipped_steps=3)
    late, count, lines = run(cfg, mesh, defer=True)
    now, count_now, lines_now = run(cfg, mesh, defer=False)
    same(late, now)
    assert count == count_now == 6
    said = [line for line in lines if "step skipped" in line]
    assert said == [line for line in lines_now if "step skipped" in line]
    assert said == [f"step {s}: non-finite gradients, step skipped" for s in (4, 5, 7)]


def test_a_non_finite_step_without_skipping_stops_the_run_naming_its_step(tmp_path, mesh, monkeypatch):
    poison(monkeypatch, {2})
    trainer = Trainer(mlp(tmp_path), mesh=mesh, log=lambda *a: None)
    try:
        with pytest.raises(NonFiniteError, match=r"^step 3: the gradients contain NaN or Inf; lower optim.lr"):
            trainer.run()
        assert trainer.optim.step_count == 2  # the device left step 3's update undone
    finally:
        trainer.close()


def test_a_norm_too_large_for_adams_state_is_skipped(tmp_path, mesh, monkeypatch):
    poison(monkeypatch, {1}, value=3e19)  # finite, but its square overflows float32 (Optimizer.SAFE_NORM)
    lines = []
    trainer = Trainer(mlp(tmp_path, skip_nonfinite=True, grad_clip=0.0), mesh=mesh, log=lines.append)
    trainer.run()
    trainer.close()
    assert trainer.optim.step_count == 8
    assert any(line.startswith("step 2: the gradient norm 3e+19 could overflow") for line in lines)


def test_the_host_waits_once_a_step_for_the_step_before(tmp_path, mesh):
    """The runner's own steps (the loop's path): no wait for the whole stream, one for the previous step's
    values, and each step's values filled in by the next one."""
    trainer = Trainer(mlp(tmp_path), mesh=mesh, log=lambda *a: None)
    runner, be = trainer.runner, trainer.be
    outs = [runner.train_step(0, 0.01)]
    for step in range(1, 4):
        whole, marks = be.host_waits, be.mark_waits
        outs.append(runner.train_step(step, 0.01))
        assert be.host_waits == whole and be.mark_waits <= marks + 1
        assert "pending" in outs[-1] and "pending" not in outs[-2] and np.isfinite(outs[-2]["grad_norm"])
    runner.settle()
    assert "pending" not in outs[-1] and outs[-1]["loss_sum"] > 0
    trainer.close()


def test_a_gpt_with_dropout_and_graphs_reads_late_and_gives_the_hosts_bits(tmp_path, mesh):
    make_tokens(tmp_path / "t.h5", n=200)
    cfg = gpt_config(tmp_path / "t.h5", model={"block_size": 4, "n_embd": 8, "dropout": 0.1},
                     data={"val_fraction": 0.0},
                     train={"steps": 5, "batch_size": 4, "micro_batches": 2, "backend": "cuda", "grad_clip": 0.1,
                            "log_every": 5})
    late, _, _ = run(cfg, mesh, defer=True)
    now, _, _ = run(cfg, mesh, defer=False)
    same(late, now)


@pytest.mark.parametrize("pieces,max_norm", [
    ([0.25, 1.0, 2.0], 0.5), ([0.25, 1.0, 2.0], 0.0), ([1e-3], 5.0), ([4.0, np.nan], 1.0), ([np.inf, 1.0], 1.0),
    ([1e38, 1e38, 1e38], 0.0),
], ids=["clipped", "no-clip", "below", "nan", "inf", "too-large"])
def test_clip_gate_is_the_hosts_arithmetic(pieces, max_norm):
    """[norm, factor, skip] on the device, bit for bit what _finish computes on the host in float64."""
    import math

    from hpctrain.backend.cuda import CudaBackend
    from hpctrain.optim import Optimizer, clip_coefficient

    be = CudaBackend()
    gate = be.zeros((3,), np.float64)
    be.clip_gate(be.asarray(np.array(pieces)), max_norm=max_norm, safe_norm=Optimizer.SAFE_NORM["adam"], into=gate)
    norm, coef, skip = be.to_host(gate)
    s = sum(pieces)
    want = math.sqrt(s) if s >= 0 else float("nan")
    assert (norm == want) or (math.isnan(norm) and math.isnan(want))
    if math.isfinite(want):
        assert coef == min(clip_coefficient(want, max_norm), 1.0)
        assert skip == (2.0 if want * coef >= Optimizer.SAFE_NORM["adam"] else 0.0)
    else:
        assert skip == 1.0


@pytest.mark.parametrize("rule", ["sgd", "adam"])
def test_a_gated_update_applies_the_factor_or_changes_nothing(rule, rng=np.random.default_rng(0)):
    from hpctrain.backend.cuda import CudaBackend

    be = CudaBackend()
    p0, g, s0 = (rng.standard_normal(37).astype(np.float32) for _ in range(3))
    kw = dict(lr=0.1, weight_decay=0.01)

    def update(gate=None, grad_scale=1.0):
        p, s, s2 = be.asarray(p0.copy()), be.asarray(s0.copy()), be.asarray(np.abs(s0))
        if rule == "sgd":
            be.sgd_update(p, be.asarray(g), s, momentum=0.9, nesterov=False, grad_scale=grad_scale, gate=gate, **kw)
        else:
            be.adam_update(p, be.asarray(g), s, s2, beta1=0.9, beta2=0.99, eps=1e-8, step=3, decoupled=True,
                           grad_scale=grad_scale, gate=gate, **kw)
        return be.to_host(p), be.to_host(s)

    np.testing.assert_array_equal(update(be.asarray(np.array([2.0, 0.25, 0.0]))), update(grad_scale=0.25))
    for skip in (1.0, 2.0):
        p, s = update(be.asarray(np.array([np.nan, 1.0, skip])))
        np.testing.assert_array_equal(p, p0)
        np.testing.assert_array_equal(s, s0)


def test_too_many_skipped_steps_in_a_row_name_the_last_of_them(tmp_path, mesh, monkeypatch):
    """train.max_skipped_steps reached at steps 4 and 5: found when step 5's values arrive (with step 6's, no log
    line falls on 5), and the error names step 5, as the host's path does."""
    poison(monkeypatch, {3, 4})
    trainer = Trainer(mlp(tmp_path, skip_nonfinite=True, max_skipped_steps=2), mesh=mesh, log=lambda *a: None)
    try:
        with pytest.raises(NonFiniteError, match=r"^step 5: 2 non-finite steps skipped in a row"):
            trainer.run()
    finally:
        trainer.close()
