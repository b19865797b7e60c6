"""The device code paths on the CPU: tests/fake_device_worker.py under ``mpiexec -n 2`` trains data parallel,
pipeline, tensor parallel, ZeRO (by Reduce_scatter and by Allreduce) and deterministic layouts on FakeDevice
(tests/fake_device.py) with ``parallel.cuda_aware`` true (MPI handed the "device" arrays, which the CUDA simulator
cannot do) and false (staged), and checks the CPU backend's bits and the waits per step."""

import os
import shutil
import subprocess
import sys

import pytest

from launch import launcher_env, mpi_command

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _run_worker(ranks: int, tmp_path) -> str:
    """tests/fake_device_worker.py under ``mpiexec -n ranks``; its output, once it exited cleanly."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        pytest.skip("mpiexec not found: install hpctrain[mpich] or load your site's MPI module")
    env = launcher_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    proc = subprocess.run(mpi_command(mpiexec, ranks, sys.executable, os.path.join(HERE, "fake_device_worker.py"),
                                      str(tmp_path)), cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    return output


def test_device_paths_cuda_aware_and_staged_give_the_cpu_bits(tmp_path):
    output = _run_worker(2, tmp_path)
    # 2 ranks × (CUDA-aware, staged) × 10 layouts, and zero 2 where one rank cannot release
    assert output.count(" OK") == 2 * 2 * 10 + 2, output[-4000:]


def test_zero_with_a_table_tied_across_stages_on_four_ranks(tmp_path):
    """dp 2 × pp 2, ZeRO 2, the GPT: the tied table's buckets wait for its two ends' sum on the training thread while
    the others go through the communication thread; the CPU backend's bits, CUDA-aware and staged."""
    output = _run_worker(4, tmp_path)
    assert output.count(" OK") == 4 * 2, output[-4000:]  # 4 ranks × (CUDA-aware, staged)


def test_on_a_gpu_compute_time_and_bubble_come_from_timing_events(tmp_path):
    """Each forward and backward instruction between two timing events (the fake clock ticks one second per
    event): the step's compute time is their GPU time, and the bubble the GPU's idle share of their span."""
    from fake_device import FakeDevice
    from helpers import config, make_classification
    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer, startup

    make_classification(tmp_path / "d.h5", n=32)
    cfg = config(tmp_path / "d.h5", train={"steps": 1, "batch_size": 8, "micro_batches": 2})
    real, startup.get_backend = startup.get_backend, lambda *a, **k: FakeDevice(clock=True)
    mesh = Mesh()
    try:
        trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    finally:
        startup.get_backend = real
    try:
        timing = trainer.train_step(0, 0.01)
    finally:
        trainer.close()
        mesh.free()
    # two forwards and two backwards, each 1 s of GPU time; 7 s from the first start to the last end
    assert timing["compute"] == 4.0 and timing["bubble"] == 1.0 - 4.0 / 7.0
