"""``hpctrain sample`` with a key/value cache (nn/decode.py): the same logits as the whole window each token, the
same tokens for the same seed, the window sliding past block_size; ``--no-cache`` and ``--tokens-only``."""

import numpy as np
import pytest

from hpctrain.backend.cpu import CpuBackend
from hpctrain.nn.decode import CachedDecoder, attend_one
from hpctrain.nn.gpt import GPTSpec
from hpctrain.sample import Generator


def _generator(bias=True, attention="math", block_size=8, be=None):
    spec = GPTSpec(vocab_size=11, block_size=block_size, n_layer=2, n_head=2, n_embd=8, bias=bias,
                   attention=attention)
    params = spec.init_params(3)
    rng = np.random.default_rng(0)  # LayerNorms and biases away from 1 and 0, so every parameter counts
    params = {k: v + rng.normal(0, 0.1, v.shape).astype(np.float32) for k, v in params.items()}
    return Generator(spec, params, be or CpuBackend())


def test_attend_one_is_the_last_row_of_causal_attention():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((3, 5, 4)).astype(np.float32) for _ in range(3))
    want = []
    for h in range(3):
        s = q[h, -1] @ k[h].T / 2.0
        p = np.exp(s - s.max())
        want.append((p / p.sum()) @ v[h])
    np.testing.assert_allclose(attend_one(q[:, -1], k, v), np.array(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias, attention", [(True, "math"), (False, "flash")])
def test_each_cached_step_gives_the_whole_windows_logits(bias, attention):
    gen = _generator(bias, attention)
    dec = CachedDecoder(gen.part, gen.be)
    ids = [3, 1, 4]
    np.testing.assert_allclose(dec.prefill(ids), gen.logits(ids), rtol=1e-5, atol=1e-5)
    for t in [1, 5, 9, 2, 6]:  # positions 3 .. 7: up to a full window
        ids.append(t)
        np.testing.assert_allclose(dec.step(t), gen.logits(ids), rtol=1e-4, atol=1e-5)
    assert dec.full
    with pytest.raises(ValueError, match="prefill the slid window"):
        dec.step(0)
    ids.append(3)
    np.testing.assert_allclose(dec.prefill(ids), gen.logits(ids), rtol=1e-5, atol=1e-5)  # the slid window


@pytest.mark.parametrize("temperature, top_k", [(1.0, 0), (0.8, 4), (0.0, 0)])
def test_the_same_tokens_with_and_without_the_cache(temperature, top_k):
    gen = _generator()
    for prompt in ([5], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]):  # one token; longer than block_size
        draws = [gen.generate(prompt, 20, temperature=temperature, top_k=top_k, rng=np.random.default_rng(7),
                              vocab=10, cache=cache) for cache in (True, False)]
        assert draws[0] == draws[1]
        assert len(draws[0]) == len(prompt) + 20 and max(draws[0][len(prompt):]) < 10


def test_sample_cli_no_cache_and_tokens_only(tmp_path):
    from test_cli import hpctrain
    from test_gpt_data import _job

    cfg = _job(tmp_path)
    assert hpctrain("train", cfg).returncode == 0
    ck = str(tmp_path / "ck" / "ckpt-00000003.h5")
    runs = {flags: hpctrain("sample", ck, "--prompt", "ab", "--tokens", "30", "--seed", "4", *flags)
            for flags in ((), ("--no-cache",), ("--tokens-only",))}
    for r in runs.values():
        assert r.returncode == 0, r.stderr
    assert runs[()].stdout == runs[("--no-cache",)].stdout
    ids = [int(i) for i in runs[("--tokens-only",)].stdout.split()]
    assert len(ids) == 32 and all(0 <= i < 10 for i in ids)
    from hpctrain.text import read_vocabulary
    assert read_vocabulary(str(tmp_path / "t.h5")).decode(ids) + "\n" == runs[()].stdout
