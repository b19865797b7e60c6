"""The command line: bad input gives one clear line and exit status 2; the digits job learns."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers import make_classification, toml_job
from launch import hpctrain_lines, mpi_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GOOD = toml_job(train={"log_every": 1, "metrics": "out/m.jsonl"}, checkpoint={"dir": "out"})


def hpctrain(*args, cwd=ROOT, launcher=()):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([*launcher, sys.executable, "-m", "hpctrain", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def job(tmp_path):
    make_classification(tmp_path / "d.h5", n=64)
    make_classification(tmp_path / "nan.h5", n=64, nan_row=40)
    return tmp_path


BAD = [
    ("malformed", lambda t: "[model\n", "malformed TOML"),
    ("section", lambda t: t + "[extra]\nx = 1\n", r"unknown section [extra]"),
    ("key", lambda t: t.replace("steps = 3", "step = 3"), "train.step: unknown key"),
    ("type", lambda t: t.replace("steps = 3", "steps = '3'"), "train.steps: expected int, got string '3'"),
    ("width", lambda t: t.replace("in = 8, out = 3", "in = 7, out = 3"),
     "model.layers[2].in = 7 does not match the previous output width 8"),
    ("targets", lambda t: t + '[train]\n' if False else t.replace('backend = "cpu"', 'backend = "cpu"\nloss = "mse"'),
     "mse needs targets of shape (N, 3)"),
    ("file", lambda t: t.replace('"d.h5"', '"missing.h5"'), "missing.h5 does not exist"),
    ("dataset", lambda t: t.replace('inputs = "x"', 'inputs = "images"'), "no dataset 'images' (data.inputs)"),
    ("nan", lambda t: t.replace('"d.h5"', '"nan.h5"'), "inputs contain NaN or Inf (first in row 40)"),
    ("batch", lambda t: t.replace("batch_size = 8", "batch_size = 100"),
     "train.batch_size = 100 is larger than the training split (58 samples)"),
    ("metrics", lambda t: t.replace('metrics = "out/m.jsonl"', 'metrics = "."'), "is a folder"),
    ("ckptdir", lambda t: t.replace('dir = "out"', 'dir = "d.h5"'), "d.h5 is not a folder"),
    ("ckptdir-under-file", lambda t: t.replace('dir = "out"', 'dir = "d.h5/ck"'), "is not a writable folder"),
    ("init", lambda t: t + 'init = "missing.h5"\n', "weights file"),
    ("trace-over-checkpoint", lambda t: t.replace('metrics = "out/m.jsonl"', 'metrics = "out/m.jsonl"\ntrace = "out/ckpt-00000003.h5"'),
     "ckpt-00000003.h5 is checkpoint.dir or a checkpoint's name in it; the trace would overwrite a checkpoint"),
    ("trace-is-ckptdir", lambda t: t.replace('metrics = "out/m.jsonl"', 'metrics = "out/m.jsonl"\ntrace = "./out"'),
     "is checkpoint.dir or a checkpoint's name in it; the trace would overwrite a checkpoint"),
    ("layer-type", lambda t: t.replace('{type = "relu"}', '{type = ["relu"]}'),
     "model.layers[1].type: expected one of linear, relu, gelu, tanh, layernorm, got array ['relu']"),
    ("train-seed", lambda t: t.replace("steps = 3", "steps = 3\nseed = -1"), "train.seed: must be in [0, 2**63 - 1]"),
    ("data-seed", lambda t: t.replace('targets = "y"', 'targets = "y"\nseed = -1'), "data.seed: must be in [0, 2**63 - 1]"),
    ("seed-int64", lambda t: t.replace("steps = 3", "steps = 3\nseed = 9223372036854775808"),
     "train.seed: must fit in a 64-bit signed integer"),
    # 7 * 2**57 float32 parameters pass the config check but exceed any address space: MemoryError
    ("memory", lambda t: t.replace("in = 6, out = 8", f"in = 6, out = {2**57}").replace("in = 8, out = 3", f"in = {2**57}, out = 3"),
     "out of memory: "),
]


@pytest.mark.parametrize("name,edit,message", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_one_line_and_exit_2(job, name, edit, message):
    (job / "c.toml").write_text(edit(GOOD))
    proc = hpctrain("train", str(job / "c.toml"))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hpctrain: error: "), proc.stderr
    assert message in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    assert not (job / "out").exists()  # nothing written before the input was found good


def test_config_path_under_a_file_is_one_line(job):
    proc = hpctrain("train", str(job / "d.h5" / "c.toml"))
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("hpctrain: error: "), proc.stderr
    assert "d.h5/c.toml' cannot be read: Not a directory" in lines[0], lines[0]


def test_train_with_overrides_and_module_entry(job):
    (job / "c.toml").write_text(GOOD)
    proc = hpctrain("train", str(job / "c.toml"), "--set", "train.steps=4", "--set",
                    f"train.metrics={job}/elsewhere/m.jsonl", "--set", "optim.name=adamw")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (job / "elsewhere" / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
    assert (job / "out" / "ckpt-00000004.h5").exists()  # the final checkpoint
    assert "step      4/4" in proc.stdout


@pytest.mark.parametrize("seed", ["-1", str(2**63), "x"])
def test_a_bad_sample_seed_is_one_usage_line(seed):
    proc = hpctrain("sample", "no-such.h5", "--prompt", "a", "--seed", seed)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "argument --seed:" in proc.stderr.splitlines()[-1]


def test_unknown_override_key(job):
    (job / "c.toml").write_text(GOOD)
    proc = hpctrain("train", str(job / "c.toml"), "--set", "optim.learning_rate=0.1")
    assert proc.returncode == 2 and "optim.learning_rate: unknown key" in proc.stderr


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found (pip install hpctrain[mpich])")
def test_bad_input_under_mpiexec_is_reported_once(job):
    (job / "c.toml").write_text(GOOD.replace('"d.h5"', '"nan.h5"'))
    proc = hpctrain("train", str(job / "c.toml"), launcher=mpi_command(shutil.which("mpiexec"), 2))
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpctrain: error")]
    assert len(errors) == 1 and "[rank 1/2]" in errors[0]  # row 40 is in rank 1's share of the scan and "NaN" in errors[0], proc.stderr


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found (pip install hpctrain[mpich])")
def test_a_rank_failing_in_a_command_without_mpi_ends_instead_of_waiting(tmp_path):
    """A command that never starts MPI (data csv2h5, predict, export) launched on two ranks, one of which fails
    after the other has left: its error handler must not start MPI to name its rank or abort the job (MPI's
    start waits for every rank of the launch, and the other will never come)."""
    (tmp_path / "ok.csv").write_text("a,b,y\n1,2,0\n3,4,1\n")
    mpiexec = shutil.which("mpiexec")
    one = [sys.executable, "-m", "hpctrain", "data", "csv2h5"]
    launch = mpi_command(mpiexec, 1, *one, str(tmp_path / "ok.csv"), str(tmp_path / "a.h5"), "--target", "y")
    launch += [":", "-n", "1", *one, str(tmp_path / "missing.csv"), str(tmp_path / "b.h5"), "--target", "y"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(launch, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and (tmp_path / "a.h5").exists(), proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("hpctrain: error")]
    assert len(errors) == 1 and "missing.csv" in errors[0], proc.stderr


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found (pip install hpctrain[mpich])")
@pytest.mark.parametrize("override, message", [
    ("parallel.pp=3", "world size 2 is not divisible by parallel.pp · parallel.tp = 3 · 1"),
    ("parallel.schedule=zigzag", "parallel.schedule: expected one of '1f1b', 'gpipe', 'zero-bubble', 'zero-bubble-h2', "
                                  "'interleaved-1f1b', got 'zigzag'"),
    ("parallel.stages=[[0, 1], [1, 2]]", "parallel.stages[1] = [1, 2] overlaps the stage before it"),
    ("train.micro_batches=3", "train.micro_batches = 3 does not divide this rank's share of the batch (8"),
    ("parallel.dp=2", "parallel.dp · pp · tp = 2 · 2 · 1 = 4 does not match the world size 2"),
])
def test_bad_pipeline_input_under_mpiexec_is_one_line(job, override, message):
    (job / "c.toml").write_text(GOOD)
    proc = hpctrain("train", str(job / "c.toml"), "--set", "parallel.pp=2", "--set", override,
                    launcher=mpi_command(shutil.which("mpiexec"), 2))
    assert proc.returncode == 2, proc.stderr
    errors = hpctrain_lines(proc.stderr)  # less the launcher's report of the exit status 2
    assert len(errors) == 1 and errors[0].startswith("hpctrain: error [rank 0/2]: "), proc.stderr
    assert message in errors[0], errors[0]
    assert not (job / "out").exists()


@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="mpiexec not found (pip install hpctrain[mpich])")
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_digits_pipeline_job_learns_and_writes_a_trace(tmp_path, schedule):
    proc = hpctrain("train", "jobs/configs/digits-pp2.toml", "--set", f"train.metrics={tmp_path}/m.jsonl",
                    "--set", f"checkpoint.dir={tmp_path}/ckpt", "--set", f"train.trace={tmp_path}/trace.json",
                    "--set", "train.steps=300", "--set", f"parallel.schedule={schedule}",
                    launcher=mpi_command(shutil.which("mpiexec"), 2))
    assert proc.returncode == 0, proc.stderr
    assert (f"pipeline: schedule {schedule}, 4 micro-batch(es), stages (the default cut, by estimated FLOPs per row) "
            "0: layers 0..1 (32% of the FLOPs, 8,320 parameters), 1: layers 2..4 (68% of the FLOPs, 17,802 "
            "parameters)") in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r for r in records if "val_accuracy" in r][-1]["val_accuracy"] >= 0.95
    assert all(len(r["stages"]) == 2 for r in records if "loss" in r)
    trace = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["tid"] for e in trace if e["ph"] == "X"} == {0, 1}
    assert (tmp_path / "ckpt" / "ckpt-00000300.h5").exists()


def test_digits_job_reaches_97_percent(tmp_path):
    proc = hpctrain("train", "jobs/configs/digits.toml", "--set", f"train.metrics={tmp_path}/m.jsonl",
                    "--set", f"checkpoint.dir={tmp_path}/ckpt")
    assert proc.returncode == 0, proc.stderr
    evals = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines() if "val_accuracy" in line]
    assert evals[-1]["val_accuracy"] >= 0.97


def test_progress_reaches_a_log_file_as_it_happens(tmp_path):
    """With PYTHONUNBUFFERED unset (as in users' shells and Slurm) and stdout a file, lines arrive at once.

    The job trains for ever: a buffered line would reach the file only when the process exits, which it
    never does on its own. So the line must be there while it still runs; the 120 s bound only ends a
    failing test, and a slow start-up on a loaded machine stays far inside it."""
    import time

    make_classification(tmp_path / "d.h5", n=64)
    # the start-up lines, then none for a long time: far from filling an 8 KiB stdout buffer
    (tmp_path / "job.toml").write_text(toml_job(train={"steps": 10_000_000, "log_every": 10_000_000, "eval_every": 0}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["PYTHONPATH"] = ROOT
    with open(tmp_path / "log.txt", "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "hpctrain", "train", str(tmp_path / "job.toml")], cwd=ROOT,
                                env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while (time.monotonic() < deadline and proc.poll() is None
                   and "hpctrain: world 1" not in (tmp_path / "log.txt").read_text()):
                time.sleep(0.2)
            assert proc.poll() is None, (tmp_path / "log.txt").read_text()  # still training
            assert "hpctrain: world 1" in (tmp_path / "log.txt").read_text()
        finally:
            proc.kill()
            proc.wait()


def test_version_env_and_config_commands(tmp_path):
    from hpctrain import __version__
    from hpctrain.config import load_config

    r = hpctrain("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"hpctrain {__version__}"
    r = hpctrain("env")
    assert r.returncode == 0, r.stderr
    for word in ("hpctrain", "Python", "numpy", "mpi4py", "MPI library", "thread level", "CUDA-aware", "GPUs", "BLAS"):
        assert word in r.stdout, word
    r = hpctrain("config", "jobs/configs/gpt-char.toml", "--set", "parallel.tp=2")
    assert r.returncode == 0, r.stderr
    (tmp_path / "resolved.toml").write_text(r.stdout)
    again = load_config(str(tmp_path / "resolved.toml"))
    want = load_config(os.path.join(ROOT, "jobs/configs/gpt-char.toml"), ["parallel.tp=2"])
    assert again.to_toml() == want.to_toml() and again.parallel.tp == 2 and "warmup_steps = 100" in r.stdout
    r = hpctrain("config", "jobs/configs/gpt-char.toml", "--set", "model.n_head=5")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "not divisible" in r.stderr


def test_inspect_of_a_path_that_does_not_exist_is_a_usage_error_naming_what_the_folder_holds(tmp_path):
    """A mistyped checkpoint name: exit 2 (the command line), one line, and the checkpoints that are there."""

    (tmp_path / "ckpt-00000600.h5").write_bytes(b"")  # list_checkpoints goes by the name
    proc = hpctrain("inspect", str(tmp_path / "ckpt-00000300.h5"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == (f"hpctrain: error: {tmp_path}/ckpt-00000300.h5 does not exist; {tmp_path} holds "
                           "ckpt-00000600.h5\n"), proc.stderr
    assert proc.stdout == ""
    proc = hpctrain("inspect", str(tmp_path / "none" / "ckpt.h5"))
    assert proc.returncode == 2 and proc.stderr.endswith("ckpt.h5 does not exist\n"), proc.stderr


def _subcommands(parser, prefix=()):
    """(words, subparser) of every subcommand, the data subcommands too."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*prefix, name), sub
                yield from _subcommands(sub, (*prefix, name))


def test_every_subcommands_help_has_examples_that_parse_and_the_path_rule():
    import shlex

    from hpctrain.commands.parser import PATHS, parser as _parser

    parser = _parser()
    seen = []
    for words, sub in _subcommands(parser):
        text = sub.format_help()
        assert "example" in text and PATHS in " ".join(text.split()), (words, text)
        examples = text[text.index("example"):text.index("paths:")].splitlines()[1:]
        assert examples, words
        for line in examples:
            argv = shlex.split(line.split("  #")[0].strip(), comments=True)
            argv = argv[argv.index("hpctrain") + 1:]
            if "--help" not in argv:
                parser.parse_args(argv)  # a renamed option or subcommand fails here
        seen.append(" ".join(words))
    assert {"train", "eval", "data csv2h5", "plot", "export", "env"} <= set(seen)


def test_a_reader_that_goes_away_does_not_stop_training(tmp_path):
    """``hpctrain train ... | head -1``: the log lines after the reader left go nowhere; training runs to its end
    and writes its checkpoint (a BrokenPipeError used to end the run at its next log line, with a traceback)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a user's shell
    env["PYTHONPATH"] = ROOT
    command = (f"set -o pipefail; {sys.executable} -m hpctrain train jobs/configs/digits.toml --set train.steps=60 "
               f"--set train.log_every=2 --set train.eval_every=0 --set train.backend=cpu "
               f"--set checkpoint.dir={tmp_path}/ck | head -1")
    proc = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "ckpt-00000060.h5" in os.listdir(tmp_path / "ck")
