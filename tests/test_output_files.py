"""Nothing overwritten that is not ours: every writer replaces only a regular file (issue 52, item 1).

Each writer is given, as its output, a FIFO and (run as root) a character device made with ``os.mknod`` in the
test's own folder (the numbers of /dev/null; /dev itself is never touched): with or without ``--force`` it says so
in one line, exits 2, and the node is still there, unchanged. Before, ``export``, ``predict --out`` and ``data
... --force`` renamed a regular file over it (as root, over /dev/null: the device gone for the whole machine).
"""

import json
import os
import stat
import subprocess
import sys

import h5py
import numpy as np
import pytest

from helpers import config, make_classification, run_trainer as run
from hpctrain.checkpoint import list_checkpoints
from hpctrain.errors import CheckpointError, ConfigError, DataError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ["fifo"] + (["device"] if os.geteuid() == 0 else [])


def hpctrain(*args, cwd):
    return subprocess.run([sys.executable, "-m", "hpctrain", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def make_node(path, kind):
    if kind == "fifo":
        os.mkfifo(path)
    else:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    return _node(path)


def _node(path):
    st = os.lstat(path)
    return stat.S_IFMT(st.st_mode), st.st_rdev, st.st_ino


def no_temporaries(folder):
    return [n for n in os.listdir(folder) if n.endswith(".tmp")] == []


@pytest.fixture(scope="module")
def trained(tmp_path_factory, mesh):
    folder = tmp_path_factory.mktemp("outputs")
    make_classification(folder / "d.h5", n=32)
    run(config(folder / "d.h5", train={"steps": 2}, checkpoint={"dir": str(folder / "ck"), "every": 2}), mesh)
    (_, path), = list_checkpoints(str(folder / "ck"))
    np.savez(folder / "a.npz", x=np.ones((4, 3)), y=np.arange(4))
    (folder / "t.csv").write_text("a,b,y\n1,2,0\n3,4,1\n")
    (folder / "t.txt").write_text("hello world\n")
    np.arange(8, dtype="<u2").tofile(folder / "t.bin")
    (folder / "m.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0, "lr": 0.1, "samples_per_s": 1.0}) + "\n")
    return folder, path


COMMANDS = {
    "export h5": lambda d, ck, out: ["export", ck, out, "--format", "h5"],
    "export safetensors": lambda d, ck, out: ["export", ck, out, "--format", "safetensors"],
    "predict --out": lambda d, ck, out: ["predict", ck, "--data", str(d / "d.h5"), "--out", out],
    "data csv2h5": lambda d, ck, out: ["data", "csv2h5", str(d / "t.csv"), out, "--target", "y"],
    "data npz2h5": lambda d, ck, out: ["data", "npz2h5", str(d / "a.npz"), out, "--inputs", "x", "--targets", "y"],
    "data bin2h5": lambda d, ck, out: ["data", "bin2h5", str(d / "t.bin"), out],
    "data text2h5": lambda d, ck, out: ["data", "text2h5", str(d / "t.txt"), out],
    "plot -o": lambda d, ck, out: ["plot", str(d / "m.jsonl"), "-o", out],
}


@pytest.mark.parametrize("force", [True, False], ids=["force", "no-force"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("command", list(COMMANDS))
def test_no_command_replaces_a_device_or_fifo_force_or_not(trained, tmp_path, command, kind, force):
    folder, ck = trained
    out = str(tmp_path / ("out.png" if command.startswith("plot") else "out.h5"))
    before = make_node(out, kind)
    proc = hpctrain(*COMMANDS[command](folder, ck, out), *(["--force"] if force and "plot" not in command else []),
                    cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr)
    assert "not a regular file" in lines[0] and out in lines[0], lines
    assert _node(out) == before and os.listdir(tmp_path) == ["out.png" if "plot" in command else "out.h5"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_never_replaces_a_node_at_its_name(tmp_path, mesh, kind):
    """A FIFO or device where the step's index (sharded) or single file goes: refused, the node intact."""
    from hpctrain.checkpoint import save_checkpoint
    from hpctrain.checkpoint.write import save_weights

    from hpctrain.train import Trainer

    make_classification(tmp_path / "d.h5", n=32)
    t = Trainer(config(tmp_path / "d.h5", train={"steps": 2}, checkpoint={"dir": str(tmp_path / "ck"), "every": 2}),
                mesh=mesh, log=lambda *a: None)
    node = str(tmp_path / "ck" / "ckpt-00000002.h5")
    before = make_node(node, kind)  # made while the run trains: the start-up checks saw an empty folder
    try:
        with pytest.raises(CheckpointError, match=r"^cannot commit checkpoint .*ckpt-00000002.h5: it is "
                                                  r"a (FIFO|character device).*, not a regular file"):
            t.run()
    finally:
        t.close()
    assert _node(node) == before and no_temporaries(tmp_path / "ck")
    from test_checkpoint import make_state  # noqa: E402 - the single-file writer, the same refusal

    with pytest.raises(CheckpointError, match="not a regular file"):
        save_checkpoint(str(tmp_path / "ck"), make_state(2), keep=1)
    with pytest.raises(CheckpointError, match="not a regular file"):
        save_weights(node, {"w": np.zeros(2, np.float32)})
    assert _node(node) == before and no_temporaries(tmp_path / "ck")


@pytest.mark.parametrize("kind", KINDS)
def test_the_shared_helpers_refuse_a_node_and_a_link(tmp_path, kind):
    """``replaced_atomically`` (trace, metrics rewrite, scan cache, converters) and ``open_for_writing`` (metrics,
    CSV table): a node is refused without being opened; a symbolic link is refused, its target untouched."""
    from hpctrain._files import open_for_writing, replaced_atomically

    node = str(tmp_path / "n")
    before = make_node(node, kind)
    with pytest.raises(ConfigError, match=r"^train.trace: cannot write .*n: it is a .* not a regular file"):
        with replaced_atomically(node, f"train.trace: cannot write {node}", ConfigError) as tmp:
            open(tmp, "w").write("x")
    with pytest.raises(ConfigError, match="not a regular file"):
        open_for_writing(node, "train.metrics", ConfigError)
    assert _node(node) == before and os.listdir(tmp_path) == ["n"]
    (tmp_path / "target").write_text("keep")
    os.symlink(tmp_path / "target", tmp_path / "link")
    with pytest.raises(DataError, match=r"^x: .*/link is a symbolic link"):
        with replaced_atomically(str(tmp_path / "link"), "x", DataError) as tmp:
            open(tmp, "w").write("x")
    assert os.path.islink(tmp_path / "link") and (tmp_path / "target").read_text() == "keep"


@pytest.mark.parametrize("key", ["metrics", "trace"])
def test_a_run_refuses_a_fifo_as_metrics_or_trace_before_training(tmp_path, key):
    make_classification(tmp_path / "d.h5", n=32)
    os.mkfifo(tmp_path / "out")
    cfg = config(tmp_path / "d.h5", train={"steps": 2, key: str(tmp_path / "out")})
    from hpctrain.train import Trainer

    with pytest.raises(ConfigError, match="not a regular file"):
        Trainer(cfg, log=lambda *a: None).close()
    assert stat.S_ISFIFO(os.lstat(tmp_path / "out").st_mode)


def test_a_regular_output_is_still_replaced_with_force(trained, tmp_path):
    folder, ck = trained
    out = tmp_path / "o.h5"
    out.write_text("old")
    proc = hpctrain("data", "text2h5", str(folder / "t.txt"), str(out), "--force", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(out, "r") as f:
        assert "tokens" in f
    assert os.listdir(tmp_path) == ["o.h5"]
