"""The scripts in examples/ run as written, under mpiexec on two ranks, with small step counts."""

import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

from launch import launcher_env, mpi_command

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPIEXEC = shutil.which("mpiexec")


def run_example(script, *args, ranks=2, timeout=240):
    """``mpiexec -n ranks python examples/SCRIPT args`` from the repository root; (exit status, output)."""
    cmd = mpi_command(MPIEXEC, ranks, sys.executable, os.path.join("examples", script), *args)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=launcher_env({"PYTHONPATH": ROOT}), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # the ranks catch SIGTERM (a Trainer is running): SIGKILL the group
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran past {timeout} s:\n{out[-3000:]}")
    return proc.returncode, out


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install hpctrain[mpich])")
def test_train_digits_trains_then_resumes(tmp_path):
    rc, out = run_example("train_digits.py", "--steps", "60", "--out", str(tmp_path))
    assert rc == 0, out[-3000:]
    assert "world 2 = dp 2" in out, out[-3000:]
    found = re.findall(r"digits: step 60, loss [0-9.]+, validation accuracy ([0-9.]+)", out)
    assert len(found) == 1 and float(found[0]) > 0.6, out[-3000:]  # printed once, by rank 0
    assert {"ckpt-00000060.h5", "metrics.jsonl"} <= set(os.listdir(tmp_path))
    rc, out = run_example("train_digits.py", "--steps", "60", "--out", str(tmp_path))
    assert rc == 0 and "digits: step 60, already trained, validation accuracy" in out, out[-3000:]


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install hpctrain[mpich])")
def test_gpt_sample_trains_evaluates_and_writes_text(tmp_path):
    rc, out = run_example("gpt_sample.py", "--steps", "10", "--tokens", "40", "--out", str(tmp_path))
    assert rc == 0, out[-3000:]
    assert len(re.findall(r"gpt: step 10, validation loss [0-9.]+ nats per character", out)) == 1, out[-3000:]
    text = out[out.index("nats per character") + len("nats per character\n"):]
    assert text.startswith("The ") and len(text.rstrip("\n")) >= 44, out[-3000:]
    assert "ckpt-00000010.h5" in os.listdir(tmp_path) and "pydoc-chars.h5" in os.listdir(tmp_path)


@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install hpctrain[mpich])")
def test_custom_layer_trains_on_two_ranks_and_its_checkpoint_names_the_plugin(tmp_path):
    rc, out = run_example("custom_layer.py", "--steps", "60", "--out", str(tmp_path))
    assert rc == 0, out[-3000:]
    found = re.findall(r"done: val_accuracy ([0-9.]+)", out)
    assert "world 2 = dp 2" in out and len(found) == 1 and float(found[0]) > 0.6, out[-3000:]
    shown = subprocess.run([sys.executable, "-m", "hpctrain", "inspect", str(tmp_path / "ckpt-00000060.h5")],
                           cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
    assert 'layer plugins: ["custom_layer"]' in shown.stdout, shown.stdout + shown.stderr
