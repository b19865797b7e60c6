"""The host waits for the GPU once per training step: a counter on the backend's waits (``host_waits``).

Each wait stalls the launch queue until the GPU drains it, so a step that waits at every micro-batch leaves the
GPU idle while Python prepares the next kernels. A step keeps its token ids and class targets on the host
(checked there, uploaded by the backend), writes each micro-batch's loss sums and the gradient norm's pieces
into device scalars, and reads them all in one wait before the optimizer (train/step.py). Counted under the
simulator, which runs the backend's own code paths.
"""

import numpy as np
import pytest

from cudatest import SIM
from helpers import config, gpt_config, make_classification, make_regression, make_tokens
from hpctrain.errors import BackendError
from hpctrain.parallel.mesh import Mesh
from hpctrain.train import Trainer


@pytest.fixture(scope="module")
def mesh():
    m = Mesh()
    yield m
    m.free()


def waits_per_step(cfg, mesh, steps=2):
    """The training thread's waits in each step after the first (which allocates and compiles): for the whole
    stream (``host_waits``), or, where a step's values are read a step late (train/step.py), for a mark."""
    trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    be = trainer.be
    assert be.name == "cuda"
    trainer.train_step(0, 0.01)
    counts = []
    for step in range(1, steps):
        before = be.host_waits + be.mark_waits
        direct = be.launcher.slow if be.launcher is not None else None
        trainer.train_step(step, 0.01)
        counts.append(be.host_waits + be.mark_waits - before)
        if not SIM:  # on a GPU, every launch after the first step's takes the direct path (backend/cuda/launch.py)
            assert be.launcher.refused == [] and be.launcher.slow == direct and be.launcher.fast > 0
    trainer.close()
    return counts


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_an_mlp_step_waits_once(tmp_path, mesh, micro_batches):
    make_classification(tmp_path / "d.h5", n=32)
    cfg = config(tmp_path / "d.h5", train={"steps": 3, "batch_size": 8, "micro_batches": micro_batches,
                                           "backend": "cuda", "grad_clip": 0.5},
                 optim={"name": "adamw", "lr": 0.01})
    assert waits_per_step(cfg, mesh) == [1]


def test_a_regression_step_waits_once(tmp_path, mesh):
    make_regression(tmp_path / "d.h5", n=32, features=6, outputs=3)
    cfg = config(tmp_path / "d.h5", loss="mse", train={"steps": 3, "batch_size": 8, "micro_batches": 2,
                                                        "backend": "cuda"},
                 model={"layers": [{"type": "linear", "in": 6, "out": 8}, {"type": "tanh"},
                                   {"type": "linear", "in": 8, "out": 3}]})
    assert waits_per_step(cfg, mesh) == [1]


@pytest.mark.parametrize("deterministic,attention", [(False, "math"), (True, "math"), (False, "flash")])
def test_a_gpt_step_with_four_micro_batches_waits_once(tmp_path, mesh, deterministic, attention):
    """Was 14: a wait per micro-batch in the embedding's id check, its backward's id readback and the loss,
    then the norm and the step's end. Flash attention's kernels read nothing back either."""
    make_tokens(tmp_path / "t.h5", n=300)
    cfg = gpt_config(tmp_path / "t.h5", model={"block_size": 4, "n_embd": 4, "attention": attention},
                     data={"val_fraction": 0.0},
                     train={"steps": 3, "batch_size": 4, "micro_batches": 4, "backend": "cuda", "grad_clip": 0.5,
                            "deterministic": deterministic})
    assert waits_per_step(cfg, mesh) == [1]


def test_host_ids_are_checked_and_used_without_a_wait(be, rng):
    """The embedding and the loss take host ids: a bad one raises before any kernel; good ones cost no wait and
    give the device ids' results."""
    B, T, V, C = 2, 3, 5, 4
    idx = rng.integers(0, V, size=(B, T)).astype(np.int64)
    wte, wpe = be.asarray(rng.standard_normal((V, C)).astype(np.float32)), be.asarray(
        rng.standard_normal((T, C)).astype(np.float32))
    dout = be.asarray(rng.standard_normal((B * T, C)).astype(np.float32))
    results = []
    for ids in (idx, be.asarray(idx)):
        before = be.host_waits
        out, dwte, dwpe = be.empty((B * T, C)), be.empty((V, C)), be.empty((T, C))
        be.embedding_forward(ids, wte, wpe, out)
        be.embedding_backward(dout, ids, dwte, dwpe)
        logits, dlogits, row = be.empty((B * T, V)), be.empty((B * T, V)), be.zeros((3,), np.float64)
        be.copy_(logits, be.to_host(out)[:, :1].repeat(V, axis=1) * np.arange(V, dtype=np.float32))
        before_loss = be.host_waits
        be.cross_entropy(logits, idx.reshape(-1) if ids is idx else be.asarray(idx.reshape(-1)), dlogits, 0.5,
                         into=row)
        assert be.host_waits == before_loss  # the loss into a device row: no wait, whichever ids
        waits = be.host_waits - before
        results.append((waits, *be.read_host(out, dwte, dwpe, dlogits, row)))
    (host_waits, *on_host), (device_waits, *on_device) = results
    assert host_waits == 1 and device_waits == 3  # to_host(out) only; device ids: + check + readback
    for a, b in zip(on_host, on_device):
        np.testing.assert_array_equal(a, b)
    bad = idx.copy()
    bad[1, 2] = V
    before = be.host_waits
    with pytest.raises(BackendError, match=r"^embedding_forward: token id 5 at position 5 of the batch"):
        be.embedding_forward(bad, wte, wpe, be.empty((B * T, C)))
    with pytest.raises(BackendError, match=r"^cross_entropy: target 5 in row 5 is outside \[0, 5\)"):
        be.cross_entropy(be.empty((B * T, V)), bad.reshape(-1), be.empty((B * T, V)), 1.0)
    assert be.host_waits == before


def test_uploads_stage_through_page_locked_buffers_reused_after_a_wait(be, rng):
    """A step's uploads go through page-locked staging buffers: one per upload until a wait for the whole stream
    has passed their copies, then the same buffers again (about one step's uploads in all, never a wait)."""
    shape = (3, 7)  # a shape no other test uploads
    key = (shape, np.dtype(np.float32).str)
    be.synchronize()  # a clean start: every earlier copy is done
    before = be.host_waits + be.mark_waits
    hosts = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
    first = [be.upload(h) for h in hosts]
    buffers = {id(b) for b, _ in be._staging[key]}
    assert len(buffers) == 3  # no wait between them: each has its own buffer
    got = be.read_host(*first)  # the step's one wait
    second = [be.upload(h + 1) for h in hosts]
    assert {id(b) for b, _ in be._staging[key]} == buffers  # reused: the wait passed their copies
    assert be.host_waits + be.mark_waits == before + 1
    for h, a, b in zip(hosts, got, be.read_host(*second)):
        np.testing.assert_array_equal(a, h)
        np.testing.assert_array_equal(b, h + 1)
