"""One job per checkpoint folder: world rank 0 holds <checkpoint.dir>/hpctrain.lock from start-up to the end."""

import errno
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading

import pytest

from helpers import config, folder_listing, make_classification, toml_job
from launch import hpctrain_lines, mpi_command
from hpctrain.checkpoint import list_checkpoints
from hpctrain.checkpoint.lock import LOCK_NAME, FolderLock
from hpctrain.errors import CheckpointError, CheckpointInUseError, NonFiniteError
from hpctrain.train import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = shutil.which("mpiexec")
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install hpctrain[mpich])")
QUIET = lambda *a: None  # noqa: E731


def child_env(**extra):
    """This environment without the launcher's PMI variables (a nested mpiexec), hpctrain from this checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "MPI_LOCALRANKID"))}
    env.pop("SLURM_JOB_ID", None)
    return dict(env, PYTHONPATH=ROOT, **extra)


def write_job(tmp_path, **train):
    make_classification(tmp_path / "d.h5", n=64)
    (tmp_path / "job.toml").write_text(toml_job(train=dict({"steps": 3}, **train), checkpoint={"dir": "ck"}))
    return str(tmp_path / "job.toml")


def hpctrain(job, *args, env=None, launcher=()):
    return subprocess.run([*launcher, sys.executable, "-m", "hpctrain", "train", job, *args], cwd=ROOT,
                          env=env or child_env(), capture_output=True, text=True, timeout=120)


def start_long_job(job, env):
    """A job that trains (almost) forever, returned once it is past start-up (and so holds the lock)."""
    proc = subprocess.Popen([sys.executable, "-m", "hpctrain", "train", job, "--set", "train.steps=100000000",
                             "--set", "train.log_every=100000000"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(60, proc.kill)  # SIGKILL: a Trainer records SIGTERM and carries on to a checkpoint
    watchdog.start()
    first = proc.stdout.readline()  # "hpctrain: world 1 = ...", logged at the end of start-up
    watchdog.cancel()
    if not first.startswith("hpctrain: world"):
        proc.kill()
        pytest.fail(f"the long job did not start: {first}{proc.communicate()[1]}")
    return proc


def holder(folder):
    with open(os.path.join(folder, LOCK_NAME)) as f:
        return json.load(f)


def test_a_second_job_on_a_folder_in_use_fails_naming_the_holder_until_it_stops(tmp_path):
    job = write_job(tmp_path)
    ck = str(tmp_path / "ck")
    first = start_long_job(job, child_env(SLURM_JOB_ID="567"))
    try:
        record = holder(ck)
        assert (record["pid"], record["host"], record["job"]) == (first.pid, socket.gethostname(), "567")
        second = hpctrain(job)
        assert sorted(os.listdir(ck)) == [LOCK_NAME]  # the second job read and wrote nothing there
        first.send_signal(signal.SIGTERM)
        out, err = first.communicate(timeout=60)
    finally:
        first.kill()
    assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
    assert (f"hpctrain: error: checkpoint.dir {ck} is in use by pid {first.pid} on host {socket.gethostname()} "
            f"since {record['started']} (job 567); only one job may use a checkpoint folder") in second.stderr
    assert "Traceback" not in second.stderr and "step" not in second.stdout
    # the first job stopped on SIGTERM with its checkpoint, released the lock and removed its file
    assert first.returncode == 0 and "signal SIGTERM received" in out, err
    assert len(list_checkpoints(ck)) == 1 and len(folder_listing(ck)) == 2  # the index and its shards
    third = hpctrain(job)
    assert third.returncode == 0 and "resuming from" in third.stdout, third.stderr


def test_a_lock_left_by_a_killed_job_does_not_block_the_next_one(tmp_path):
    """kill -9 leaves the file behind but the kernel drops the flock; a requeued Slurm job takes it over."""
    job = write_job(tmp_path)
    ck = str(tmp_path / "ck")
    env = child_env(SLURM_JOB_ID="4242")
    killed = start_long_job(job, env)
    killed.kill()
    killed.communicate(timeout=60)
    assert holder(ck)["pid"] == killed.pid  # stale: its process is gone
    requeued = hpctrain(job, env=env)
    assert requeued.returncode == 0, requeued.stderr
    assert (f"taking over a stale lock of pid {killed.pid} on host {socket.gethostname()}" in requeued.stdout
            and "(job 4242)" in requeued.stdout and "the same Slurm job, requeued" in requeued.stdout), requeued.stdout
    assert LOCK_NAME not in os.listdir(ck) and [s for s, _ in list_checkpoints(ck)] == [3]


def test_an_unreadable_stale_lock_file_does_not_block_a_job(tmp_path, mesh):
    make_classification(tmp_path / "d.h5", n=64)
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / LOCK_NAME).write_text("not json {")
    t = Trainer(config(tmp_path / "d.h5", checkpoint={"dir": str(tmp_path / "ck")}), mesh=mesh, log=QUIET)
    assert holder(tmp_path / "ck")["pid"] == os.getpid()
    t.run()
    t.close()
    assert folder_listing(tmp_path / "ck") == ["ckpt-00000005.h5", "ckpt-00000005.shards"]


def test_the_lock_is_held_while_a_trainer_lives_and_released_by_close_or_a_failed_start(tmp_path, mesh):
    make_classification(tmp_path / "d.h5", n=64)
    ck = str(tmp_path / "ck")
    cfg = config(tmp_path / "d.h5", checkpoint={"dir": ck})
    t = Trainer(cfg, mesh=mesh, log=QUIET)
    with pytest.raises(CheckpointInUseError, match=f"checkpoint.dir {ck} is in use by pid {os.getpid()} on host"):
        Trainer(cfg, mesh=mesh, log=QUIET)  # flock is per open file: a second one in this process is refused too
    t.run()
    t.close()
    FolderLock.take(ck, log=QUIET).release()  # free after a normal run
    # an error after the lock was taken, before training: released before the Trainer's constructor raises
    never = config(tmp_path / "d.h5", checkpoint={"dir": ck, "resume": "never"})
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        Trainer(never, mesh=mesh, log=QUIET)
    FolderLock.take(ck, log=QUIET).release()
    # a folder the lock made for a job that failed at start-up is removed again
    with pytest.raises(CheckpointError, match="does not exist"):
        Trainer(config(tmp_path / "d.h5", checkpoint={"dir": ck + "-new", "resume": ck + "-nothing.h5"}), mesh=mesh,
                log=QUIET)
    assert not os.path.exists(ck + "-new")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value encountered:RuntimeWarning")
def test_the_lock_is_released_after_an_error_during_training(tmp_path, mesh):
    make_classification(tmp_path / "d.h5", n=64)
    ck = str(tmp_path / "ck")
    t = Trainer(config(tmp_path / "d.h5", optim={"lr": 1e38}, checkpoint={"dir": ck}), mesh=mesh, log=QUIET)
    try:
        with pytest.raises(NonFiniteError):
            t.run()
    finally:
        t.close()  # as the CLI does on the way out of any error
    FolderLock.take(ck, log=QUIET).release()
    # and from the command line: the failed job exits 2, the next one starts
    job = write_job(tmp_path)
    failed = hpctrain(job, "--set", "optim.lr=1e38")
    assert failed.returncode == 2 and "the gradients contain NaN or Inf" in failed.stderr, failed.stderr
    assert not os.path.exists(os.path.join(ck, LOCK_NAME))
    assert hpctrain(job).returncode == 0


def test_a_filesystem_without_flock_is_one_error_unless_the_lock_is_turned_off(tmp_path, mesh, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    make_classification(tmp_path / "d.h5", n=64)
    ck = str(tmp_path / "ck")
    with pytest.raises(CheckpointError, match=r"flock failed: No locks available .*set checkpoint.lock = false"):
        Trainer(config(tmp_path / "d.h5", checkpoint={"dir": ck}), mesh=mesh, log=QUIET)
    assert not os.path.exists(ck)
    lines = []
    t = Trainer(config(tmp_path / "d.h5", checkpoint={"dir": ck, "lock": False}), mesh=mesh, log=lines.append)
    t.run()
    t.close()
    assert any("checkpoint.lock = false" in line and "not locked" in line for line in lines)
    assert folder_listing(ck) == ["ckpt-00000005.h5", "ckpt-00000005.shards"]


# records which ranks take the lock, then runs the CLI
RANKS_SCRIPT = """
import sys
from mpi4py import MPI
import hpctrain.checkpoint.lock as ckpt_lock
from hpctrain.cli import main

take = ckpt_lock.FolderLock.take.__func__
def recorded(cls, folder, **kwargs):
    print(f"lock taken on rank {MPI.COMM_WORLD.rank}", flush=True)
    return take(cls, folder, **kwargs)
ckpt_lock.FolderLock.take = classmethod(recorded)
sys.exit(main(["train", *sys.argv[1:]]))
"""


@needs_mpiexec
@pytest.mark.parametrize("mode", ["sync", "async_ps"])
def test_a_two_rank_job_takes_the_lock_on_rank_0_only(tmp_path, mode):
    job = write_job(tmp_path)
    ck = str(tmp_path / "ck")
    mpi = mpi_command(MPIEXEC, 2)
    run = subprocess.run([*mpi, sys.executable, "-c", RANKS_SCRIPT, job, "--set", f'parallel.mode="{mode}"'],
                         cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("lock taken on rank") == 1 and "lock taken on rank 0" in run.stdout, run.stdout
    assert [s for s, _ in list_checkpoints(ck)] == [3] and LOCK_NAME not in os.listdir(ck)
    # held by another process: rank 0 says so in one line, rank 1 leaves quietly, before any training
    lock = FolderLock.take(ck, log=QUIET)
    try:
        busy = hpctrain(job, "--set", f'parallel.mode="{mode}"', "--set", "train.steps=6", launcher=mpi)
    finally:
        lock.release()
    assert busy.returncode == 2, busy.stdout + busy.stderr
    lines = hpctrain_lines(busy.stderr)  # less the launcher's report of the exit status 2
    assert len(lines) == 1, busy.stderr
    assert lines[0].startswith(f"hpctrain: error [rank 0/2]: checkpoint.dir {ck} is in use by pid {os.getpid()}")
    assert [s for s, _ in list_checkpoints(ck)] == [3] and "step" not in busy.stdout


def test_the_lock_file_cannot_be_the_metrics_file(tmp_path, mesh):
    from hpctrain.errors import ConfigError

    make_classification(tmp_path / "d.h5", n=64)
    ck = tmp_path / "ck"
    with pytest.raises(ConfigError, match="train.metrics: .* is the lock file of checkpoint.dir"):
        Trainer(config(tmp_path / "d.h5", train={"metrics": str(ck / LOCK_NAME)}, checkpoint={"dir": str(ck)}),
                mesh=mesh, log=QUIET)
    assert not os.path.exists(ck)


@pytest.mark.parametrize("kind", ["symlink", "dangling symlink", "fifo"])
def test_a_lock_file_that_is_a_link_or_a_fifo_is_refused_and_nothing_is_written_through_it(tmp_path, mesh, kind):
    """A symbolic link named hpctrain.lock would have the run overwrite the file it points to."""
    make_classification(tmp_path / "d.h5", n=64)
    (tmp_path / "ck").mkdir()
    victim = tmp_path / "victim.txt"
    lock = tmp_path / "ck" / LOCK_NAME
    if kind == "fifo":
        os.mkfifo(lock)
    else:
        if kind == "symlink":
            victim.write_text("precious")
        os.symlink(victim, lock)
    with pytest.raises(CheckpointError, match="symbolic link|not a regular file"):
        Trainer(config(tmp_path / "d.h5", checkpoint={"dir": str(tmp_path / "ck")}), mesh=mesh, log=QUIET)
    if kind == "symlink":
        assert victim.read_text() == "precious"
    elif kind == "dangling symlink":
        assert not victim.exists()  # nothing was created at the link's target
