"""Issue 53's traps and polish: predict refuses a token file of another vocabulary, the plan's advice suggests
micro-batches, export's h5 line says the version inspect says, the end-of-run line, small memory figures in KB,
the plot titled with its run, make_digits.py without scikit-learn."""

import os
import subprocess
import sys

import h5py
import pytest

from helpers import gpt_config
from test_cli import ROOT, hpctrain
from test_gpt_data import _job


def test_predict_refuses_a_token_file_of_another_vocabulary(tmp_path):
    cfg = _job(tmp_path)
    assert hpctrain("train", cfg).returncode == 0
    ck = str(tmp_path / "ck" / "ckpt-00000003.h5")
    from helpers import make_tokens
    make_tokens(tmp_path / "other.h5", vocab="abcdefghij\n ")  # 12 characters: other ids for the same letters
    r = hpctrain("predict", ck, "--data", str(tmp_path / "other.h5"), "--out", str(tmp_path / "p.h5"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "was trained on a vocabulary of 10 characters" in r.stderr and "would mean other characters" in r.stderr
    assert not (tmp_path / "p.h5").exists()
    r = hpctrain("predict", ck, "--data", str(tmp_path / "t.h5"), "--out", str(tmp_path / "p.h5"))
    assert r.returncode == 0, r.stderr  # its own vocabulary


def test_plan_advice_suggests_micro_batches():
    """GPT-2 small, block 1024, batch 32 on 4 ranks of 4 GB: nothing else fits, 8 micro-batches do."""
    from hpctrain.plan import advice

    cfg = gpt_config("t.h5", model=dict(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
                     train=dict(batch_size=32))
    said = advice(cfg, 4, 4 * 10**9)
    assert said and said[0].startswith("--set train.micro_batches=8: largest rank 3,9")
    assert sum("micro_batches" in line for line in said) == 1  # the smallest count that fits, once


def test_export_h5_of_a_sharded_checkpoint_says_the_version_inspect_says(tmp_path):
    cfg = _job(tmp_path)
    assert hpctrain("train", cfg).returncode == 0
    ck = str(tmp_path / "ck" / "ckpt-00000003.h5")
    with h5py.File(ck, "r", locking=False) as f:
        source = int(f.attrs["version"])
    r = hpctrain("export", ck, str(tmp_path / "whole.h5"), "--format", "h5")
    assert r.returncode == 0, r.stderr
    r2 = hpctrain("inspect", str(tmp_path / "whole.h5"))
    written = int(r2.stdout.split("format version ")[1].split(",")[0])
    assert f"format version {written}" in r.stdout
    if source != written:
        assert f"(the source, a sharded set, is version {source})" in r.stdout


def test_the_run_ends_with_a_summary_line(tmp_path):
    cfg = _job(tmp_path)
    r = hpctrain("train", cfg, "--set", "train.eval_every=3")
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("done: step 3 of 3 (3 this run) in 0:") and "samples/s overall, loss " in last
    assert "val_loss " in last and last.endswith(os.path.join(str(tmp_path / "ck"), "ckpt-00000003.h5"))


def test_small_memory_figures_are_kilobytes_not_zero_megabytes():
    from hpctrain.train.memory import size_text, summary

    assert (size_text(0), size_text(104_488), size_text(3_953_000_000)) == ("0 B", "104.5 KB", "3,953 MB")
    fields = ("params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "buffer_bytes", "runtime_bytes",
              "total_bytes")
    line = summary([{"rank": 0, "peak_rss_bytes": 182_000_000, **{k: 104_488 for k in fields}}])
    assert "params 104.5 KB" in line and " 0 MB" not in line


def test_a_plot_is_titled_with_its_run(tmp_path):
    from hpctrain.plot import _title

    assert _title(str(tmp_path / "digits" / "metrics.jsonl")) == "digits"
    assert _title(str(tmp_path / "digits" / "trace.json")) == "digits: trace.json"


def test_make_digits_without_scikit_learn_is_one_line():
    script = os.path.join(ROOT, "jobs", "data", "make_digits.py")
    code = f"import sys; sys.modules['sklearn'] = None; sys.argv = [{script!r}]; exec(open({script!r}).read())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.strip() == ("make_digits.py needs scikit-learn (its copy of the UCI "
                                                      "digits): pip install scikit-learn")


def test_no_metrics_file_is_committed_beside_the_configs():
    r = subprocess.run(["git", "-C", ROOT, "ls-files", "jobs/configs"], capture_output=True, text=True)
    if r.returncode:
        pytest.skip("not a git checkout")
    assert not [p for p in r.stdout.split() if not p.endswith(".toml")], r.stdout
    r = subprocess.run(["git", "-C", ROOT, "check-ignore", "-q", "jobs/configs/metrics.jsonl"])
    assert r.returncode == 0  # a run with checkpoint.dir = "" writes it there: ignored
