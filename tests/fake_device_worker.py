"""Run by test_fake_device.py under ``mpiexec -n 2``: data parallel, pipeline and tensor parallel on FakeDevice
(tests/fake_device.py), CUDA-aware and staged, against the CPU backend: the same bits, and one wait for the whole
stream per step where the layout allows it (docs/gpu.md's table). Under ``-n 4``: ZeRO with a table tied across
the stages.

    mpiexec -n 2 python tests/fake_device_worker.py DIR
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from mpi4py import MPI  # noqa: E402

from fake_device import FakeDevice  # noqa: E402
from helpers import config, gpt_config, make_classification, make_tokens  # noqa: E402
from hpctrain.parallel.mesh import Mesh  # noqa: E402
from hpctrain.train import Trainer, startup  # noqa: E402

LAYOUTS = [  # (name, pp, tp, model, expected waits for the stream per step)
    ("dp", 1, 1, "mlp", 1), ("pp", 2, 1, "mlp", 1), ("gpt-dp", 1, 1, "gpt", 1), ("gpt-pp", 2, 1, "gpt", 3),
    ("tp", 1, 2, "mlp", None),  # tp: one per tensor-parallel Allreduce as well (docs/gpu.md)
    ("zero", 1, 1, "mlp", 1), ("zero-allreduce", 1, 1, "mlp", 1), ("deterministic", 1, 1, "gpt", 1),
    # parallel.reduce_dtype = "bf16": staged and packed on the host even under a CUDA-aware MPI
    ("gpt-dp-bf16", 1, 1, "gpt", 1), ("zero-bf16", 1, 1, "mlp", 1),
]
# on 4 ranks: ZeRO at dp 2 with the GPT's table tied across pp 2, whose buckets wait for the two ends' sum and are
# reduce-scattered on the training thread (a whole-stream wait each), the others on the communication thread
LAYOUTS_4 = [("gpt-pp-zero", 2, 1, "gpt", None)]


def run(folder, name, pp, tp, model, backend, cuda_aware):
    """Final parameters (gathered to every rank) and the waits of the third step."""
    path = os.path.join(folder, f"{model}.h5")
    parallel = {"bucket_mb": 0.0002, "overlap": True, "cuda_aware": cuda_aware, "pp": pp, "tp": tp,
                "zero": 2 if "zero" in name else 0,
                "zero_reduce": "allreduce" if name.endswith("allreduce") else "reduce_scatter",
                "reduce_dtype": "bf16" if name.endswith("bf16") else "fp32"}
    train = {"steps": 3, "micro_batches": 2 * pp, "grad_clip": 0.5}
    if name == "deterministic":
        train = {**train, "deterministic": True, "deterministic_shards": 2}
    if model == "gpt":
        cfg = gpt_config(path, model={"block_size": 4, "n_embd": 8}, data={"val_fraction": 0.0},
                         train={**train, "batch_size": 4 * MPI.COMM_WORLD.size // (pp * tp)}, parallel=parallel)
    else:
        cfg = config(path, train={**train, "batch_size": 8}, parallel=parallel)
    real = startup.get_backend
    startup.get_backend = (lambda *a, **k: FakeDevice()) if backend == "fake" else real
    mesh = Mesh(pp=pp, tp=tp)
    try:
        trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    finally:
        startup.get_backend = real
    be = trainer.be
    trainer.train_step(0, 0.01)
    trainer.train_step(1, 0.01)
    before = be.host_waits
    trainer.train_step(2, 0.01)
    waits = be.host_waits - before
    # zero = 2 on the fake device: the gradients outside this rank's chunks went back (FakeVmm fills what they
    # read afterwards with NaN, so a read of them would have changed the bits) and came back for the next backward
    released = (trainer.sync.released_bytes, trainer.grad_memory.peak_live_bytes) if trainer.grad_memory else None
    if backend == "fake" and "zero" in name and not cuda_aware and not (released and all(released)):
        raise AssertionError(f"{name}: zero = 2 released no gradient memory on the fake device ({released})")
    if backend == "fake" and cuda_aware and released:  # an MPI reading device memory keeps the whole buffer
        raise AssertionError(f"{name}: zero = 2 released gradient memory under a CUDA-aware MPI")
    gathered = trainer.state_dict()
    flat = trainer.model.layout.pack(gathered[0] if gathered else None)
    mesh.world.Bcast(flat, root=0)
    trainer.close()
    if backend == "fake" and released and be.vmm.handles:  # close() gives zero = 2's device memory back
        raise AssertionError(f"{name}: {len(be.vmm.handles)} device allocations left after close()")
    mesh.free()
    return flat, waits


def main(folder):
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        make_classification(os.path.join(folder, "mlp.h5"), n=32)
        make_tokens(os.path.join(folder, "gpt.h5"), n=300)
    comm.Barrier()
    failed = 0
    for name, pp, tp, model, expected in (LAYOUTS if comm.size == 2 else LAYOUTS_4):
        want, _ = run(folder, name, pp, tp, model, "cpu", False)
        for cuda_aware in (True, False):
            got, waits = run(folder, name, pp, tp, model, "fake", cuda_aware)
            ok = got.tobytes() == want.tobytes() and (expected is None or waits == expected)
            failed += not ok
            print(f"rank {comm.rank}: {name} cuda_aware={cuda_aware}: {waits} waits for the stream "
                  f"(expected {expected}), {'OK' if ok else 'MISMATCH'}", flush=True)
    if comm.size == 2:
        failed += not one_rank_cannot_release(folder)
    return 1 if failed else 0


def one_rank_cannot_release(folder) -> bool:
    """zero = 2 where rank 1's device cannot give memory back: no rank does (the buckets' cuts follow the
    answer, so it is agreed), and rank 0's log says why."""
    comm = MPI.COMM_WORLD

    class NoVmm(FakeDevice):
        release_unsupported = "a device without virtual memory management (this test's)"

    cfg = config(os.path.join(folder, "mlp.h5"), train={"steps": 2, "batch_size": 8},
                 parallel={"bucket_mb": 0.0002, "zero": 2, "cuda_aware": False})
    real, lines = startup.get_backend, []
    startup.get_backend = lambda *a, **k: NoVmm() if comm.rank == 1 else FakeDevice()
    mesh = Mesh()
    try:
        trainer = Trainer(cfg, mesh=mesh, log=lines.append)
    finally:
        startup.get_backend = real
    trainer.run()
    kept = trainer.grad_memory is None
    said = any("another rank's device cannot give gradient memory back" in line for line in lines)
    trainer.close()
    mesh.free()
    ok = kept and (said or comm.rank != 0)
    print(f"rank {comm.rank}: one rank cannot release: {'OK' if ok else 'MISMATCH'} (kept {kept}, said {said})",
          flush=True)
    return ok


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
