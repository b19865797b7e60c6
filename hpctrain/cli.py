"""Command line: ``hpctrain train CONFIG.toml [--set section.key=value ...]``.

    hpctrain train jobs/configs/digits.toml
    mpiexec -n 2 hpctrain train jobs/configs/digits.toml --set train.steps=100
    python -m hpctrain train jobs/configs/digits.toml

Errors a user can cause print one line, ``hpctrain: error: ...`` (with the
rank under MPI), and exit with status 2; so does a host allocation that fails
(a model too large for the machine), which aborts the whole job because it may
happen on one rank only (Linux may instead grant the memory and kill the
process later, which no Python code can report). Any other exception on any rank prints that rank's
traceback and aborts the whole job (``COMM_WORLD.Abort``), so ``mpirun`` never
hangs on a rank that died.
"""

from __future__ import annotations

import argparse
import sys
import traceback

from .errors import HpctrainError

__all__ = ["main"]


def _parser():
    p = argparse.ArgumentParser(prog="hpctrain", description="MPI-based training with Numba kernels.")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a model from a TOML config")
    t.add_argument("config", help="path to the TOML config")
    t.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value (a TOML value; anything else is taken as a string)")
    i = sub.add_parser("inspect", help="describe a checkpoint and verify its checksums")
    i.add_argument("path")
    return p


def _train(args) -> int:
    from mpi4py import MPI

    from .config import load_config
    from .parallel.agree import run_everywhere
    from .parallel.mesh import Mesh, resolve_layout
    from .train import Trainer

    cfg = run_everywhere(MPI.COMM_WORLD, lambda: load_config(args.config, args.overrides))
    p = cfg.parallel
    run_everywhere(MPI.COMM_WORLD, lambda: resolve_layout(MPI.COMM_WORLD.Get_size(), p.dp, p.pp, p.tp))
    mesh = Mesh(dp=p.dp, pp=p.pp, tp=p.tp)
    trainer = Trainer(cfg, mesh=mesh)
    try:
        trainer.run()
    finally:
        trainer.close()
    mesh.free()  # collective: only on the way out of a run every rank finished
    return 0


def _inspect(args) -> int:
    from .checkpoint import inspect

    report, ok = inspect(args.path)
    print(report)
    return 0 if ok else 1


def _where() -> str:
    try:
        from mpi4py import MPI

        if MPI.Is_initialized() and MPI.COMM_WORLD.Get_size() > 1:
            return f" [rank {MPI.COMM_WORLD.Get_rank()}/{MPI.COMM_WORLD.Get_size()}]"
    except ImportError:
        pass
    return ""


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from .parallel.abort import abort_world
    from .parallel.agree import QuietExit

    try:
        return _train(args) if args.command == "train" else _inspect(args)
    except QuietExit:
        return 2  # another rank printed the error; every rank leaves together
    except HpctrainError as e:
        print(f"hpctrain: error{_where()}: {e}", file=sys.stderr)
        if not getattr(e, "collective", False):
            abort_world(2)
        return 2
    except KeyboardInterrupt:
        print(f"hpctrain: interrupted{_where()}", file=sys.stderr)
        abort_world(130)
        return 130
    except MemoryError as e:  # e.g. parameter buffers too large: the user's config, not a bug
        print(f"hpctrain: error{_where()}: out of memory: {e or 'MemoryError'} (lower the model width or "
              "train.batch_size, or use more ranks)", file=sys.stderr)
        abort_world(2)  # this rank alone may have failed, and the others wait for it in a collective
        return 2
    except Exception as e:  # a bug, or a failure on this rank only: never leave the other ranks waiting
        traceback.print_exc()
        print(f"hpctrain: error{_where()}: {type(e).__name__}: {e}", file=sys.stderr)
        abort_world(1)
        return 1
