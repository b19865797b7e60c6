"""Command line: ``hpctrain train | eval | predict | config | env | plan | inspect | sample | data | plot | export``,
``hpctrain --version``.

    hpctrain train jobs/configs/digits.toml
    mpiexec -n 2 hpctrain train jobs/configs/digits.toml --set train.steps=100
    python -m hpctrain train jobs/configs/digits.toml
    hpctrain inspect runs/digits/ckpt-00000300.h5
    hpctrain eval runs/digits/ckpt-00000600.h5 --data test.h5      # loss and accuracy on any file
    hpctrain predict runs/digits/ckpt-00000600.h5 --data new.h5 --out p.h5   # outputs and classes
    hpctrain sample runs/gpt-char/ckpt-00001500.h5 --prompt "The " --tokens 300
    hpctrain data text2h5 INPUT.txt OUT.h5
    hpctrain data csv2h5 | npz2h5 | bin2h5 INPUT OUT.h5 ...   (your own tables, nanoGPT's .bin)
    hpctrain config jobs/configs/gpt-char.toml --set parallel.tp=2   # the resolved config, every default
    hpctrain env                                                    # versions, MPI, GPUs, BLAS threads
    hpctrain plan jobs/configs/gpt-char.toml -n 4 --mem-per-rank 2GB  # every rank's memory, before a job
    hpctrain plot runs/digits/metrics.jsonl -o loss.png             # needs matplotlib (hpctrain[plot])

Errors a user can cause print one line, ``hpctrain: error: ...`` (with the
rank under MPI), and exit with status 2; so does a host allocation that fails
(a model too large for the machine), which aborts the whole job because it may
happen on one rank only (Linux may instead grant the memory and kill the
process later, which no Python code can report). Any other exception on any rank prints that rank's
traceback and aborts the whole job (``COMM_WORLD.Abort``), so ``mpirun`` never
hangs on a rank that died.

The parser and what each subcommand does live in hpctrain/commands/ (a module per family); this module parses,
runs the command and turns its errors into one line and an exit status.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import traceback

from .commands.jobs import NoMPIError
from .commands.parser import parser as _parser
from .errors import HpctrainError

__all__ = ["main"]

# subcommand: (its module in hpctrain/commands/, the function that runs it), imported only to run it
COMMANDS = {"train": ("jobs", "run_train"), "eval": ("jobs", "run_eval"), "plan": ("plan", "run_plan"),
            "data": ("data", "run_data"), "inspect": ("tools", "run_inspect"), "export": ("tools", "run_export"),
            "sample": ("tools", "run_sample"), "predict": ("tools", "run_predict"), "plot": ("tools", "run_plot"),
            "config": ("tools", "run_config"), "env": ("tools", "run_env")}


def _run_command(args) -> int:
    module, function = COMMANDS[args.command]
    return getattr(importlib.import_module(f".commands.{module}", __package__), function)(args)


def _say(line: str) -> None:
    """One line to stderr in one write: print() writes the text and the newline apart, and two ranks'
    lines can then arrive glued together (unbuffered stderr, one launcher reading both)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _where() -> str:
    from .parallel.abort import started_mpi

    MPI = started_mpi()  # never started: no ranks to name (and starting it now could wait for ranks gone)
    if MPI is not None and MPI.COMM_WORLD.Get_size() > 1:
        return f" [rank {MPI.COMM_WORLD.Get_rank()}/{MPI.COMM_WORLD.Get_size()}]"
    return ""


def _after_lower_ranks() -> None:
    """On a rank above 0: a moment's wait (1 s on rank 1, 0.02 s more on each later one, 2 s at most; Open MPI's
    mpirun takes longer than 0.1 s to end the other ranks after an abort) before its error
    line. When several ranks hit the same error at once (a data file truncated under the job, the same bug), the
    lowest of them prints first and its abort ends the others before they print: the job says it once. A rank
    failing alone says it that much later."""
    from .parallel.abort import started_mpi

    MPI = started_mpi()  # never started: no abort follows, nothing to wait for
    if MPI is not None and MPI.COMM_WORLD.Get_size() > 1:
        rank = MPI.COMM_WORLD.Get_rank()
        if rank > 0:
            time.sleep(min(2.0, 1.0 + 0.02 * rank))


# commands that run in one process and never start MPI: under ``mpiexec -n N`` every rank runs them (srun's tasks
# may convert a file each, so no rank skips the work), and an error says so: N ranks writing one file find it
# there and refuse it without --force
ONE_PROCESS = ("export", "predict", "data", "plot", "sample", "inspect", "config")


def _launcher_size(environ=os.environ) -> int:
    """How many processes this one's launcher started (read before MPI starts); 1 when not launched."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS"):
        if environ.get(var, "").isdigit():
            return int(environ[var])
    return 1


def _one_process_hint(command: str) -> str:
    """For an error of a one-process command started as several: what happened (else "")."""
    n = _launcher_size()
    if command not in ONE_PROCESS or n <= 1:
        return ""
    return f" (hpctrain {command} runs in one process; the launcher started {n}, and each ran it)"


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "train":  # the stop signals are recorded from here on, if not already (commands/jobs.py)
        from .train.stop import early

        args.stop = early()
    from .parallel.abort import abort_world
    from .parallel.agree import QuietExit

    try:
        from .layer_kinds import load_plugins, plugins_from_env

        load_plugins([*plugins_from_env(), *args.plugins])  # on every rank, before any config is read
        return _run_command(args)
    except QuietExit:
        return 2  # another rank printed the error; every rank leaves together
    except NoMPIError as e:
        _say(f"hpctrain: error: {e}")
        return 2
    except HpctrainError as e:
        if getattr(e, "collective", False):  # every rank agreed on it: this one alone says it
            _say(f"hpctrain: error{_where()}: {e}{_one_process_hint(args.command)}")
            return 2
        _after_lower_ranks()
        _say(f"hpctrain: error{_where()}: {e}{_one_process_hint(args.command)}")
        abort_world(2)
        return 2
    except KeyboardInterrupt:
        _say(f"hpctrain: interrupted{_where()}")
        abort_world(130)
        return 130
    except MemoryError as e:  # e.g. parameter buffers too large: the user's config, not a bug
        _after_lower_ranks()
        _say(f"hpctrain: error{_where()}: out of memory: {e or 'MemoryError'} (lower the model width or "
             "train.batch_size, or use more ranks)")
        abort_world(2)  # this rank alone may have failed, and the others wait for it in a collective
        return 2
    except Exception as e:  # a bug, or a failure on this rank only: never leave the other ranks waiting
        _after_lower_ranks()
        traceback.print_exc()
        _say(f"hpctrain: error{_where()}: {type(e).__name__}: {e}")
        abort_world(1)
        return 1
