"""Property-based tests: generated malformed configs and adversarial HDF5 files (docs/reliability.md).

Every input either loads correctly or gives one HpctrainError line; nothing else escapes, and
each example is bounded in time (SIGALRM). Example counts are fixed and derandomized, so CI
runs the same examples every time.
"""

import os
import shutil
import signal
import tempfile
from contextlib import contextmanager

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_checkpoint import SHAPES, assert_same_state, make_state

from hpctrain.checkpoint import format as fmt
from hpctrain.checkpoint import inspect, load_checkpoint, load_weights, read_meta, save_checkpoint
from hpctrain.config import Config, load_config
from hpctrain.data import Dataset, TokenDataset
from hpctrain.errors import HpctrainError
from hpctrain.nn import CrossEntropyLoss
from hpctrain.params import ParamLayout

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
LAYOUT = ParamLayout(SHAPES)
SECONDS = 20  # one example, at most


@contextmanager
def bounded():
    def expire(*_):
        raise TimeoutError(f"an example ran for more than {SECONDS} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def outcome(fn):
    """fn()'s result, or the HpctrainError it raised (one line); anything else fails the test."""
    with bounded():
        try:
            return fn()
        except HpctrainError as e:
            assert "\n" not in str(e), str(e)
            return e


@pytest.fixture(scope="module")
def scratch():
    folder = tempfile.mkdtemp(prefix="hostile-")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


# --------------------------------------------------------------------------- configs

VALID = """[model]
layers = [{type = "linear", in = 4, out = 8}, {type = "relu"}, {type = "linear", in = 8, out = 3}]
[data]
path = "d.h5"
inputs = "x"
targets = "y"
allow_external = false
[train]
batch_size = 8
steps = 3
[optim]
name = "adam"
betas = [0.9, 0.999]
[parallel]
stages = [[0, 0]]
"""
PIECES = ["[", "]", "{", "}", "=", '"', "'", "\n", ",", ".", "[[", "]]", '"""', "\\u0000", "\\n", "\x00", "\ufeff",
          "1e999", "nan", "-inf", "9223372036854775808", "true", "[model]", "[data]", "a.b.c", '"x\\ny" = 1',
          "é", "\ud800", "#", "0x", "1979-05-27T07:32:00Z", "[" * 50]


@st.composite
def toml_texts(draw):
    if draw(st.booleans()):
        return "".join(draw(st.lists(st.sampled_from(PIECES + list("abc123 \t")), max_size=60)))
    text = VALID
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        cut = draw(st.integers(0, 5))
        text = text[:at] + draw(st.sampled_from(PIECES + [""])) + text[at + cut:]
    return text


@SETTINGS
@given(text=toml_texts(), raw=st.one_of(st.none(), st.binary(max_size=40)))
def test_malformed_toml_is_a_config_or_one_config_error(scratch, text, raw):
    path = os.path.join(scratch, "c.toml")
    with open(path, "wb") as f:
        f.write(raw if raw is not None else text.encode("utf-8", "surrogatepass"))
    got = outcome(lambda: load_config(path))
    assert isinstance(got, (Config, HpctrainError)), got


# --------------------------------------------------------------------------- HDF5 objects

KINDS = ["good", "wrong shape", "int32", "bool", "complex", "string", "compound", "vlen", "scalar", "empty dataspace",
         "zero rows", "unallocated", "huge chunked", "huge contiguous", "soft link", "dangling", "cycle",
         "external link", "external storage", "virtual", "group", "big-endian", "float16"]


def put(f, name, kind, good, *, scratch):
    """Write ``name`` into the open file ``f`` as ``kind`` of object, based on the array ``good``."""
    shape = good.shape
    if kind == "good":
        f[name] = good
    elif kind == "wrong shape":
        f[name] = np.ones(tuple(s + 1 for s in shape), good.dtype)
    elif kind == "int32":
        f[name] = good.astype(np.int32)
    elif kind == "bool":
        f[name] = good.astype(bool)
    elif kind == "complex":
        f[name] = good.astype(np.complex64)
    elif kind == "string":
        f.create_dataset(name, data=np.full(shape, "a", dtype=object), dtype=h5py.string_dtype())
    elif kind == "compound":
        f[name] = np.zeros(shape, dtype=[("a", "<f4"), ("b", "<i4")])
    elif kind == "vlen":
        f.create_dataset(name, shape=shape, dtype=h5py.vlen_dtype("f4"))
    elif kind == "scalar":
        f[name] = np.float32(1)
    elif kind == "empty dataspace":
        f[name] = h5py.Empty(good.dtype)
    elif kind == "zero rows":
        f[name] = np.zeros((0,) + shape[1:], good.dtype)
    elif kind == "unallocated":
        f.create_dataset(name, shape=shape, dtype=good.dtype)
    elif kind == "huge chunked":
        d = f.create_dataset(name, shape=(10**11,) + shape[1:], dtype=good.dtype, chunks=(64,) + shape[1:],
                             compression="gzip")
        d[:64] = 0
    elif kind == "huge contiguous":
        f.create_dataset(name, shape=(10**10,) + shape[1:], dtype=good.dtype)
    elif kind == "soft link":
        f["real_" + name.replace("/", "_")] = good
        f[name] = h5py.SoftLink("/real_" + name.replace("/", "_"))
    elif kind == "dangling":
        f[name] = h5py.SoftLink("/no/such/thing")
    elif kind == "cycle":
        f[name] = h5py.SoftLink("/" + name)
    elif kind == "external link":
        other = tempfile.mktemp(".h5", "other-", scratch)
        with h5py.File(other, "w") as o:
            o["x"] = good
        f[name] = h5py.ExternalLink(other, "/x")
    elif kind == "external storage":
        raw = tempfile.mktemp(".bin", "raw-", scratch)
        with open(raw, "wb") as r:
            r.write(good.tobytes())
        f.create_dataset(name, shape=shape, dtype=good.dtype, external=[(raw, 0, good.nbytes)])
    elif kind == "virtual":
        other = tempfile.mktemp(".h5", "source-", scratch)
        with h5py.File(other, "w") as o:
            o["x"] = good
        layout = h5py.VirtualLayout(shape=shape, dtype=good.dtype)
        layout[...] = h5py.VirtualSource(other, "x", shape=shape)
        f.create_virtual_dataset(name, layout)
    elif kind == "group":
        f.create_group(name)
    elif kind == "big-endian":
        f[name] = good.astype(good.dtype.newbyteorder(">"))
    elif kind == "float16":
        f[name] = good.astype(np.float16)


ODD_NAMES = [b"\xff\xfe", "a\nb", "", "\u2028"]


def add_odd(f, draw_names):
    for name in draw_names:
        try:
            f.create_dataset(name or b"\x01", data=np.zeros(2))
        except (ValueError, TypeError):
            pass
    f.attrs.create(b"\xfe", 1)
    f.attrs["note\nline"] = "x"


@SETTINGS
@given(x_kind=st.sampled_from(KINDS), y_kind=st.sampled_from(KINDS), t_kind=st.sampled_from(KINDS),
       odd=st.lists(st.sampled_from(ODD_NAMES), max_size=2), allow=st.booleans())
def test_adversarial_data_files(scratch, x_kind, y_kind, t_kind, odd, allow):
    path = os.path.join(scratch, "d.h5")
    with h5py.File(path, "w") as f:
        put(f, "x", x_kind, np.arange(64, dtype=np.float32).reshape(16, 4) / 64, scratch=scratch)
        put(f, "y", y_kind, np.arange(16, dtype=np.int64) % 3, scratch=scratch)
        put(f, "t", t_kind, np.arange(64, dtype=np.uint16) % 5, scratch=scratch)
        add_odd(f, odd)

    def rows():
        d = Dataset(path, "x", "y", val_fraction=0.25, loss=CrossEntropyLoss(), in_features=4, out_features=3,
                    allow_external=allow)
        try:
            problem = d.scan(0, 16)
            return problem or d.read(np.array([3, 1, 2]))
        finally:
            d.close()

    def tokens():
        d = TokenDataset(path, "t", block_size=4, val_fraction=0.25, vocab_size=5, allow_external=allow)
        try:
            return d.scan(0, d.n_train + d.n_val) or d.read(np.array([2, 0]))
        finally:
            d.close()

    got = outcome(rows)
    if x_kind == y_kind == "good":
        assert isinstance(got, tuple), got
    got = outcome(tokens)
    if t_kind == "good":
        assert isinstance(got, tuple), got


@SETTINGS
@given(kind=st.sampled_from(KINDS), where=st.sampled_from(["params/0.bias", "optim/exp_avg_sq/2.weight"]),
       digest=st.sampled_from(["keep", "drop", "forge", "garbage"]), odd=st.lists(st.sampled_from(ODD_NAMES), max_size=2))
def test_adversarial_checkpoints(scratch, kind, where, digest, odd):
    folder = os.path.join(scratch, "ck")
    shutil.rmtree(folder, ignore_errors=True)
    state = make_state(3)
    path = save_checkpoint(folder, state, keep=1)
    with h5py.File(path, "r+") as f:
        good = f[where][()]
        del f[where]
        put(f, where, kind, good, scratch=scratch)
        try:
            obj = f.get(where)
        except RuntimeError:  # a loop of links
            obj = None
        if isinstance(obj, h5py.Dataset) and digest != "drop":
            value = {"keep": state.params["0.bias"] if where.startswith("params") else good,
                     "forge": good, "garbage": np.zeros(1)}[digest]
            try:
                fmt.set_attr(obj.attrs, "sha256", fmt.sha256_hex(np.ascontiguousarray(value)))
            except (OSError, KeyError, TypeError):
                pass
        add_odd(f, odd)
    got = outcome(lambda: load_checkpoint(path, LAYOUT))
    if not isinstance(got, HpctrainError):  # only what verifies loads: the state as saved
        assert kind == "good" and digest in ("keep", "forge") and not odd, (kind, digest, odd)
        assert_same_state(got, state)
    outcome(lambda: load_weights(path, LAYOUT))
    outcome(lambda: read_meta(path))
    text, ok = outcome(lambda: inspect(path))
    assert isinstance(text, str) and (ok or "problem:" in text)


@pytest.fixture(scope="module")
def valid_checkpoint(scratch):
    folder = os.path.join(scratch, "valid")
    path = save_checkpoint(folder, make_state(5), keep=1)
    with open(path, "rb") as f:
        return path, f.read()


@SETTINGS
@given(flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=4),
       keep=st.one_of(st.none(), st.floats(0, 1)))
def test_flipped_and_truncated_checkpoints_never_load_wrong_data(scratch, valid_checkpoint, flips, keep):
    _, data = valid_checkpoint
    data = bytearray(data)
    for where, mask in flips:
        data[int(where * len(data))] ^= mask
    if keep is not None:
        data = data[: int(keep * len(data))]
    path = os.path.join(scratch, "flipped", "ckpt-00000005.h5")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    got = outcome(lambda: load_checkpoint(path, LAYOUT))
    if not isinstance(got, HpctrainError):  # the flips missed everything that is read: the same state
        assert_same_state(got, make_state(5))
    weights = outcome(lambda: load_weights(path, LAYOUT))
    if not isinstance(weights, HpctrainError):
        for name, arr in make_state(5).params.items():
            np.testing.assert_array_equal(weights[name], arr)
    outcome(lambda: read_meta(path))
    outcome(lambda: inspect(path))
