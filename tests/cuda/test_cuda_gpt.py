"""The GPT on the CUDA backend: the golden forward and backward against the numpy model, and a short
training run against the CPU backend (under the simulator: tiny shapes)."""

import dataclasses

import numpy as np
import pytest

import reference as ref
from helpers import gpt_config, make_tokens
from hpctrain.backend.cuda import CudaBackend
from hpctrain.nn import make_loss
from hpctrain.nn.gpt import GPTSpec
from hpctrain.parallel.mesh import Mesh
from hpctrain.params import FlatBuffer
from hpctrain.train import Trainer


@pytest.fixture(scope="module")
def be():
    return CudaBackend()


def test_golden_forward_and_backward_against_the_numpy_reference(be):
    spec = GPTSpec(vocab_size=7, block_size=5, n_layer=2, n_head=2, n_embd=4)
    rng = np.random.default_rng(5)
    params = {k: v + rng.standard_normal(v.shape).astype(np.float32) * 0.3 for k, v in spec.init_params(1).items()}
    idx = rng.integers(0, 7, (2, 5)).astype(np.int64)
    targets = rng.integers(0, 7, (2, 5)).astype(np.int64)
    part = spec.part()
    p, g = FlatBuffer(be, part.layout), FlatBuffer(be, part.layout)
    part.bind(p, g)
    p.load_host_dict(params)
    logits, saved = part.forward(be, be.asarray(idx))
    value, _, d = make_loss("cross_entropy")(be, logits, be.asarray(targets.reshape(-1)), 1.0 / idx.size)
    part.backward(be, d, saved, need_dinp=False)
    want_value, want = ref.gpt_loss_and_grads(params, idx, targets, n_layer=2, n_head=2)
    assert abs(value / idx.size - want_value) < 1e-5 * abs(want_value)
    grads = g.to_host_dict()
    for name in want:
        err = np.abs(grads[name] - want[name]).max() / np.abs(want[name]).max()
        assert err < 2e-5, (name, err)


@pytest.mark.parametrize("dropout,attention", [(0.0, "math"), (0.2, "math"), (0.2, "flash")])
def test_training_on_cuda_matches_the_cpu_backend(tmp_path, dropout, attention):
    """With dropout too: both backends draw the same masks (backend/dropout_mask.py); flash attention's kernels
    draw them inside their own passes."""
    make_tokens(tmp_path / "t.h5", n=400)
    cfg = gpt_config(tmp_path / "t.h5", model={"vocab_size": 12, "block_size": 4, "n_embd": 4, "dropout": dropout,
                                               "attention": attention},
                     train={"batch_size": 2, "steps": 2, "micro_batches": 2},
                     data={"val_fraction": 0.02},
                     optim={"name": "sgd", "lr": 0.1, "momentum": 0.9})  # AdamW would amplify rounding (tests/mpi)
    mesh = Mesh()
    out = {}
    try:
        for backend in ("cpu", "cuda"):
            c = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, backend=backend))
            t = Trainer(c, mesh=mesh, log=lambda *a: None)
            t.run()
            out[backend] = (t.state_dict()[0], t.evaluate()["val_loss"])
            t.close()
    finally:
        mesh.free()
    (cpu, cpu_val), (cuda, cuda_val) = out["cpu"], out["cuda"]
    assert cuda_val == pytest.approx(cpu_val, rel=1e-5)
    for name in cpu:
        np.testing.assert_allclose(cuda[name], cpu[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_sampling_with_the_key_value_cache_gives_the_cpu_logits(be, cpu):
    """nn/decode.py on the CUDA backend: the prompt's window and then one cached position, against the CPU's
    whole-window logits; the same tokens with and without the cache."""
    from hpctrain.nn.decode import CachedDecoder
    from hpctrain.sample import Generator

    def spec():
        return GPTSpec(vocab_size=7, block_size=4, n_layer=1, n_head=2, n_embd=4)

    params = spec().init_params(2)
    gen, ref_gen = Generator(spec(), params, be), Generator(spec(), params, cpu)  # a part binds its spec's layers
    dec = CachedDecoder(gen.part, be)
    np.testing.assert_allclose(dec.prefill([3, 1]), ref_gen.logits([3, 1]), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dec.step(5), ref_gen.logits([3, 1, 5]), rtol=1e-4, atol=1e-5)
    draws = [gen.generate([2], 5, temperature=1.0, top_k=0, rng=np.random.default_rng(1), cache=c)
             for c in (True, False)]
    assert draws[0] == draws[1]
