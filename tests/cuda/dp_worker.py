"""Run by test_cuda_data_parallel.py under ``mpiexec -n 2``: data parallel, a 2-stage pipeline, a GPT
pipeline (its tied embedding summed across the stages) or tensor parallelism on the CUDA backend vs the CPU
backend.

    NUMBA_ENABLE_CUDASIM=1 mpiexec -n 2 python tests/cuda/dp_worker.py DATA.h5 [dp|pp|gpt-pp|il|tp|gpt-tp|zero|zero-release|gpt-det|memory|waits-*|arena-*]

Under ``pp`` activations and gradients between the stages take the same host-staged path, as do the tied
gradient (``gpt-pp``, under the zero-bubble schedule: each block's split backward on the device) and the
tensor-parallel Allreduces (``tp``; ``gpt-tp`` adds the GPT's vocab-parallel embedding, head and loss);
``il`` is an MLP at pp 2 under interleaved 1F1B (two chunks a stage, boundaries of three widths);
``zero`` is data parallel with ``parallel.zero = 2``: device gradients reduce-scattered through host staging,
the parameters all-gathered; ``gpt-det`` is ``train.deterministic``: dp 2 bitwise equal to one process on the
device.

Gradients go through the non-CUDA-aware path (pinned host staging, several buckets,
overlapped Iallreduce), which is the only one the simulator may take: simulated
device arrays have no device pointer to hand to MPI. Exits 1 on any mismatch.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]  # tests/ for helpers.py
sys.setswitchinterval(5e-5)  # see conftest.py

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from helpers import config, gpt_config, make_classification, make_tokens  # noqa: E402
from hpctrain.parallel.mesh import Mesh  # noqa: E402
from hpctrain.train import Trainer  # noqa: E402


def full_params(trainer):
    """Every rank gets the gathered full parameters (rank 0 gathers them from the stages)."""
    gathered = trainer.state_dict()
    flat = trainer.model.layout.pack(gathered[0] if gathered else None)
    trainer.mesh.world.Bcast(flat, root=0)
    return {k: np.array(v) for k, v in trainer.model.layout.unpack(flat).items()}


def deterministic(path):
    """``gpt-det``: train.deterministic on the device: dp 2 gives the bits of one process alone (the tree's
    host-staged recursive doubling, the device's add and copy, the tied head's local replica)."""
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        make_tokens(path, n=300)
    comm.Barrier()
    cfg = gpt_config(path, model={"block_size": 4, "n_embd": 4}, data={"val_fraction": 0.0},
                     train={"steps": 2, "batch_size": 2, "backend": "cuda", "deterministic": True,
                            "deterministic_shards": 2, "grad_clip": 0.5},
                     optim={"name": "adamw", "lr": 0.01}, parallel={"bucket_mb": 0.0002, "cuda_aware": False})
    got = []
    for world in (comm, MPI.COMM_SELF):
        mesh = Mesh(comm=world)
        trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
        trainer.run()
        got.append(np.concatenate([v.ravel() for v in full_params(trainer).values()]))
        trainer.close()
        mesh.free()
    ok = np.array_equal(got[0], got[1])
    print(f"rank {comm.rank}: deterministic dp 2 against one process: {'OK' if ok else 'MISMATCH'}", flush=True)
    return 0 if ok else 1


def memory(path):
    """``memory``: what the run says its buffers hold (train/memory.py) equals ``hpctrain plan``'s buffers for a
    GPU without CUDA-aware MPI, at dp 2 (the gradients staged through pinned host memory) and at dp 1 (nothing
    staged: no MPI to hand them to)."""
    from hpctrain.plan import plan
    from hpctrain.train.memory import rank_memory

    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        make_tokens(path, n=300)
    comm.Barrier()
    cfg = gpt_config(path, model={"block_size": 4, "n_embd": 4}, data={"val_fraction": 0.0},
                     train={"steps": 1, "batch_size": 2, "backend": "cuda"},
                     parallel={"bucket_mb": 0.0002, "cuda_aware": False})
    ok, said = True, []
    for world in (comm, MPI.COMM_SELF):
        mesh = Mesh(comm=world)
        trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
        trainer.run()
        got = rank_memory(trainer, 0).buffer_bytes
        want = plan(cfg, world.size, device=True, cuda_aware=False)[world.rank].buffer_bytes
        staged = 4 * trainer.part.layout.size if world.size > 1 else 0
        ok &= got == want and got >= staged and (trainer.sync.host is None) == (world.size == 1)
        said.append(f"dp {world.size}: buffers {got} B, planned {want} B")
        trainer.close()
        mesh.free()
    print(f"rank {comm.rank}: {'; '.join(said)} {'OK' if ok else 'MISMATCH'}", flush=True)
    return 0 if ok else 1


def waits(path, layout):
    """``waits-*``: the training thread's waits for the whole device stream in one step (``backend.host_waits``),
    against what each layout must wait for:

    * ``waits-dp``: a GPT at dp 2, two micro-batches, a dozen gradient buckets: 0, the step's loss and gradient
      norm being read after it, a wait for a mark (train/step.py: a step's values read a step late; the
      communication thread waits for each bucket's event instead: ``background_waits``);
    * ``waits-pp``: an MLP at pp 2 under 1F1B, four micro-batches: 1 (sends are posted by a sender thread,
      received activations and gradients are uploaded in order on the stream; a recycled receive buffer may
      wait for an earlier mark, ``mark_waits``, with later work still queued);
    * ``waits-gpt-pp``: the GPT at pp 2: 1, plus 2 for its tied embedding (the gradient summed over the two ends
      before the norm, the updated values sent to the replica after the optimizer);
    * ``waits-tp``: the GPT at tp 2: 1, plus 1 per tensor-parallel Allreduce (the next kernel needs its sum) and
      2 per micro-batch for the vocab-parallel loss's row statistics, which are reduced on the host;
    * ``waits-zero``: the GPT at dp 2 with ``parallel.zero = 2``: 1 (the communication thread reduce-scatters and
      all-gathers each bucket after its event, the training stream waits for the copies back on the device);
    * ``waits-det``: the GPT at dp 2 with ``train.deterministic`` (4 shards): 1 (the thread stages each bucket
      and adds the tree's partial sums on the host).
    """
    comm = MPI.COMM_WORLD
    gpt = layout != "waits-pp"
    if comm.rank == 0:
        make_tokens(path, n=300) if gpt else make_classification(path, n=32)
    comm.Barrier()
    pp, tp = (2, 1) if layout.endswith("-pp") else (1, 2) if layout == "waits-tp" else (1, 1)
    m = 4 if pp > 1 else 2
    parallel = {"bucket_mb": 0.0002, "overlap": True, "cuda_aware": False, "pp": pp, "tp": tp,
                "zero": 2 if layout == "waits-zero" else 0}
    train = {"steps": 2, "micro_batches": m, "backend": "cuda", "grad_clip": 0.5}
    if layout == "waits-det":
        train = {**train, "deterministic": True, "deterministic_shards": 4}
    if gpt:
        cfg = gpt_config(path, model={"block_size": 4, "n_embd": 4}, data={"val_fraction": 0.0},
                         train={**train, "batch_size": 4}, parallel=parallel)
    else:
        cfg = config(path, train={**train, "batch_size": 8}, parallel=parallel)
    mesh = Mesh(pp=pp, tp=tp)
    trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    be = trainer.be
    tp_calls = []
    if trainer.part.tp is not None:  # count the step's tensor-parallel Allreduces
        plain = trainer.part.tp.allreduce_
        trainer.part.tp.allreduce_ = lambda arr: (tp_calls.append(1), plain(arr))
    trainer.train_step(0, 0.01)  # the first step allocates and compiles
    tp_calls.clear()
    before, marks, background = be.host_waits, be.mark_waits, be.background_waits
    trainer.train_step(1, 0.01)
    n, marks, staged = be.host_waits - before, be.mark_waits - marks, be.background_waits - background
    trainer.close()
    mesh.free()
    deferred = trainer.runner.defer  # waits-dp: its read is a wait for a mark made after the step
    expected = (0 if deferred else 1) + (2 if layout == "waits-gpt-pp" else 0) + (len(tp_calls) + 2 * m if tp > 1
                                                                                 else 0)
    ok = (n == expected and (layout not in ("waits-dp", "waits-zero", "waits-det") or staged > 2)
          and deferred == (layout == "waits-dp") and (not deferred or marks >= 1))
    print(f"rank {comm.rank}: {layout}: {n} waits for the stream (expected {expected}), {marks} for a mark, "
          f"{staged} on other threads {'OK' if ok else 'MISMATCH'}", flush=True)
    return 0 if ok else 1


def zero_release(path):
    """``zero-release`` (a GPU only: CUDA's virtual memory management): zero = 2 at dp 2 on an MLP of 8.5 M
    parameters, big enough for its buckets and chunks to be cut on 2 MiB units (parallel/zero.py): the units
    outside each rank's chunks give their device memory back once reduced (backend/cuda/vmm.py) and take it again
    for the next backward. The parameters equal the CPU backend's, the same on both ranks, and the gradient
    buffer held at the end of a step is this rank's chunks, the pool and the units the cuts share."""
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        make_classification(path, n=32, features=64)
    comm.Barrier()
    layers = [{"type": "linear", "in": 64, "out": 2048}, {"type": "tanh"}, {"type": "linear", "in": 2048, "out": 2048},
              {"type": "tanh"}, {"type": "linear", "in": 2048, "out": 2048}, {"type": "tanh"},
              {"type": "linear", "in": 2048, "out": 10}]
    out = {}
    for backend in ("cuda", "cpu"):
        # SGD: the update is linear in the gradient, so the backends' float32 rounding stays at its own size
        # (Adam's step divides by sqrt(v) and turns a near-zero gradient's rounding into a whole lr)
        cfg = config(path, model={"layers": layers}, train={"steps": 3, "batch_size": 8, "backend": backend},
                     optim={"name": "sgd", "lr": 0.01, "momentum": 0.9},
                     parallel={"bucket_mb": 8, "overlap": True, "cuda_aware": False, "zero": 2})
        mesh = Mesh()
        trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
        trainer.run()
        out[backend] = trainer.params.to_host_dict()
        if backend == "cuda":
            mem, size = trainer.grad_memory, trainer.params.layout.size
            if mem is None or trainer.be.release_unsupported:
                raise SystemExit(f"zero-release: no releasable device buffer ({trainer.be.release_unsupported})")
            held, full = mem.mapped_bytes, 4 * size
            chunk = 4 * trainer.shard.size
            print(f"rank {comm.rank}: gradient memory held {held / 2**20:.1f} MiB of {full / 2**20:.1f} "
                  f"(chunks {chunk / 2**20:.1f}, pool {mem.pooled_bytes / 2**20:.1f}, released this step "
                  f"{trainer.sync.released_bytes / 2**20:.1f}, most live {mem.peak_live_bytes / 2**20:.1f})", flush=True)
            ok_memory = trainer.sync.released_bytes > 0 and held <= chunk + mem.pooled_bytes + 4 * len(
                trainer.shard.buckets) * mem.unit + mem.unit
        trainer.close()
        mesh.free()
    worst = max(float(np.max(np.abs(out["cuda"][k] - out["cpu"][k]) / (np.abs(out["cpu"][k]) + 1e-3)))
                for k in out["cpu"])
    same = all(np.allclose(out["cuda"][k], out["cpu"][k], rtol=1e-4, atol=1e-5) for k in out["cpu"])
    gathered = comm.allgather(np.concatenate([v.ravel() for v in out["cuda"].values()]))
    ranks_agree = all(np.array_equal(gathered[0], g) for g in gathered)
    ok = ok_memory and same and ranks_agree
    print(f"rank {comm.rank}: zero-release memory {'ok' if ok_memory else 'NOT WITHIN BOUND'}, against the CPU "
          f"{'ok' if same else 'DIFFERENT'} (largest relative difference {worst:.2e}), ranks "
          f"{'agree' if ranks_agree else 'DIFFER'}: {'OK' if ok else 'MISMATCH'}", flush=True)
    return 0 if ok else 1


ARENA_LAYOUTS = {"dp": {}, "pp-1f1b": {"pp": 2}, "pp-zero-bubble": {"pp": 2, "schedule": "zero-bubble"},
                 "tp": {"tp": 2}, "zero2": {"zero": 2}}


def arena(path, layout):
    """``arena-<name>`` (ARENA_LAYOUTS): the step arena (hpctrain/backend/arena.py) and the step's graphs
    (backend/cuda/graphs.py) on two ranks: by the fourth step no array is allocated in a step (a pipeline's first
    step also makes its receive buffers, kept for good, so its second step leaves that plan and the third records
    again); by the sixth every kernel runs in a replayed segment (none launched from Python); and the weights
    equal those of the same run with neither the arena nor graphs, bit for bit (the arena alone against none:
    tests/cuda/test_cuda_arena.py)."""
    comm = MPI.COMM_WORLD
    name = layout[len("arena-"):]
    if comm.rank == 0:
        make_classification(path, n=32)
    comm.Barrier()
    parallel = {"bucket_mb": 0.0002, "overlap": True, "cuda_aware": False, **ARENA_LAYOUTS[name]}
    pp, tp = parallel.get("pp", 1), parallel.get("tp", 1)
    weights, allocs, launches, replays, reasons = {}, {}, {}, {}, []
    for run, cuda in (("graphs", {"arena": True, "graphs": True}), ("plain", {"arena": False, "graphs": False})):
        cfg = config(path, train={"steps": 6, "batch_size": 8, "backend": "cuda", "micro_batches": 2 * pp,
                                  "grad_clip": 0.5},
                     optim={"name": "adamw", "lr": 0.01}, parallel=parallel, cuda=cuda)
        mesh = Mesh(pp=pp, tp=tp)
        trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
        out = [trainer.train_step(step, 0.01) for step in range(6)]
        allocs[run] = [o["device_allocs"] for o in out]
        launches[run] = [o["python_launches"] for o in out]
        replays[run] = [o.get("graph_launches", 0) for o in out]
        weights[run] = np.concatenate([v.ravel() for v in full_params(trainer).values()])
        be = trainer.be
        reasons += [f"{run}: {why}" for why in (be.arena.reason if be.arena is not None else "",
                                                 be.graphs.off or be.graphs.reason if be.graphs is not None else "")
                    if why]
        trainer.close()
        mesh.free()
    same = np.array_equal(weights["graphs"], weights["plain"])
    ok = (same and allocs["graphs"][-1] == 0 and min(allocs["plain"]) > 0 and launches["graphs"][-1] == 0
          and replays["graphs"][-1] > 0 and min(launches["plain"]) > 0)
    print(f"rank {comm.rank}: {layout}: arrays allocated a step {allocs['graphs']} (without the arena "
          f"{allocs['plain']}), kernels launched from Python {launches['graphs']} with graphs, segments replayed "
          f"{replays['graphs']}{'; ' + '; '.join(reasons) if reasons else ''}; the same bits: {same} "
          f"{'OK' if ok else 'MISMATCH'}", flush=True)
    return 0 if ok else 1


def main(path, layout):
    if MPI.COMM_WORLD.size != 2:  # mpiexec from one MPI library, mpi4py loading another: singletons, not a world of 2
        raise SystemExit(f"dp_worker: world size {MPI.COMM_WORLD.size}, expected 2 ({MPI.Get_library_version()[:40]!r}"
                         " - do mpiexec and mpi4py's libmpi come from the same MPI?)")
    if layout == "gpt-det":
        return deterministic(path)
    if layout == "memory":
        return memory(path)
    if layout == "zero-release":
        return zero_release(path)
    if layout.startswith("waits-"):
        return waits(path, layout)
    if layout.startswith("arena-"):
        return arena(path, layout)
    comm = MPI.COMM_WORLD
    pp = 2 if layout in ("pp", "gpt-pp", "il") else 1
    tp = 2 if layout in ("tp", "gpt-tp") else 1
    gpt = layout.startswith("gpt")
    if comm.rank == 0:
        make_tokens(path, n=300) if gpt else make_classification(path, n=32)
    comm.Barrier()
    results = {}
    for backend in ("cuda", "cpu"):
        parallel = {"bucket_mb": 0.0002, "overlap": True, "cuda_aware": False, "pp": pp, "tp": tp,
                    "zero": 2 if layout == "zero" else 0,
                    "schedule": "zero-bubble" if layout == "gpt-pp" else "1f1b"}  # the MLP's pp runs 1F1B
        if layout == "il":  # interleaved 1F1B, two chunks a stage, boundaries 8, 12 and 5 wide: ring slots as wide
            parallel.update(schedule="interleaved-1f1b", virtual_stages=2)  # as the widest, narrower ones reshaped
        if gpt:  # gpt-tp: the vocab-parallel embedding, head and loss, 13 ids in blocks of 7 and 6
            model = {"block_size": 4, "n_embd": 4, **({"vocab_size": 13} if tp > 1 else {})}
            cfg = gpt_config(path, model=model, data={"val_fraction": 0.0},
                             train={"steps": 2, "batch_size": 2, "micro_batches": 2, "backend": backend},
                             optim={"name": "sgd", "lr": 0.1, "momentum": 0.9}, parallel=parallel)
        else:
            layers = {}
            if layout == "il":
                widths = [6, 8, 12, 5, 3]
                layers = {"model": {"layers": [item for i, (a, b) in enumerate(zip(widths, widths[1:]))
                                               for item in [{"type": "linear", "in": a, "out": b}]
                                               + ([{"type": "tanh"}] if i < 3 else [])]}}
            cfg = config(path, train={"steps": 2, "batch_size": 8, "log_every": 1, "backend": backend,
                                      "micro_batches": pp},
                         optim={"name": "adamw", "lr": 0.01}, parallel=parallel, **layers)
        mesh = Mesh(pp=pp, tp=tp)
        trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
        final = trainer.run()
        loss = np.array([final.get("loss", 0.0)])
        comm.Bcast(loss, root=0)  # the logged loss lives on rank 0
        results[backend] = (float(loss[0]), full_params(trainer) if pp * tp > 1 else trainer.params.to_host_dict())
        if backend == "cuda" and not gpt and len(trainer.sync.buckets) < 2:
            raise SystemExit("expected several gradient buckets")
        trainer.close()
        mesh.free()
    (loss_gpu, p_gpu), (loss_cpu, p_cpu) = results["cuda"], results["cpu"]
    ok = abs(loss_gpu - loss_cpu) <= 1e-5 * abs(loss_cpu) + 1e-6
    ok &= all(np.allclose(p_gpu[k], p_cpu[k], rtol=1e-4, atol=1e-5) for k in p_cpu)
    if pp * tp == 1:  # every data-parallel rank must hold the same weights after the step
        gathered = comm.allgather(np.concatenate([v.ravel() for v in p_gpu.values()]))
        ok &= all(np.array_equal(gathered[0], g) for g in gathered)
    print(f"rank {comm.rank}: loss cuda {loss_gpu:.8f} cpu {loss_cpu:.8f} {'OK' if ok else 'MISMATCH'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "dp"))
