"""Every writer under a full disk (issue 52, item 4): one line naming the file and the errno, exit 2, no temporary
left, nothing half-written under the final name (an older file there stays as it was).

The disk is "full" through a file-size limit: the command runs in a child process with ``RLIMIT_FSIZE`` set and
SIGXFSZ ignored, so a write past the limit fails with EFBIG, as one on a full disk fails with ENOSPC (the test may
not mount a small tmpfs). Before: ``export --format h5`` and ``data csv2h5`` ended in a segmentation fault after a
traceback per HDF5 object (HDF5 left its objects half-closed after the failed write), ``predict --out`` printed one
line and then crashed, and ``csv2h5`` left its temporary file.
"""

import json
import os
import resource
import signal
import subprocess
import sys

import h5py
import numpy as np
import pytest

from helpers import config, make_classification, run_trainer as run, toml_job
from hpctrain.checkpoint import list_checkpoints

LIMIT = 40_000  # bytes: more than every input below needs to be read, less than every output needs


def _limited(limit=LIMIT):
    def start():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process at the limit
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return start


def hpctrain(*args, cwd, limit=LIMIT):
    return subprocess.run([sys.executable, "-m", "hpctrain", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=180, preexec_fn=_limited(limit))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, mesh):
    folder = tmp_path_factory.mktemp("inputs")
    make_classification(folder / "d.h5", n=4000, features=6)  # predict writes 4000 x 3 floats: 48 kB
    run(config(folder / "d.h5", hidden=96, optim={"name": "adamw", "lr": 0.01}, train={"steps": 1},
               checkpoint={"dir": str(folder / "ck"), "every": 1}), mesh)
    (_, path), = list_checkpoints(str(folder / "ck"))
    rng = np.random.default_rng(0)
    x = rng.random((4000, 4))
    np.savetxt(folder / "t.csv", np.c_[x, np.arange(4000) % 3], delimiter=",", header="a,b,c,d,y", comments="")
    np.savez(folder / "a.npz", x=x, y=np.arange(4000) % 3)
    (folder / "t.txt").write_text("hello world, " * 4000)
    (np.arange(30000) % 50).astype("<u2").tofile(folder / "t.bin")
    with open(folder / "m.jsonl", "w") as f:
        for step in range(1, 400):
            f.write(json.dumps({"step": step, "loss": 1.0 / step, "lr": 0.1, "samples_per_s": 100.0}) + "\n")
    # matplotlib's first import on a machine builds its font cache (running fc-list, which writes fontconfig's):
    # done here, without the limit, so `plot` under it meets a full disk only in hpctrain's own write, as it does
    # on any machine where matplotlib ran once (a fresh CI machine printed fontconfig's "write cache" line)
    subprocess.run([sys.executable, "-c", "import matplotlib.font_manager"], capture_output=True, timeout=300)
    return folder, path


COMMANDS = {
    "export h5": lambda d, ck, out: ["export", ck, out + ".h5", "--format", "h5"],
    "export safetensors": lambda d, ck, out: ["export", ck, out + ".safetensors"],
    "predict --out": lambda d, ck, out: ["predict", ck, "--data", str(d / "d.h5"), "--out", out + ".h5"],
    "data csv2h5": lambda d, ck, out: ["data", "csv2h5", str(d / "t.csv"), out + ".h5", "--target", "y"],
    "data npz2h5": lambda d, ck, out: ["data", "npz2h5", str(d / "a.npz"), out + ".h5", "--inputs", "x",
                                       "--targets", "y"],
    "data bin2h5": lambda d, ck, out: ["data", "bin2h5", str(d / "t.bin"), out + ".h5"],
    "data text2h5": lambda d, ck, out: ["data", "text2h5", str(d / "t.txt"), out + ".h5"],
    "plot -o": lambda d, ck, out: ["plot", str(d / "m.jsonl"), "-o", out + ".svg"],
}


def _one_line(proc, name):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert name in lines[0] and "File too large (EFBIG)" in lines[0], lines
    return lines[0]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_under_a_full_disk_is_one_line_and_leaves_nothing(inputs, tmp_path, command):
    folder, ck = inputs
    args = COMMANDS[command](folder, ck, "out")
    name = next(a for a in args if a.startswith("out."))
    proc = hpctrain(*args, cwd=tmp_path)
    _one_line(proc, name)
    assert os.listdir(tmp_path) == []  # no temporary, nothing under the final name
    # an older file under the name, replaced with --force: still the old file, whole
    (tmp_path / name).write_bytes(b"the old file")
    proc = hpctrain(*args, *(["--force"] if "plot" not in command else []), cwd=tmp_path)
    _one_line(proc, name)
    assert os.listdir(tmp_path) == [name] and (tmp_path / name).read_bytes() == b"the old file"


def test_the_same_commands_succeed_without_the_limit(inputs, tmp_path):
    """The limit is what fails them: each writes its whole output with room to spare."""
    folder, ck = inputs
    for command in ("export h5", "predict --out", "data csv2h5", "data bin2h5"):
        args = COMMANDS[command](folder, ck, command.split()[-1].strip("-"))
        proc = hpctrain(*args, cwd=tmp_path, limit=resource.RLIM_INFINITY)
        assert proc.returncode == 0, proc.stderr
        name = next(a for a in args if a.endswith(".h5") and not a.startswith(str(folder)))
        assert os.path.getsize(tmp_path / name) > LIMIT and h5py.is_hdf5(tmp_path / name)


def train_limited(*args, cwd, limit):
    """``hpctrain train`` with the limit set once MPI is up: MPI's own start-up (UCX's shared-memory segments)
    fails under it, which is not what these tests look at."""
    code = ("import resource, sys\nfrom mpi4py import MPI\n"
            f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
            "from hpctrain.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    return subprocess.run([sys.executable, "-c", code, "train", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=180, preexec_fn=_limited(resource.RLIM_INFINITY))


def _train_job(folder, tmp_path, **train):
    (tmp_path / "job.toml").write_text(toml_job(
        hidden=96, data={"path": str(folder / "d.h5")}, train={"steps": 2, **train},
        optim={"name": "adamw", "lr": 0.01}, checkpoint={"dir": "ck", "every": 2}))


def test_a_checkpoint_under_a_full_disk_is_one_line_and_the_folder_holds_no_set(inputs, tmp_path):
    """Training's own save: the shard (or the index) fails at the limit; one line, exit 2, no index, no temp."""
    folder, _ = inputs
    _train_job(folder, tmp_path)
    proc = train_limited("job.toml", cwd=tmp_path, limit=6000)  # a checkpoint of this model: 12 kB and more
    line = [x for x in proc.stderr.splitlines() if x.startswith("hpctrain: error")]
    assert proc.returncode == 2 and len(line) == 1 and "File too large (EFBIG)" in line[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ckpt-" in line[0]
    assert list_checkpoints(str(tmp_path / "ck")) == []
    assert [n for n in os.listdir(tmp_path / "ck") if n.endswith(".tmp")] == []


@pytest.mark.parametrize("key", ["trace", "metrics"])
def test_a_trace_or_metrics_file_under_a_full_disk_is_one_line(inputs, tmp_path, key):
    folder, _ = inputs
    _train_job(folder, tmp_path, **{key: "out.json"})
    proc = train_limited("job.toml", "--set", "checkpoint.dir=", cwd=tmp_path, limit=300)
    line = [x for x in proc.stderr.splitlines() if x.startswith("hpctrain: error")]
    assert proc.returncode == 2 and len(line) == 1 and "out.json" in line[0], proc.stderr[-3000:]
    assert "File too large (EFBIG)" in line[0] and "Traceback" not in proc.stderr
    assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == []
