"""``hpctrain plan``: every rank's memory for a config and a world size, without starting ranks (hpctrain/plan.py).

    hpctrain plan jobs/configs/gpt-char.toml -n 4 --set parallel.zero=1
    hpctrain plan my.toml -n 8 --mem-per-rank 40GB      # exit status 1 when a rank does not fit
"""

from __future__ import annotations

__all__ = ["run_plan", "plan_device"]


def run_plan(args) -> int:
    from ..config import load_config
    from ..errors import ConfigError
    from ..plan import advice, parse_size, plan, plan_json, plan_table, size_text

    if args.ranks < 1:
        raise ConfigError(f"-n: must be at least 1, got {args.ranks}")
    limit = None
    if args.mem_per_rank is not None:
        try:
            limit = parse_size(args.mem_per_rank)
        except ValueError as e:
            raise ConfigError(f"--mem-per-rank: {e}") from None
    cfg = load_config(args.config, args.overrides)
    if cfg.parallel.mode != "sync":
        raise ConfigError(f'parallel.mode = "{cfg.parallel.mode}": hpctrain plan covers synchronous training only')
    device, cuda_aware = plan_device(cfg)
    ranks = plan(cfg, args.ranks, device=device, cuda_aware=cuda_aware)
    over = [m.rank for m in ranks if limit is not None and m.total_bytes > limit]
    if args.json:
        print(plan_json(ranks))
    else:
        print(plan_table(ranks, limit))
        if limit is not None and over:
            print(f"ranks {', '.join(map(str, over))} do not fit in {size_text(limit)} (largest "
                  f"{max(m.total_bytes for m in ranks) / 1e6:,.0f} MB)")
            fixes = advice(cfg, args.ranks, limit, device=device, cuda_aware=cuda_aware)
            print("each of these would fit:\n  " + "\n  ".join(fixes) if fixes else
                  "no single change of parallel.zero, train.recompute, model.attention, parallel.pp or "
                  "parallel.tp on "
                  f"{args.ranks} rank(s) fits; use more ranks or a smaller train.batch_size")
        elif limit is not None:
            print(f"every rank fits in {limit / 1e6:,.0f} MB")
    return 1 if over else 0


def plan_device(cfg) -> tuple[bool, bool]:
    """(on a GPU, its MPI takes device arrays) as training would resolve them here: ``backend = "auto"`` takes
    the GPU when there is one (not the simulator), ``parallel.cuda_aware = "auto"`` asks the MPI library."""
    from ..backend import picks_device

    if not picks_device(cfg.train.backend):
        return False, False
    ca = cfg.parallel.cuda_aware
    if ca != "auto":
        return True, bool(ca)
    from ..parallel.mesh import mpi_cuda_aware

    return True, mpi_cuda_aware()
