"""Hugging Face's GPT2LMHeadModel layout (hpctrain/hf.py): export --format hf writes model.safetensors and
config.json by GPT-2's names and shapes (Conv1D weights transposed, lm_head.weight written), checkpoint.init reads
such a folder, and the round trip gives the same parameters bit for bit."""

import json

import numpy as np
import pytest

pytest.importorskip("safetensors", reason="safetensors is not installed (pip install 'hpctrain[export]')")

from safetensors.numpy import load_file  # noqa: E402

from hpctrain.checkpoint import list_checkpoints, load_checkpoint  # noqa: E402
from hpctrain.errors import CheckpointError  # noqa: E402
from test_cli import hpctrain  # noqa: E402
from test_gpt_data import _job  # noqa: E402


@pytest.mark.parametrize("bias", [True, False])
def test_export_hf_then_init_is_the_same_model_bit_for_bit(tmp_path, bias):
    cfg = _job(tmp_path, extra="" if bias else "")
    if not bias:
        text = open(cfg).read().replace("n_embd = 16\n", "n_embd = 16\nbias = false\n")
        open(cfg, "w").write(text)
    assert hpctrain("train", cfg).returncode == 0
    ck = str(tmp_path / "ck" / "ckpt-00000003.h5")
    out = tmp_path / "hf"
    r = hpctrain("export", ck, str(out), "--format", "hf")
    assert r.returncode == 0, r.stderr
    tensors = load_file(out / "model.safetensors")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["model_type"] == "gpt2"
    assert (config["vocab_size"], config["n_positions"], config["n_layer"], config["n_head"], config["n_embd"]) == \
        (12, 8, 2, 2, 16)
    C = 16
    assert tensors["transformer.h.0.attn.c_attn.weight"].shape == (C, 3 * C)  # Conv1D: (in, out)
    assert tensors["transformer.h.1.mlp.c_fc.weight"].shape == (C, 4 * C)
    assert tensors["transformer.h.1.mlp.c_proj.weight"].shape == (4 * C, C)
    assert tensors["transformer.h.0.ln_1.weight"].shape == (C,) and tensors["transformer.h.0.ln_1.bias"].shape == (C,)
    assert tensors["transformer.h.0.attn.c_attn.bias"].shape == (3 * C,)  # zeros when bias = false
    np.testing.assert_array_equal(tensors["lm_head.weight"], tensors["transformer.wte.weight"])
    state = load_checkpoint(ck, _layout(ck))
    np.testing.assert_array_equal(tensors["transformer.h.0.attn.c_attn.weight"].T,
                                  state.params["transformer.h.0.attn.c_attn.weight"])
    # a fresh run from the folder: step 0's weights are the export's, bit for bit
    r = hpctrain("train", cfg, "--set", f"checkpoint.init={out}", "--set", f"checkpoint.dir={tmp_path / 'ck2'}",
                 "--set", "train.steps=0")
    assert r.returncode == 0, r.stderr
    (_, back), = list_checkpoints(str(tmp_path / "ck2"))
    again = load_checkpoint(back, _layout(ck)).params
    for name, a in state.params.items():
        np.testing.assert_array_equal(again[name], a, err_msg=name)


def test_safetensors_export_keeps_the_tied_head(tmp_path):
    cfg = _job(tmp_path)
    assert hpctrain("train", cfg).returncode == 0
    ck = str(tmp_path / "ck" / "ckpt-00000003.h5")
    r = hpctrain("export", ck, str(tmp_path / "m.safetensors"))
    assert r.returncode == 0, r.stderr
    tensors = load_file(tmp_path / "m.safetensors")
    np.testing.assert_array_equal(tensors["lm_head.weight"], tensors["transformer.wte.weight"])


def test_a_folder_of_another_model_size_is_one_line(tmp_path):
    from hpctrain.hf import from_hf
    from hpctrain.nn.gpt import GPTSpec

    layout = GPTSpec(vocab_size=12, block_size=8, n_layer=1, n_head=2, n_embd=8).layout
    with pytest.raises(CheckpointError, match=r"no tensor 'transformer.wte.weight'"):
        from_hf({}, layout, "x")
    tensors = {s.name: np.zeros(s.shape, np.float32) for s in layout}
    tensors["transformer.wpe.weight"] = np.zeros((16, 8), np.float32)
    with pytest.raises(CheckpointError, match=r"transformer.wpe.weight has shape \(16, 8\).*needs \(8, 8\)"):
        from_hf(tensors, layout, "x")


def _layout(path):
    import tomllib

    from hpctrain.checkpoint import read_meta
    from hpctrain.config import parse_config
    from hpctrain.nn import make_model

    return make_model(parse_config(tomllib.loads(read_meta(path).config_text)).model).layout


def test_export_hf_in_bf16_then_init_is_the_rounded_model(tmp_path):
    """--format hf --dtype bf16: config.json says bfloat16, and checkpoint.init from the folder (BF16 tensors,
    which safetensors' numpy API cannot read) starts from the master weights rounded to bfloat16."""
    import ml_dtypes

    cfg = _job(tmp_path)
    assert hpctrain("train", cfg).returncode == 0
    ck = str(tmp_path / "ck" / "ckpt-00000003.h5")
    out = tmp_path / "hf"
    r = hpctrain("export", ck, str(out), "--format", "hf", "--dtype", "bf16")
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    r = hpctrain("train", cfg, "--set", f"checkpoint.init={out}", "--set", f"checkpoint.dir={tmp_path / 'ck2'}",
                 "--set", "train.steps=0")
    assert r.returncode == 0, r.stderr
    (_, back), = list_checkpoints(str(tmp_path / "ck2"))
    state, again = load_checkpoint(ck, _layout(ck)).params, load_checkpoint(back, _layout(ck)).params
    for name, a in state.items():
        np.testing.assert_array_equal(again[name], a.astype(ml_dtypes.bfloat16).astype(np.float32), err_msg=name)


@pytest.mark.parametrize("damage,message", [
    (lambda b: b[:4], "header length is outside the file"),
    (lambda b: b[:8] + b"{" * (int.from_bytes(b[:8], "little")) + b[8 + int.from_bytes(b[:8], "little"):],
     "header is not JSON"),
    (lambda b: b[: len(b) - 2], "do not hold BF16"),
], ids=["short", "header", "truncated"])
def test_a_damaged_bf16_folder_is_one_line(tmp_path, damage, message):
    cfg = _job(tmp_path)
    assert hpctrain("train", cfg).returncode == 0
    out = tmp_path / "hf"
    assert hpctrain("export", str(tmp_path / "ck" / "ckpt-00000003.h5"), str(out), "--format", "hf", "--dtype",
                    "bf16").returncode == 0
    weights = out / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    r = hpctrain("train", cfg, "--set", f"checkpoint.init={out}", "--set", f"checkpoint.dir={tmp_path / 'ck2'}",
                 "--set", "train.steps=0")
    assert r.returncode == 2 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr

