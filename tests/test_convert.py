"""hpctrain data csv2h5 | npz2h5 | bin2h5: your own tables and nanoGPT's .bin into files a config trains on."""

import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from hpctrain.convert import bin_to_h5, csv_to_h5, npz_to_h5
from hpctrain.errors import DataError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read(path):
    with h5py.File(path, "r") as f:
        return {k: f[k][...] for k in f}, dict(f["tokens"].attrs) if "tokens" in f else {}


def test_a_csv_with_a_header_becomes_inputs_and_labels(tmp_path):
    (tmp_path / "t.csv").write_text("a,species,b\n1.5,0,2\n-1,2,0.25\n3,1,1e3\n")
    said = csv_to_h5(str(tmp_path / "t.csv"), str(tmp_path / "t.h5"), target="species")
    data, _ = read(tmp_path / "t.h5")
    np.testing.assert_array_equal(data["inputs"], np.array([[1.5, 2], [-1, 0.25], [3, 1e3]], np.float32))
    assert data["targets"].dtype == np.int64 and data["targets"].tolist() == [0, 2, 1]
    assert "3 samples, 2 input features, 3 classes (int64 labels)" in said


def test_a_csv_without_a_header_by_index_and_as_regression(tmp_path):
    (tmp_path / "t.csv").write_text("1,2,3\n4,5,6\n")
    csv_to_h5(str(tmp_path / "t.csv"), str(tmp_path / "t.h5"), target="2", regression=True)
    data, _ = read(tmp_path / "t.h5")
    assert data["inputs"].tolist() == [[1, 2], [4, 5]] and data["targets"].dtype == np.float32


@pytest.mark.parametrize("text, target, match", [
    ("a,b\n1,2\n", "c", r"no column 'c' \(columns: a, b\)"),
    ("a,b\n1,2\n3,x\n", "b", r"line 3, column 'b': 'x' is not a number"),
    ("a,b\n1,2\n3\n", "b", r"line 3 has 1 columns, the first has 2"),
    ("a,b\n", "b", "a header and no rows"),
    ("", "b", "no rows"),
    ("a,b\n1,nan\n2,1\n", "a", "input row 0, column 0 is nan"),
    ("a,y\n1,0\n2,1e30\n", "y", r"target row 1 is 1e\+30: whole numbers this large are no class label \(int64\); "
                                  "pass --regression"),  # the int64 cast would store -2**63
])
def test_bad_csv_is_one_line_naming_where(tmp_path, text, target, match):
    (tmp_path / "t.csv").write_text(text)
    with pytest.raises(DataError, match=match):
        csv_to_h5(str(tmp_path / "t.csv"), str(tmp_path / "t.h5"), target=target)
    assert not os.path.exists(tmp_path / "t.h5")


def test_npz_arrays_without_pickle(tmp_path):
    x = np.arange(24, dtype=np.float64).reshape(4, 2, 3)  # images are flattened to rows
    np.savez(tmp_path / "a.npz", X=x, y=np.array([[0], [1], [1], [0]]))
    npz_to_h5(str(tmp_path / "a.npz"), str(tmp_path / "a.h5"), inputs="X", targets="y")
    data, _ = read(tmp_path / "a.h5")
    assert data["inputs"].shape == (4, 6) and data["targets"].tolist() == [0, 1, 1, 0]
    np.savez(tmp_path / "o.npz", X=np.array([{"a": 1}] * 2, dtype=object), y=np.zeros(2))
    with pytest.raises(DataError, match="cannot read it as an .npz of numeric arrays"):
        npz_to_h5(str(tmp_path / "o.npz"), str(tmp_path / "o.h5"), inputs="X", targets="y")
    with pytest.raises(DataError, match=r"no array 'Z' \(arrays: X, y\)"):
        npz_to_h5(str(tmp_path / "a.npz"), str(tmp_path / "z.h5"), inputs="Z", targets="y")
    np.savez(tmp_path / "n.npz", X=np.zeros((3, 2)), y=np.zeros(2))
    with pytest.raises(DataError, match="3 rows of inputs but 2 targets"):
        npz_to_h5(str(tmp_path / "n.npz"), str(tmp_path / "n.h5"), inputs="X", targets="y")
    np.savez(tmp_path / "t.npz", X=np.ones((4, 3)), y=np.ones((4, 2, 2)))  # a model's output is one row a sample
    with pytest.raises(DataError, match=r"the targets must be one value or one row of values per sample, got shape "
                                        r"\(4, 2, 2\)"):
        npz_to_h5(str(tmp_path / "t.npz"), str(tmp_path / "t.h5"), inputs="X", targets="y")
    assert not (tmp_path / "t.h5").exists()
    (tmp_path / "text.npz").write_text("hello")  # numpy would read it as a pickle, and refuse it as one
    with pytest.raises(DataError, match=r"not an .npz file \(a zip archive of .npy arrays, as numpy.savez writes\); "
                                        r"it starts with b'hell'"):
        npz_to_h5(str(tmp_path / "text.npz"), str(tmp_path / "x.h5"), inputs="X", targets="y")


def test_a_nanogpt_bin_with_its_vocabulary_trains_and_decodes(tmp_path):
    """nanoGPT's shakespeare_char prepare.py: chars = sorted(set(text)), ids as uint16 in train.bin."""
    from hpctrain.text import read_vocabulary

    text = "to be or not to be\n"
    chars = sorted(set(text))
    np.array([chars.index(c) for c in text], dtype=np.uint16).tofile(tmp_path / "train.bin")
    (tmp_path / "input.txt").write_text(text)
    said = bin_to_h5(str(tmp_path / "train.bin"), str(tmp_path / "t.h5"), vocab_from=str(tmp_path / "input.txt"))
    data, _ = read(tmp_path / "t.h5")
    tok = read_vocabulary(str(tmp_path / "t.h5"))
    assert tok.decode(data["tokens"].tolist()) == text
    assert f"{len(text)} tokens, ids up to {len(chars) - 1}, {len(chars)} characters" in said
    bin_to_h5(str(tmp_path / "train.bin"), str(tmp_path / "plain.h5"))
    assert read_vocabulary(str(tmp_path / "plain.h5")) is None


@pytest.mark.parametrize("content, vocab, match", [
    (b"\x01", "", "1 bytes is not a whole number of uint16 token ids"),
    (b"", "", "0 bytes is not"),
    (np.array([0, 7], np.uint16).tobytes(), "ab", "token id 7 is outside the 2-character vocabulary"),
])
def test_bad_bin_files(tmp_path, content, vocab, match):
    (tmp_path / "x.bin").write_bytes(content)
    if vocab:
        (tmp_path / "v.txt").write_text(vocab)
    with pytest.raises(DataError, match=match):
        bin_to_h5(str(tmp_path / "x.bin"), str(tmp_path / "x.h5"), vocab_from=str(tmp_path / "v.txt") if vocab else "")


def test_the_command_converts_and_a_config_trains_on_it(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 3))
    rows = ["f1,f2,f3,label"] + [f"{a:.6f},{b:.6f},{c:.6f},{int(a > 0)}" for a, b, c in x]
    (tmp_path / "t.csv").write_text("\n".join(rows) + "\n")
    run = [sys.executable, "-m", "hpctrain", "data", "csv2h5", "t.csv", "t.h5", "--target", "label"]
    proc = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0 and "64 samples, 3 input features, 2 classes" in proc.stdout, proc.stderr
    again = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert again.returncode == 2 and "t.h5 exists; pass --force to replace it" in again.stderr
    (tmp_path / "job.toml").write_text(
        '[model]\nlayers = [{type = "linear", in = 3, out = 2}]\n[data]\npath = "t.h5"\ninputs = "inputs"\n'
        'targets = "targets"\n[train]\nbatch_size = 16\nsteps = 2\nbackend = "cpu"\n')
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "train", "job.toml"], cwd=tmp_path, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_a_damaged_npz_is_one_line(tmp_path):
    """Issue 52: a corrupt zip (a flipped byte in the archive or a deflate stream, a truncation) printed a
    traceback (zipfile.BadZipFile, zlib.error); now every damage is a DataError of one line, exit 2."""
    import random
    import subprocess
    import sys

    rng = random.Random(52)
    for i, save in enumerate([np.savez, np.savez_compressed] * 20):
        save(tmp_path / "a.npz", X=rng.random() * np.ones((40, 3)), y=np.arange(40))
        raw = bytearray((tmp_path / "a.npz").read_bytes())
        if i % 3 == 0:
            raw = raw[: rng.randrange(4, len(raw))]
        else:
            for _ in range(3):
                raw[rng.randrange(2, len(raw))] ^= rng.randrange(1, 256)
        (tmp_path / "b.npz").write_bytes(raw)
        try:
            npz_to_h5(str(tmp_path / "b.npz"), str(tmp_path / f"b{i}.h5"), inputs="X", targets="y")
        except DataError as e:
            assert "\n" not in str(e)
    raw = bytearray((tmp_path / "a.npz").read_bytes())
    raw[-30] ^= 0xFF  # the end-of-central-directory record
    (tmp_path / "c.npz").write_bytes(raw[:-10])
    proc = subprocess.run([sys.executable, "-m", "hpctrain", "data", "npz2h5", "c.npz", "c.h5", "--inputs", "X",
                           "--targets", "y"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("hpctrain: error: c.npz: cannot read it as an .npz of numeric arrays: BadZipFile")
    assert not os.path.exists(tmp_path / "c.h5")
