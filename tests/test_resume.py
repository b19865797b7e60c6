"""Resuming is exact: N steps straight equal N/2 steps, a checkpoint, and N/2 more, bit for bit."""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from helpers import config, gpt_config, make_classification, make_tokens, toml_job, run_trainer as run
from hpctrain.checkpoint import list_checkpoints, load_checkpoint
from hpctrain.errors import CheckpointError
from hpctrain.train import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("optim", [{"name": "sgd", "lr": 0.05, "momentum": 0.9}, {"name": "adamw", "lr": 0.01}],
                         ids=["sgd", "adamw"])
def test_resume_is_bit_exact(tmp_path, mesh, optim):
    make_classification(tmp_path / "d.h5", n=96)
    common = dict(optim=dict(optim, schedule="cosine", warmup_steps=2), data={"shuffle": True})
    straight = run(config(tmp_path / "d.h5", train={"steps": 10}, **common), mesh)
    ckdir = str(tmp_path / "ck")
    # the same job, "killed" after step 5: its step-10 checkpoint is removed
    run(config(tmp_path / "d.h5", train={"steps": 10}, checkpoint={"dir": ckdir, "every": 5}, **common), mesh)
    os.remove(os.path.join(ckdir, "ckpt-00000010.h5"))
    lines = []
    resumed = run(config(tmp_path / "d.h5", train={"steps": 10}, checkpoint={"dir": ckdir}, **common), mesh,
                  lines.append)
    assert any("resuming from" in line and "ckpt-00000005.h5 at step 5" in line for line in lines)
    a, b = straight.params.to_host_dict(), resumed.params.to_host_dict()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    for slot in straight.optim.slots:
        sa, sb = straight.optim.slots[slot].to_host_dict(), resumed.optim.slots[slot].to_host_dict()
        for name in sa:
            np.testing.assert_array_equal(sa[name], sb[name], err_msg=f"{slot}/{name}")
    assert resumed.optim.step_count == straight.optim.step_count == 10


def test_every_keep_and_final(tmp_path, mesh):
    make_classification(tmp_path / "d.h5", n=96)
    ckdir = tmp_path / "ck"
    run(config(tmp_path / "d.h5", train={"steps": 7}, checkpoint={"dir": str(ckdir), "every": 2, "keep": 2}), mesh)
    assert [step for step, _ in list_checkpoints(str(ckdir))] == [6, 7]
    state = load_checkpoint(str(ckdir / "ckpt-00000007.h5"), Trainer(
        config(tmp_path / "d.h5", checkpoint={"resume": "never"}), mesh=mesh, log=lambda *a: None).model.layout)
    assert state.step == 7 and state.layout == {"world_size": 1, "dp": 1, "pp": 1, "tp": 1}


def test_resume_never_and_init_ignored(tmp_path, mesh):
    make_classification(tmp_path / "d.h5", n=96)
    ckdir = str(tmp_path / "ck")
    first = run(config(tmp_path / "d.h5", train={"steps": 3}, checkpoint={"dir": ckdir}), mesh)
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(steps 3\); with checkpoint.resume = \"never\""):
        Trainer(config(tmp_path / "d.h5", train={"steps": 6}, checkpoint={"dir": ckdir, "resume": "never"}),
                mesh=mesh, log=lambda *a: None)
    fresh = Trainer(config(tmp_path / "d.h5", train={"steps": 6}, checkpoint={"dir": ckdir + "-new", "resume": "never",
                                                                              "init": ckdir + "/ckpt-00000003.h5"}),
                    mesh=mesh, log=lambda *a: None)
    assert fresh.step == 0  # a fresh start from the checkpoint's weights
    np.testing.assert_array_equal(fresh.params.to_host_dict()["0.weight"], first.params.to_host_dict()["0.weight"])
    lines = []
    Trainer(config(tmp_path / "d.h5", train={"steps": 6}, checkpoint={"dir": ckdir, "init": ckdir + "/ckpt-00000003.h5"}),
            mesh=mesh, log=lines.append)
    assert any("checkpoint.init" in line and "ignored" in line for line in lines)
    assert first.step == 3


def test_optimizer_mismatch_is_refused(tmp_path, mesh):
    make_classification(tmp_path / "d.h5", n=96)
    ckdir = str(tmp_path / "ck")
    run(config(tmp_path / "d.h5", train={"steps": 2}, checkpoint={"dir": ckdir}, optim={"name": "sgd"}), mesh)
    with pytest.raises(CheckpointError, match="optim"):
        Trainer(config(tmp_path / "d.h5", train={"steps": 4}, checkpoint={"dir": ckdir}, optim={"name": "adam"}),
                mesh=mesh, log=lambda *a: None)


def test_sigterm_writes_a_checkpoint_and_exits_cleanly(tmp_path):
    make_classification(tmp_path / "d.h5", n=96)
    (tmp_path / "c.toml").write_text(toml_job(hidden=64, train={"steps": 100_000_000, "log_every": 1000},
                                              checkpoint={"dir": "ck"}))
    proc = subprocess.Popen([sys.executable, "-m", "hpctrain", "train", str(tmp_path / "c.toml")], cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    first = proc.stdout.readline()  # training is under way once the first progress line is out
    while first and not first.startswith("step"):
        first = proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "signal SIGTERM received: stopping at step" in out
    checkpoints = list_checkpoints(str(tmp_path / "ck"))
    assert len(checkpoints) == 1


def test_finished_run_reports_instead_of_training_again(tmp_path, mesh):
    make_classification(tmp_path / "d.h5", n=96)
    ckdir = str(tmp_path / "ck")
    run(config(tmp_path / "d.h5", train={"steps": 3}, checkpoint={"dir": ckdir}), mesh)
    lines = []
    again = run(config(tmp_path / "d.h5", train={"steps": 3}, checkpoint={"dir": ckdir}), mesh, lines.append)
    assert again.step == 3
    assert any(f"training already finished: {ckdir} holds step 3, and train.steps = 3; to train further, raise "
               "train.steps past 3 (--set train.steps=6" in line for line in lines), lines
    assert [step for step, _ in list_checkpoints(ckdir)] == [3]
    lines = []  # a shorter run over a folder that holds more: the hint goes past what the folder holds
    run(config(tmp_path / "d.h5", train={"steps": 2}, checkpoint={"dir": ckdir}), mesh, lines.append)
    assert any("holds step 3, and train.steps = 2; to train further, raise train.steps past 3 (--set "
               "train.steps=5" in line for line in lines), lines


@pytest.mark.parametrize("changes, keys", [
    ({"optim": {"lr": 0.5}}, ["optim.lr"]),
    ({"train": {"batch_size": 16, "seed": 7}}, ["train.batch_size", "train.seed"]),
    ({"data": {"val_fraction": 0.5}}, ["data.val_fraction"]),
])
def test_resume_auto_refuses_a_run_with_other_settings(tmp_path, mesh, changes, keys):
    """The lr sweep that silently resumed (or found "already finished") the first run: refused, naming the keys."""
    make_classification(tmp_path / "d.h5", n=96)
    ckdir = str(tmp_path / "ck")
    run(config(tmp_path / "d.h5", train={"steps": 3}, checkpoint={"dir": ckdir}), mesh)

    def changed(**extra):
        sections = {"train": {"steps": 6}, "checkpoint": {"dir": ckdir, **extra}}
        for section, values in changes.items():
            sections[section] = {**sections.get(section, {}), **values}
        return config(tmp_path / "d.h5", **sections)

    with pytest.raises(CheckpointError) as e:
        run(changed(), mesh)
    text = str(e.value)
    assert "\n" not in text and "written by a run with other settings" in text and "a new checkpoint.dir" in text
    for key in keys:
        assert f"{key} " in text, text
    assert "checkpoint.allow_changed=[" + ", ".join(f'"{k}"' for k in keys) + "]" in text, text
    assert [step for step, _ in list_checkpoints(ckdir)] == [3]  # nothing trained, nothing written
    resumed = run(changed(allow_changed=keys), mesh)  # listed: that run goes on with the new settings
    assert resumed.step == 6


def test_resume_auto_allows_settings_that_do_not_change_the_result(tmp_path, mesh):
    make_classification(tmp_path / "d.h5", n=96)
    ckdir = str(tmp_path / "ck")
    run(config(tmp_path / "d.h5", train={"steps": 3}, checkpoint={"dir": ckdir}), mesh)
    lines = []
    resumed = run(config(tmp_path / "d.h5", train={"steps": 5, "log_every": 1, "micro_batches": 2},
                         checkpoint={"dir": ckdir, "every": 1, "keep": 5}, parallel={"bucket_mb": 1.0}),
                  mesh, lines.append)
    assert resumed.step == 5 and any("resuming from" in line for line in lines), lines


def test_allow_changed_names_settings_only(tmp_path):
    from hpctrain.config import parse_config
    from hpctrain.errors import ConfigError

    with pytest.raises(ConfigError, match=r"checkpoint.allow_changed: 'optim.learning_rate': not a setting"):
        parse_config({"model": {"layers": [{"type": "linear", "in": 2, "out": 2}]},
                      "data": {"path": "d.h5", "inputs": "x", "targets": "y"},
                      "checkpoint": {"allow_changed": ["optim.learning_rate"]}})


def test_resuming_an_older_checkpoint_warns_about_newer_ones(tmp_path, mesh):
    make_classification(tmp_path / "d.h5", n=96)
    ckdir = str(tmp_path / "ck")
    run(config(tmp_path / "d.h5", train={"steps": 6}, checkpoint={"dir": ckdir, "every": 2}), mesh)
    lines = []
    Trainer(config(tmp_path / "d.h5", train={"steps": 6}, data={"seed": 7, "shuffle": True},
                   checkpoint={"dir": ckdir, "resume": ckdir + "/ckpt-00000002.h5"}), mesh=mesh, log=lines.append)
    assert any("holds checkpoints newer than the one resumed (steps 4, 6)" in line for line in lines), lines
    assert any("warning: the data order changed" in line for line in lines), lines


def test_metrics_resume_drops_lines_past_the_checkpoint(tmp_path, mesh):
    make_classification(tmp_path / "d.h5", n=96)
    ckdir, metrics = str(tmp_path / "ck"), tmp_path / "m.jsonl"
    train = {"steps": 6, "metrics": str(metrics), "log_every": 1}
    run(config(tmp_path / "d.h5", train=train, checkpoint={"dir": ckdir, "every": 3}), mesh)
    run(config(tmp_path / "d.h5", train=train, checkpoint={"dir": ckdir, "resume": ckdir + "/ckpt-00000003.h5"}),
        mesh)
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"loss"' in line]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_settings_an_older_checkpoint_did_not_record_are_not_compared(tmp_path):
    """A checkpoint written before a setting existed (optim.min_lr, optim.decay_min_ndim, ...) resumes: only
    settings both configs hold are compared; one written with no config at all is not compared."""
    from hpctrain.train.resume_check import changed_settings

    make_classification(tmp_path / "d.h5", n=96)
    cfg = config(tmp_path / "d.h5", optim={"min_lr": 0.0})
    older = "\n".join(line for line in cfg.to_toml().splitlines()
                      if not line.startswith(("min_lr", "decay_min_ndim", "allow_changed")))
    assert changed_settings(older, cfg) == []
    assert changed_settings("", cfg) == []
    assert changed_settings(older.replace("lr = 0.1", "lr = 0.2"), cfg) == [("optim.lr", 0.2, 0.1)]


def test_the_cuda_settings_may_change_on_a_resume(tmp_path):
    """docs/config.md's [cuda]: how the GPU runs the step (the arena, the graphs, the GEMM provider), not what it
    computes."""
    import dataclasses

    from hpctrain.config import CudaConfig
    from hpctrain.train.resume_check import changed_settings

    make_classification(tmp_path / "d.h5", n=96)
    cfg = config(tmp_path / "d.h5")
    now = dataclasses.replace(cfg, cuda=CudaConfig(arena=False, graphs=False, gemm="numba"))
    assert changed_settings(cfg.to_toml(), now) == []


def test_a_batch_size_change_goes_on_from_the_samples_consumed(tmp_path, mesh):
    """Resumed with another train.batch_size (allowed), the run reads on from the samples the checkpoint's run
    took in its epoch, rounded up to a whole batch, says so, and its checkpoints say where it stands."""
    make_classification(tmp_path / "d.h5", n=96)  # 72 training rows: 9 steps of 8 an epoch, 4 of 16
    ckdir = str(tmp_path / "ck")
    run(config(tmp_path / "d.h5", train={"steps": 5}, checkpoint={"dir": ckdir}), mesh)  # 40 rows taken
    lines = []
    resumed = run(config(tmp_path / "d.h5", train={"steps": 7, "batch_size": 16},
                         checkpoint={"dir": ckdir, "allow_changed": ["train.batch_size"]}), mesh, lines.append)
    assert any("had taken 40 samples of epoch 0 in batches of 8; this run goes on with epoch 0 at step 3 of 4 in "
               "batches of 16 (8 samples left out to start on a whole batch)" in line for line in lines), lines
    assert resumed.sampler.local_rows(5).tolist() == list(range(48, 64))  # not rows 80.. (step 5 of 16 each)
    assert resumed.sampler.position(6) == (1, 0)
    state = load_checkpoint(os.path.join(ckdir, "ckpt-00000007.h5"), resumed.model.layout)
    assert (state.epoch, state.data_position) == (1, 1)
    again = run(config(tmp_path / "d.h5", train={"steps": 8, "batch_size": 16},  # the same batch from there on
                       checkpoint={"dir": ckdir, "allow_changed": ["train.batch_size"]}), mesh, lines.append)
    assert again.sampler.position(7) == (1, 1) and again.sampler.offset == resumed.sampler.offset


def test_resume_auto_refuses_other_data_and_follows_a_moved_file(tmp_path, mesh):
    """data.path may change (the file moved to scratch), its contents may not: other rows under any name are
    refused like a changed setting (allowed by listing "data.path"); a copy of the same file resumes."""
    import shutil

    make_classification(tmp_path / "d.h5", n=96)
    make_classification(tmp_path / "other.h5", n=96, seed=1)
    shutil.copy(tmp_path / "d.h5", tmp_path / "moved.h5")
    ckdir = str(tmp_path / "ck")
    run(config(tmp_path / "d.h5", train={"steps": 3}, checkpoint={"dir": ckdir}), mesh)
    with pytest.raises(CheckpointError) as e:
        run(config(tmp_path / "other.h5", train={"steps": 6}, checkpoint={"dir": ckdir}), mesh)
    text = str(e.value)
    assert "\n" not in text and "the data at data.path (its contents' fingerprint " in text, text
    assert """--set 'checkpoint.allow_changed=["data.path"]'""" in text, text
    assert run(config(tmp_path / "moved.h5", train={"steps": 4}, checkpoint={"dir": ckdir}), mesh).step == 4
    assert run(config(tmp_path / "other.h5", train={"steps": 5},
                      checkpoint={"dir": ckdir, "allow_changed": ["data.path"]}), mesh).step == 5


def test_refusals_suggest_every_key_to_list_in_toml(tmp_path, mesh):
    """The suggested --set replaces checkpoint.allow_changed: it keeps what is listed already; values read as
    the config file writes them; settings without effect in either run (SGD's momentum under AdamW) are not
    compared."""
    make_classification(tmp_path / "d.h5", n=96)
    ckdir = str(tmp_path / "ck")
    adamw = {"name": "adamw", "lr": 0.01, "momentum": 0.5}
    run(config(tmp_path / "d.h5", train={"steps": 3}, optim=adamw, checkpoint={"dir": ckdir}), mesh)
    with pytest.raises(CheckpointError) as e:
        run(config(tmp_path / "d.h5", train={"steps": 6, "batch_size": 16, "deterministic": True},
                   optim=dict(adamw, lr=0.02, momentum=0.9),
                   checkpoint={"dir": ckdir, "allow_changed": ["optim.lr"]}), mesh)
    text = str(e.value)
    assert "train.deterministic false then, true now" in text, text
    assert "optim.momentum" not in text, text
    assert """allow_changed=["optim.lr", "train.batch_size", "train.deterministic"]'""" in text, text


def test_a_checkpoint_of_another_vocabulary_is_refused_even_when_named(tmp_path, mesh):
    """Token ids mean other characters under another vocabulary: no resume, found or named, continues on it."""
    make_tokens(tmp_path / "a.h5", vocab="abcdefgh\n ")
    make_tokens(tmp_path / "b.h5", vocab="abcdefghij\n ")
    ckdir = str(tmp_path / "ck")
    run(gpt_config(tmp_path / "a.h5", checkpoint={"dir": ckdir}), mesh)
    named = ckdir + "/ckpt-00000004.h5"
    for checkpoint in ({"dir": ckdir, "allow_changed": ["data.path"]}, {"dir": ckdir, "resume": named}):
        with pytest.raises(CheckpointError) as e:
            run(gpt_config(tmp_path / "b.h5", train={"steps": 6}, checkpoint=checkpoint), mesh)
        text = str(e.value)
        assert "was written for the vocabulary '\\n abcdefgh' (10 characters) and " in text, text
        assert "has '\\n abcdefghij' (12 characters): its token ids would mean other characters" in text, text


def test_sgd_momentum_switched_on_at_a_resume_starts_its_buffer_at_zero(tmp_path, mesh):
    """A run without momentum keeps no momentum buffer. Resumed with momentum (listed in allow_changed) the
    buffer starts at zero, as torch.optim.SGD makes it at its first step (buf = grad): that step is the plain
    SGD step, bit for bit. Not listed, the refusal names optim.momentum, not the optimizer."""
    make_classification(tmp_path / "d.h5", n=96)
    ckdir = str(tmp_path / "ck")
    plain = {"name": "sgd", "lr": 0.05}
    run(config(tmp_path / "d.h5", train={"steps": 3}, optim=plain, checkpoint={"dir": ckdir}), mesh)
    straight = run(config(tmp_path / "d.h5", train={"steps": 4}, optim=plain), mesh)
    with pytest.raises(CheckpointError, match=r"optim.momentum 0.0 then, 0.9 now") as e:
        run(config(tmp_path / "d.h5", train={"steps": 4}, optim=dict(plain, momentum=0.9),
                   checkpoint={"dir": ckdir}), mesh)
    assert "written with optimizer" not in str(e.value)
    resumed = run(config(tmp_path / "d.h5", train={"steps": 4}, optim=dict(plain, momentum=0.9),
                         checkpoint={"dir": ckdir, "allow_changed": ["optim.momentum"]}), mesh)
    a, b = straight.params.to_host_dict(), resumed.params.to_host_dict()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert np.any(resumed.optim.slots["momentum_buffer"].data != 0)


def test_the_optimizer_refusal_says_how_to_start_from_the_weights(tmp_path, mesh):
    make_classification(tmp_path / "d.h5", n=96)
    ckdir = str(tmp_path / "ck")
    run(config(tmp_path / "d.h5", train={"steps": 2}, checkpoint={"dir": ckdir}, optim={"name": "adamw"}), mesh)
    with pytest.raises(CheckpointError, match="use it as checkpoint.init with a new checkpoint.dir"):
        run(config(tmp_path / "d.h5", train={"steps": 4}, checkpoint={"dir": ckdir}, optim={"name": "sgd"}), mesh)


def test_a_trainer_gives_the_signals_back_when_run_ends(tmp_path, mesh):
    """Made without a stop flag, a Trainer records SIGTERM/SIGUSR1 from its construction to the end of run() (and
    SIGINT while the stop checkpoint is written), then puts the handlers back: what a script does afterwards
    can be interrupted (Ctrl-C was swallowed until close()). A second run() takes them again."""
    import signal

    make_classification(tmp_path / "d.h5", n=96)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    trainer = Trainer(config(tmp_path / "d.h5", train={"steps": 2}), mesh=mesh, log=lambda *a: None)
    try:
        assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]
        for _ in range(2):
            trainer.run()
            assert {s: signal.getsignal(s) for s in before} == before
    finally:
        trainer.close()
    assert {s: signal.getsignal(s) for s in before} == before


def test_a_run_without_a_checkpoint_folder_says_so(tmp_path, mesh):
    """nanoGPT always has an out_dir: a run with checkpoint.dir = "" says at start-up that it saves nothing."""
    make_classification(tmp_path / "d.h5", n=96)
    lines = []
    run(config(tmp_path / "d.h5", train={"steps": 2}), mesh, lines.append)
    assert any(line.startswith("checkpoint.dir is empty: this run writes no checkpoint") for line in lines), lines
