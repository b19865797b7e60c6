"""A failure on one rank ends the whole job with that rank's message, never a hang."""

import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from helpers import folder_listing, make_classification, toml_job
from launch import hpctrain_lines, launcher_env, launcher_kind, mpi_command, stop_signal  # the user's MPI settings pass, a running launcher's rank does not

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = shutil.which("mpiexec")

# rank 1 raises in its third step while rank 0 goes on into the gradient Allreduce
SCRIPT = """
import os
import sys
import time
from mpi4py import MPI
import hpctrain.train as train
from hpctrain.cli import main

original = train.Trainer.train_step
def failing(self, step, *args):
    if os.environ.get("FAIL_EVERYWHERE") and step == 2:  # every rank at once: the same bad file under all
        from hpctrain.errors import DataError
        raise DataError(f"the data went away (rank {MPI.COMM_WORLD.rank})")
    if MPI.COMM_WORLD.rank == 1 and step == 2:
        raise RuntimeError("disk on fire")
    return original(self, step, *args)
train.Trainer.train_step = failing
sys.exit(main(["train", *sys.argv[1:]]))
"""

CONFIG = toml_job(train={"steps": 50})


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install hpctrain[mpich])")
@pytest.mark.parametrize("saving", [False, True], ids=["no-save", "save-in-flight"])
def test_exception_on_one_rank_aborts_the_job(tmp_path, saving):
    """With a checkpoint written in the background at every step, the failing rank has one in flight: it must
    not wait to commit it in a collective the other rank (waiting in the gradient sync) never joins."""
    make_classification(tmp_path / "d.h5", n=64)
    (tmp_path / "c.toml").write_text(CONFIG)
    (tmp_path / "fail.py").write_text(SCRIPT)
    extra = ["--set", f"checkpoint.dir={tmp_path / 'ck'}", "--set", "checkpoint.every=1"] if saving else []
    proc = subprocess.run(mpi_command(MPIEXEC, 2, sys.executable, str(tmp_path / "fail.py"), str(tmp_path / "c.toml"),
                                      *extra),
                          cwd=ROOT, env=launcher_env({"PYTHONPATH": ROOT}), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "hpctrain: error [rank 1/2]: RuntimeError: disk on fire" in proc.stderr, proc.stderr


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install hpctrain[mpich])")
def test_an_error_every_rank_hits_at_once_is_one_line(tmp_path):
    """The lowest failing rank speaks first and its abort ends the others: one line, not one per rank."""
    make_classification(tmp_path / "d.h5", n=64)
    (tmp_path / "c.toml").write_text(CONFIG)
    (tmp_path / "fail.py").write_text(SCRIPT)
    proc = subprocess.run(mpi_command(MPIEXEC, 2, sys.executable, str(tmp_path / "fail.py"), str(tmp_path / "c.toml")),
                          cwd=ROOT, env=launcher_env({"PYTHONPATH": ROOT, "FAIL_EVERYWHERE": "1"}),
                          capture_output=True, text=True, timeout=120)
    lines = hpctrain_lines(proc.stderr)
    assert proc.returncode == 2 and lines[0] == "hpctrain: error [rank 0/2]: the data went away (rank 0)", proc.stderr
    # Hydra kills the other ranks at once; Open MPI's mpirun may take longer than the wait on a loaded machine
    assert len(lines) == 1 or (launcher_kind(MPIEXEC) == "openmpi" and len(lines) == 2), proc.stderr


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install hpctrain[mpich])")
def test_a_command_line_typo_under_mpiexec_prints_its_usage_once(tmp_path):
    proc = subprocess.run(mpi_command(MPIEXEC, 2, sys.executable, "-m", "hpctrain", "trian", "x.toml"), cwd=ROOT,
                          env=launcher_env({"PYTHONPATH": ROOT}), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("invalid choice: 'trian'") == 1, proc.stderr


# under pp = 2, stage 1 raises in a backward pass while stage 0 waits for its gradient (or in a forward
# pass while stage 0 waits for it to receive): the job ends with stage 1's rank named, never a hang
STAGE_FAILURE = """
import sys
from mpi4py import MPI
import hpctrain.parallel.executor as executor
from hpctrain.cli import main

where = sys.argv[2]
original = getattr(executor.StageExecutor, where)
calls = [0]
def failing(self, ins):
    calls[0] += 1
    if MPI.COMM_WORLD.rank == 1 and calls[0] == 7:
        raise RuntimeError(f"stage {self.stage} fell over in {where}")
    return original(self, ins)
setattr(executor.StageExecutor, where, failing)
sys.exit(main(["train", sys.argv[1], "--set", "parallel.pp=2", "--set", "train.micro_batches=4"]))
"""


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install hpctrain[mpich])")
@pytest.mark.parametrize("where", ["_forward", "_backward"])
def test_a_failing_pipeline_stage_ends_the_job_naming_its_rank(tmp_path, where):
    make_classification(tmp_path / "d.h5", n=64)
    (tmp_path / "c.toml").write_text(CONFIG)
    (tmp_path / "fail.py").write_text(STAGE_FAILURE)
    t0 = time.monotonic()
    proc = subprocess.run(mpi_command(MPIEXEC, 2, sys.executable, str(tmp_path / "fail.py"), str(tmp_path / "c.toml"),
                                      where), cwd=ROOT, env=launcher_env({"PYTHONPATH": ROOT}), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert f"hpctrain: error [rank 1/2]: RuntimeError: stage 1 fell over in {where}" in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 60


# rank 1 alone fails at one point of the set-up; the job must end at once, with rank 1's message
SETUP_FAILURE = """
import sys
from mpi4py import MPI
import hpctrain.train.loop as loop
import hpctrain.train.startup as startup
from hpctrain.cli import main
from hpctrain.errors import BackendError

where = sys.argv[2]
if MPI.COMM_WORLD.rank == 1:
    if where == "make_optimizer":  # a device out of memory while the optimizer slots are made
        def make_optimizer(*args, **kwargs):
            raise BackendError("zeros: out of GPU memory (simulated)")
        startup.make_optimizer = make_optimizer
    elif where == "load_start":  # a device out of memory while the broadcast start is copied in
        def asarray(self, host):
            raise BackendError("asarray: out of GPU memory (simulated)")
        original_build = startup.build
        def build(*args):
            parts = original_build(*args)
            parts.be = type("ShortOfMemory", (type(parts.be),), {"asarray": asarray})()
            return parts
        startup.build = build
    elif where == "grad_sync":  # a device out of memory for the staging buffers
        def grad_sync(*args, **kwargs):
            raise BackendError("pinned_host: out of memory (simulated)")
        loop.GradSync = grad_sync
    elif where == "backend":  # backend = "auto" picked another backend on this rank
        original = startup.build
        def build(*args):
            parts = original(*args)
            parts.be = type("OtherBackend", (type(parts.be),), {"name": "cuda"})()
            return parts
        startup.build = build
sys.exit(main(["train", sys.argv[1]]))
"""


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install hpctrain[mpich])")
@pytest.mark.parametrize("where, message", [
    ("make_optimizer", "hpctrain: error [rank 1/2]: zeros: out of GPU memory (simulated)"),
    ("load_start", "hpctrain: error [rank 1/2]: asarray: out of GPU memory (simulated)"),
    ("grad_sync", "hpctrain: error [rank 1/2]: pinned_host: out of memory (simulated)"),
    ("backend", "hpctrain: error [rank 0/2]: rank 1 has a different backend from rank 0: cuda here, cpu on rank 0"),
])
def test_a_set_up_failure_on_one_rank_ends_the_job_without_a_hang(tmp_path, where, message):
    make_classification(tmp_path / "d.h5", n=64)
    (tmp_path / "c.toml").write_text(CONFIG)
    (tmp_path / "fail.py").write_text(SETUP_FAILURE)
    proc = subprocess.run(mpi_command(MPIEXEC, 2, sys.executable, str(tmp_path / "fail.py"), str(tmp_path / "c.toml"),
                                      where), cwd=ROOT, env=launcher_env({"PYTHONPATH": ROOT}), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert message in proc.stderr, proc.stderr
    assert proc.stderr.count("hpctrain: error") == 1, proc.stderr
    assert "Traceback" not in proc.stderr


def test_mpi_functions_are_found_in_the_library_mpi4py_loaded():
    """mpi_cuda_aware's lookup sees the MPI library (it is loaded with local symbols)."""
    from hpctrain.parallel.mesh import mpi_cuda_aware, mpi_function

    assert mpi_function("MPI_Init") is not None
    assert mpi_function("MPI_No_such_function") is None
    assert mpi_cuda_aware() in (True, False)


# the child writes to its stdout pipe, then drains it; the parent reads only after a pause. The clock starts
# before "draining" is said, so the parent's pause is all inside what the child measures, however late
# either process runs on a loaded machine
DRAIN = """
import sys, time
from hpctrain.parallel.abort import drain_stdio
sys.stdout.write("x" * 4096)
t = time.monotonic()
print("draining", file=sys.stderr, flush=True)
drain_stdio(timeout=float(sys.argv[1]))
print(f"{time.monotonic() - t:.3f}", file=sys.stderr)
"""


@pytest.mark.parametrize("read_after, timeout", [(0.5, 30.0), (None, 0.5)])
def test_drain_stdio_waits_until_the_launcher_has_read_the_output(read_after, timeout):
    """Abort comes only once the pipe to the launcher is empty, or the deadline has passed. The bounds hold
    under any load: the child cannot see the pipe empty before the parent's read, which comes at least
    ``read_after`` after the clock started, and it gives up no earlier than its deadline."""
    proc = subprocess.Popen([sys.executable, "-c", DRAIN, str(timeout)], cwd=ROOT, env=launcher_env({"PYTHONPATH": ROOT}),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr.readline() == "draining\n"
    if read_after is not None:
        time.sleep(read_after)
        assert len(proc.stdout.read(4096)) == 4096
    proc.wait(timeout=60)
    waited = float(proc.stderr.read())
    if read_after is not None:
        assert read_after <= waited < timeout  # waited for the reader, not for the deadline
    else:
        assert timeout <= waited < 20  # nobody read: it gave up at its deadline instead of waiting on


# SIGTERM (what Slurm sends before the time limit) while the job starts, or twice: once to stop, once more
# while the stop checkpoint is being written; each is recorded, never fatal
SIGNAL_SCRIPT = """
import os
import signal
import sys
import hpctrain.checkpoint as ckpt
import hpctrain.train.startup as startup
import hpctrain.train as train
from hpctrain.cli import main

when = sys.argv[2]
if when == "start-up":
    build = startup.build
    def build_then_signal(*args):
        parts = build(*args)
        os.kill(os.getpid(), signal.SIGTERM)
        return parts
    startup.build = build_then_signal
else:
    step = train.Trainer.train_step
    def step_then_signal(self, s, lr):
        out = step(self, s, lr)
        if s == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        return out
    train.Trainer.train_step = step_then_signal
    save = ckpt.save_checkpoint
    def save_under_fire(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # the second signal, mid-checkpoint
        return save(*args, **kwargs)
    ckpt.save_checkpoint = save_under_fire
sys.exit(main(["train", sys.argv[1]]))
"""


ONE_RANK_SIGNAL = """
import os, signal, sys
from mpi4py import MPI
import hpctrain.train as train
from hpctrain.cli import main

step = train.Trainer.train_step
def step_then_signal(self, s, lr):
    out = step(self, s, lr)
    if s == 2 and MPI.COMM_WORLD.rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
    return out
train.Trainer.train_step = step_then_signal
sys.exit(main(["train", sys.argv[1]]))
"""


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install hpctrain[mpich])")
def test_a_signal_to_one_rank_is_named_with_that_rank_in_rank_0s_log(tmp_path):
    make_classification(tmp_path / "d.h5", n=64)
    (tmp_path / "job.toml").write_text(toml_job(train={"steps": 50}, checkpoint={"dir": "ck"}))
    proc = subprocess.run(mpi_command(MPIEXEC, 2, sys.executable, "-c", ONE_RANK_SIGNAL, str(tmp_path / "job.toml")),
                          cwd=ROOT, env=launcher_env({"PYTHONPATH": ROOT}), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "signal SIGUSR1 (on rank 1) received: stopping at step 3" in proc.stdout, proc.stdout


@pytest.mark.parametrize("when", ["start-up", "twice"])
def test_signals_are_recorded_from_start_up_to_the_stop_checkpoint(tmp_path, when):
    make_classification(tmp_path / "d.h5", n=64)
    (tmp_path / "job.toml").write_text(toml_job(train={"steps": 50}, checkpoint={"dir": "ck"}))
    env = launcher_env({"PYTHONPATH": ROOT})
    proc = subprocess.run([sys.executable, "-c", SIGNAL_SCRIPT, str(tmp_path / "job.toml"), when], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    step = 0 if when == "start-up" else 3
    assert f"stopping at step {step}" in proc.stdout
    assert folder_listing(tmp_path / "ck") == [f"ckpt-{step:08d}.h5", f"ckpt-{step:08d}.shards"]


PS_SCRIPT = """
import sys
from mpi4py import MPI
import hpctrain.train.async_ps as ps
from hpctrain.cli import main

role = sys.argv[2]
if role == "worker":
    original = ps.AsyncTrainer._work
    def failing(self):
        if MPI.COMM_WORLD.rank == 2:
            raise RuntimeError("worker on fire")
        return original(self)
    ps.AsyncTrainer._work = failing
elif role == "server":
    original = ps.AsyncTrainer._serve
    def failing(self, metrics):
        raise RuntimeError("server on fire")
    ps.AsyncTrainer._serve = failing
else:  # the first server cannot allocate its message buffers
    original = ps.Server.__init__
    def failing(self, **kwargs):
        if MPI.COMM_WORLD.rank == 0:
            raise MemoryError()
        original(self, **kwargs)
    ps.Server.__init__ = failing
sys.exit(main(["train", sys.argv[1]]))
"""


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install hpctrain[mpich])")
@pytest.mark.parametrize("role, rank", [("worker", 2), ("server", 0)])
def test_a_failing_parameter_server_rank_ends_the_job_naming_it(tmp_path, role, rank):
    make_classification(tmp_path / "d.h5", n=64)
    (tmp_path / "job.toml").write_text(toml_job(train={"steps": 50}, parallel={"mode": "async_ps", "staleness": 1}))
    env = launcher_env({"PYTHONPATH": ROOT})
    t0 = time.monotonic()
    proc = subprocess.run(mpi_command(MPIEXEC, 3, sys.executable, "-c", PS_SCRIPT, str(tmp_path / "job.toml"), role),
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and time.monotonic() - t0 < 60
    assert f"[rank {rank}/3]" in proc.stderr and f"{role} on fire" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install hpctrain[mpich])")
def test_a_parameter_server_out_of_memory_is_one_line_before_training(tmp_path):
    make_classification(tmp_path / "d.h5", n=64)
    (tmp_path / "job.toml").write_text(toml_job(train={"steps": 50}, parallel={"mode": "async_ps", "staleness": 1}))
    env = launcher_env({"PYTHONPATH": ROOT})
    proc = subprocess.run(mpi_command(MPIEXEC, 3, sys.executable, "-c", PS_SCRIPT, str(tmp_path / "job.toml"), "oom"),
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = hpctrain_lines(proc.stderr)  # less the launcher's report of the exit status 2
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("hpctrain: error [rank 0/3]: parameter server 0 is out of memory for its 83 parameters")
    assert "use more servers (parallel.servers)" in lines[0] and "update" not in proc.stdout


def test_bad_parameter_server_layouts_are_one_line(tmp_path):
    from helpers import config

    from hpctrain.errors import ConfigError

    for sections, message in (({"parallel": {"mode": "async_ps", "staleness": -1}}, "parallel.staleness: must be >= 0"),
                              ({"parallel": {"mode": "async_ps", "pp": 2}}, 'mode = "async_ps" with pp = 2 is not supp'),
                              ({"parallel": {"mode": "async_ps", "tp": 2}}, 'mode = "async_ps" with tp = 2 is not supp'),
                              ({"parallel": {"servers": 0}}, "parallel.servers: must be >= 1")):
        with pytest.raises(ConfigError, match=message):
            config("x.h5", **sections)
    make_classification(tmp_path / "d.h5", n=64)
    (tmp_path / "job.toml").write_text(toml_job(parallel={"mode": "async_ps", "servers": 1}))
    r = subprocess.run([sys.executable, "-m", "hpctrain", "train", str(tmp_path / "job.toml")], cwd=ROOT,
                       env=launcher_env({"PYTHONPATH": ROOT}), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "parallel.servers = 1 leaves no worker in a world of 1 rank(s)" in r.stderr


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install hpctrain[mpich])")
def test_the_stop_signal_stops_a_parameter_server_job_with_a_checkpoint(tmp_path):
    """The launcher's stop signal (SIGTERM to mpiexec, SIGUSR1 to Open MPI's mpirun: docs/reliability.md): the
    servers answer every pull with stop, the workers finish, a checkpoint, exit 0."""
    make_classification(tmp_path / "d.h5", n=64)
    (tmp_path / "job.toml").write_text(toml_job(train={"steps": 10_000_000, "log_every": 10_000_000},
                                                parallel={"mode": "async_ps", "staleness": 1},
                                                checkpoint={"dir": "ck"}))
    env = launcher_env({"PYTHONPATH": ROOT})
    proc = subprocess.Popen(mpi_command(MPIEXEC, 3, sys.executable, "-m", "hpctrain", "train", str(tmp_path / "job.toml")),
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = proc.stdout.readline()  # the start-up line: every rank is past start-up
        assert "parameter server" in first, first
        time.sleep(1.0)
        proc.send_signal(stop_signal(launcher_kind(MPIEXEC)))
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, first + out
    assert "parameter server done" in out and re.search(r"signal SIG(TERM|USR1) received: stopping at step \d+", out)
    (index,) = [n for n in os.listdir(tmp_path / "ck") if n.endswith(".h5")]  # one checkpoint: an index and its
    assert folder_listing(tmp_path / "ck") == [index, index[:-3] + ".shards"]  # servers' shards
