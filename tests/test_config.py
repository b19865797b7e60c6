"""Config parsing: defaults, overrides, paths, and errors that name the key."""

import os

import pytest

from hpctrain.config import load_config, parse_config
from hpctrain.errors import ConfigError

BASE = """
[model]
layers = [{type = "linear", in = 4, out = 3}, {type = "relu"}, {type = "linear", in = 3, out = 2, bias = false}]
[data]
path = "data/d.h5"
inputs = "x"
targets = "y"
"""


def write(tmp_path, text, name="c.toml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_defaults_and_relative_paths(tmp_path):
    cfg = load_config(write(tmp_path, BASE))
    assert cfg.data.path == os.path.join(str(tmp_path), "data", "d.h5")
    assert cfg.train.batch_size == 64 and cfg.optim.name == "sgd" and cfg.parallel.dp == "auto"
    assert cfg.model.layers[2].get("bias") is False
    assert cfg.model.layers[0].get("bias") is True


def test_overrides_are_toml_values_or_strings(tmp_path):
    cfg = load_config(write(tmp_path, BASE), ["train.steps=7", "optim.betas=[0.8, 0.9]", "train.metrics=/tmp/run/m.jsonl",
                                             "optim.name=adamw", "parallel.overlap=false", "optim.lr=1"])
    assert cfg.train.steps == 7 and cfg.optim.betas == (0.8, 0.9) and cfg.train.metrics == "/tmp/run/m.jsonl"
    assert cfg.optim.name == "adamw" and cfg.parallel.overlap is False and cfg.optim.lr == 1.0


def test_an_override_is_one_toml_value_and_a_hash_does_not_start_a_comment(tmp_path):
    """``--set train.steps=3#x`` used to parse as 3 (TOML took the rest for a comment); now it is the string it
    looks like, which an int key refuses, naming the key. Inside a path, # is a character like any other."""
    with pytest.raises(ConfigError, match="train.steps: expected int, got string '3#x'"):
        load_config(write(tmp_path, BASE), ["train.steps=3#x"])
    cfg = load_config(write(tmp_path, BASE), ["checkpoint.dir=runs/a#b", 'train.metrics="m#1.jsonl"', "train.steps=4"])
    assert cfg.checkpoint.dir.endswith("runs/a#b") and cfg.train.metrics.endswith("runs/a#b/m#1.jsonl")
    assert cfg.train.steps == 4


@pytest.mark.parametrize("value", ["", "Never", "AUTO", " never "])
def test_a_resume_that_is_neither_a_word_nor_a_path_is_refused(tmp_path, value):
    with pytest.raises(ConfigError, match='checkpoint.resume: expected "auto", "never" or the path of a checkpoint'):
        load_config(write(tmp_path, BASE), [f"checkpoint.resume={value}"])
    assert load_config(write(tmp_path, BASE), ["checkpoint.resume=./Never"]).checkpoint.resume.endswith("/Never")


@pytest.mark.parametrize("value, meant", [("none", "never"), ("Fresh", "never"), ("latest", "auto")])
def test_a_resume_word_that_is_no_file_says_which_word_it_meant(tmp_path, monkeypatch, value, meant):
    monkeypatch.chdir(tmp_path)  # --set paths are read from the working directory
    with pytest.raises(ConfigError, match=f"got '{value}' \\(no such file\\): did you mean \"{meant}\"\\?"):
        load_config(write(tmp_path, BASE), [f"checkpoint.resume={value}"])
    (tmp_path / "latest").symlink_to(tmp_path / "ckpt-00000003.h5")  # a link of that name is a path, even dangling
    assert load_config(write(tmp_path, BASE), ["checkpoint.resume=latest"]).checkpoint.resume.endswith("/latest")


def test_the_python_spelling_of_a_keyword_key_is_not_a_key(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.async_: unknown key; did you mean checkpoint.async?"):
        load_config(write(tmp_path, BASE), ["checkpoint.async_=false"])
    assert load_config(write(tmp_path, BASE), ["checkpoint.async=false"]).checkpoint.async_ is False


def test_round_trip_keeps_control_characters_escaped(tmp_path):
    """``hpctrain config`` prints TOML that reads back: control characters in a string are escaped."""
    cfg = load_config(write(tmp_path, BASE), ['train.metrics="/tmp/a\\u0001b\\tc\\\\d\\"e.jsonl"'])
    assert cfg.train.metrics == '/tmp/a\x01b\tc\\d"e.jsonl'
    again = load_config(write(tmp_path, cfg.to_toml(), "again.toml"))
    assert again.train.metrics == cfg.train.metrics and again.to_toml() == cfg.to_toml()


def test_round_trip_through_toml(tmp_path):
    cfg = load_config(write(tmp_path, BASE), ["optim.name=adam", "train.steps=3", "parallel.pp=2",
                                             "parallel.stages=[[0, 1], [2, 2]]", "parallel.schedule=gpipe"])
    assert cfg.parallel.stages == ((0, 1), (2, 2)) and cfg.parallel.schedule == "gpipe"
    again = load_config(write(tmp_path, cfg.to_toml(), "again.toml"))
    assert again.to_toml() == cfg.to_toml()


@pytest.mark.parametrize("extra,message", [
    ("[bogus]\nx = 1", r"unknown section \[bogus\]"),
    ("[train]\nbatch = 3", "train.batch: unknown key; did you mean train.batch_size?"),
    ("[train]\nlr = 3", "train.lr: unknown key; did you mean optim.lr?"),
    ("[trian]\nsteps = 3", r"unknown section \[trian\]; did you mean \[train\]\?"),
    ("[parallel]\nzero_stage = 1", "parallel.zero_stage: unknown key; did you mean parallel.zero?"),
    ("[checkpoint]\nasynch = true", "checkpoint.asynch: unknown key; did you mean checkpoint.async?"),
    ("[train]\nsteps = 'many'", "train.steps: expected int, got string 'many'"),
    ("[train]\nsteps = 1.5", "train.steps: expected int, got float"),
    ("[train]\nshuffle = 1", "train.shuffle: unknown key; did you mean data.shuffle?"),
    ("[data.x]\nk = 1", "data.x: unknown key"),
    ("[optim]\nname = 'lamb'", "optim.name: expected one of 'sgd', 'adam', 'adamw', got 'lamb'"),
    ("[optim]\nlr = true", "optim.lr: expected float, got bool"),
    ("[optim]\nbetas = [0.9]", "optim.betas: expected an array of two floats"),
    ("[train]\nbatch_size = 0", "train.batch_size: must be >= 1"),
    ("[parallel]\ndp = 'many'", "parallel.dp: expected a positive integer or \"auto\""),
    ("[optim]\nweight_decay = -1.0", "optim.weight_decay: must be >= 0, got -1.0"),
    ("[optim]\nlr = 0.1\nmin_lr = 0.2", r"optim.min_lr: must be in \[0, optim.lr = 0.1\], got 0.2"),
    ("[optim]\ndecay_min_ndim = -1", r"optim.decay_min_ndim: must be in \[0, 8\]"),
    ("[optim]\nschedule = 'nanoGPT'", "optim.schedule: expected one of 'constant', 'cosine', 'linear', 'nanogpt'"),
    ("[optim]\ndecay_min_ndim = 2\n[parallel]\nmode = 'async_ps'", 'optim.decay_min_ndim: not supported with '
     'parallel.mode = "async_ps"'),
    ("[checkpoint]\nallow_changed = 'optim.lr'", r"checkpoint.allow_changed: expected an array of setting names"),
    ("[data]\nval_fraction = 1.0", r"data.val_fraction: must be in \[0, 1\)"),
    ("[train]\nseed = -1", r"train.seed: must be in \[0, 2\*\*63 - 1\]"),
    ("[data]\nseed = -1", r"data.seed: must be in \[0, 2\*\*63 - 1\]"),
    ("[train]\nseed = 9223372036854775808", "train.seed: must fit in a 64-bit signed integer"),
    ("[data]\nseed = 18446744073709551616", "data.seed: must fit in a 64-bit signed integer"),
    ("[train]\nsteps = 9223372036854775808", "train.steps: must fit in a 64-bit signed integer"),
    ("[train]\nbatch_size = 9223372036854775808", "train.batch_size: must fit in a 64-bit signed integer"),
    ("[train]\nlog_every = 9223372036854775808", "train.log_every: must fit in a 64-bit signed integer"),
    ("[train]\neval_every = 9223372036854775808", "train.eval_every: must fit in a 64-bit signed integer"),
    ("[train]\nmicro_batches = 9223372036854775808", "train.micro_batches: must fit in a 64-bit signed integer"),
    ("[optim]\nwarmup_steps = 9223372036854775808", "optim.warmup_steps: must fit in a 64-bit signed integer"),
    ("[checkpoint]\nevery = 9223372036854775808", "checkpoint.every: must fit in a 64-bit signed integer"),
    ("[checkpoint]\nkeep = 9223372036854775808", "checkpoint.keep: must fit in a 64-bit signed integer"),
    ("[parallel]\ndp = 9223372036854775808", "parallel.dp: must fit in a 64-bit signed integer"),
    ("[parallel]\ntp = -9223372036854775809", "parallel.tp: must fit in a 64-bit signed integer"),
    ("[parallel]\nschedule = 'interleaved'", "parallel.schedule: expected one of '1f1b', 'gpipe', 'zero-bubble', "
     "'zero-bubble-h2', 'interleaved-1f1b', got 'interleaved'"),
    ("[parallel]\npp = 2\nschedule = 'interleaved-1f1b'", "parallel.virtual_stages: schedule = \"interleaved-1f1b\" "
     "needs virtual_stages >= 2"),
    ("[parallel]\nschedule = 'interleaved-1f1b'\nvirtual_stages = 2", "parallel.schedule: \"interleaved-1f1b\" needs "
     "parallel.pp >= 2, got pp = 1"),
    ("[train]\nmicro_batches = 3\n[parallel]\npp = 2\nschedule = 'interleaved-1f1b'\nvirtual_stages = 2",
     "train.micro_batches: must be a multiple of parallel.pp = 2"),
    ("[train]\nmicro_batches = 2\ndeterministic = true\n[parallel]\npp = 2\nschedule = 'interleaved-1f1b'\n"
     "virtual_stages = 2", "train.deterministic: not with parallel.schedule = \"interleaved-1f1b\" yet"),
    ("[parallel]\npp = 2\nvirtual_stages = 2", "parallel.virtual_stages: = 2 needs parallel.schedule = "
     "\"interleaved-1f1b\""),
    ("[parallel]\nvirtual_stages = 0", "parallel.virtual_stages: must be >= 1, got 0"),
    ("[train]\nmicro_batches = 2\n[parallel]\npp = 2\nschedule = 'interleaved-1f1b'\nvirtual_stages = 2\n"
     "stages = [[0, 1], [2, 2]]",
     r"parallel.stages lists 2 stage\(s\) but parallel.pp = 2 x virtual_stages = 2 \(a range per model chunk\)"),
    ("[parallel]\npp = 2\nstages = [[0, 1]]", "parallel.stages lists 1 stage\\(s\\) but parallel.pp = 2"),
    ("[parallel]\npp = 2\nstages = [[0, 1], [1, 2]]", r"parallel.stages\[1\] = \[1, 2\] overlaps the stage before it"),
    ("[parallel]\npp = 2\nstages = [[0, 0], [2, 2]]", r"parallel.stages\[1\] = \[2, 2\] leaves out layer\(s\) 1..1"),
    ("[parallel]\npp = 2\nstages = [[2, 2], [0, 1]]", r"parallel.stages\[0\] = \[2, 2\] leaves out layer\(s\) 0..1"),
    ("[parallel]\npp = 2\nstages = [[0, 1], [3, 2]]", r"parallel.stages\[1\] = \[3, 2\]: the last layer comes before"),
    ("[parallel]\nstages = [[0, 1]]", r"parallel.stages end at layer 1 but the model has layers 0..2"),
    ("[parallel]\npp = 2\nstages = [[0, 0], [1, 5]]", r"parallel.stages\[1\] = \[1, 5\]: the model has layers 0..2"),
    ("[parallel]\npp = 3\nstages = [[0, 0], [1, 1], [2, 2]]", r"parallel.stages\[1\] = \[1, 1\] holds no parameters"),
    ("[parallel]\nstages = [[0]]", r"parallel.stages: expected an array of \[first, last\] layer index pairs"),
    ("[parallel]\nstages = [[0, 'a']]", r"parallel.stages: expected .* \(indices are integers >= 0\)"),
    ("[parallel]\nstages = [0, 2]", r"parallel.stages: expected an array of \[first, last\]"),
    ("[train]\ntrace = 3", "train.trace: expected str, got integer 3"),
    ("[cuda]\ngemm = 'cublas'", "cuda.gemm: expected one of 'auto', 'cublaslt', 'numba', got 'cublas'"),
    ("[cuda]\ngemm = true", "cuda.gemm: expected str, got bool"),
])
def test_errors_name_the_key(tmp_path, extra, message):
    text = BASE + "\n" + extra if not extra.startswith("[data]") else BASE.replace('targets = "y"', 'targets = "y"\n' + extra.split("\n", 1)[1])
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text))


def test_largest_seeds_are_accepted(tmp_path):
    cfg = load_config(write(tmp_path, BASE), ["train.seed=9223372036854775807", "data.seed=0"])
    assert cfg.train.seed == 2**63 - 1 and cfg.data.seed == 0


def test_layer_errors(tmp_path):
    def layers(spec):
        return {"model": {"layers": spec}, "data": {"path": "d.h5", "inputs": "x", "targets": "y"}}
    with pytest.raises(ConfigError, match=r"model.layers\[0\].type: expected one of"):
        parse_config(layers([{"type": "conv"}]))
    with pytest.raises(ConfigError, match=r"model.layers\[0\]: a linear layer needs 'out'"):
        parse_config(layers([{"type": "linear", "in": 3}]))
    with pytest.raises(ConfigError, match=r"model.layers\[1\]: unknown key 'in' for a relu layer"):
        parse_config(layers([{"type": "linear", "in": 3, "out": 2}, {"type": "relu", "in": 2}]))
    with pytest.raises(ConfigError, match=r"model.layers\[0\].in: expected int"):
        parse_config(layers([{"type": "linear", "in": "3", "out": 2}]))
    with pytest.raises(ConfigError, match=r"model.layers\[1\].type: expected one of .*, got array \['relu'\]"):
        parse_config(layers([{"type": "linear", "in": 3, "out": 2}, {"type": ["relu"]}]))
    with pytest.raises(ConfigError, match=r"model.layers\[0\].type: expected one of .*, got table \{'a': 1\}"):
        parse_config(layers([{"type": {"a": 1}}]))
    with pytest.raises(ConfigError, match=r"model.layers\[0\].type: required"):
        parse_config(layers([{"in": 3}]))
    with pytest.raises(ConfigError, match=r"model.layers\[0\].out: must fit in a 64-bit signed integer"):
        parse_config(layers([{"type": "linear", "in": 3, "out": 2**63}]))
    with pytest.raises(ConfigError, match=r"model.layers\[1\]: the model has .* parameters up to here; a float32 buffer"):
        parse_config(layers([{"type": "linear", "in": 3, "out": 2**31}, {"type": "linear", "in": 2**31, "out": 2**31}]))


def test_missing_required_and_malformed(tmp_path):
    with pytest.raises(ConfigError, match="data.path: required"):
        parse_config({"model": {"layers": [{"type": "relu"}]}})
    with pytest.raises(ConfigError, match="malformed TOML"):
        load_config(write(tmp_path, "[model\nlayers = "))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "nope.toml"))
    with pytest.raises(ConfigError, match="--set 'train.steps': expected section.key=value"):
        load_config(write(tmp_path, BASE), ["train.steps"])
    with pytest.raises(ConfigError, match="malformed TOML: arrays or tables nested too deeply"):
        load_config(write(tmp_path, "a = " + "[" * 5000 + "]" * 5000))
    (tmp_path / "bom.toml").write_bytes(b"\xef\xbb\xbf" + BASE.encode())  # a byte order mark, as some editors save
    assert load_config(str(tmp_path / "bom.toml")) == load_config(write(tmp_path, BASE))


def test_unreadable_config_path_names_the_path_and_reason(tmp_path):
    write(tmp_path, BASE, "d.h5")  # a file, used as a folder below
    with pytest.raises(ConfigError, match=r"config file '.*d.h5/c.toml' cannot be read: Not a directory"):
        load_config(str(tmp_path / "d.h5" / "c.toml"))


def test_command_line_paths_resolve_against_the_working_directory(tmp_path, monkeypatch):
    """In the file: against the file's folder; with --set: against where the command runs (as every launcher's
    and anchor's paths do); a bare metrics or trace name: inside checkpoint.dir, so a new run folder is a new run."""
    (tmp_path / "configs").mkdir()
    path = write(tmp_path / "configs", BASE + '\n[checkpoint]\ndir = "../runs/a"\n', "c.toml")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(path)
    assert cfg.checkpoint.dir == str(tmp_path / "runs" / "a")
    moved = load_config(path, ["checkpoint.dir=runs/b", 'train.metrics="metrics.jsonl"', "train.trace=t/trace.json"])
    assert moved.checkpoint.dir == str(tmp_path / "runs" / "b")
    assert moved.train.metrics == str(tmp_path / "runs" / "b" / "metrics.jsonl")  # in the new folder
    assert moved.train.trace == str(tmp_path / "t" / "trace.json")  # a path with a folder: from the cwd
    in_file = load_config(write(tmp_path / "configs", BASE + '\n[train]\nmetrics = "m.jsonl"\n', "d.toml"))
    assert in_file.train.metrics == str(tmp_path / "configs" / "m.jsonl")  # no checkpoint.dir: beside the file


def test_every_key_has_its_row_in_docs_config_and_every_row_a_key():
    """docs/config.md has a table row for each key of each section, under that section's heading, and no row
    for a key that is gone (the [model] section's table of layer types aside)."""
    import dataclasses
    import os
    import re

    from hpctrain.config import SECTIONS
    from hpctrain.layer_kinds import BUILTIN

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "config.md")
    with open(path) as f:
        parts = re.split(r"^## \[(\w+)\]\s*$", f.read(), flags=re.M)
    sections = dict(zip(parts[1::2], parts[2::2]))
    assert set(sections) == set(SECTIONS)
    for name, cls in SECTIONS.items():
        rows = set(re.findall(r"^\| `([\w.]+)` \|", sections[name], flags=re.M))
        keys = {f.name.rstrip("_") for f in dataclasses.fields(cls)}  # async_ is the key async
        assert keys <= rows, f"[{name}] keys without a row in docs/config.md: {sorted(keys - rows)}"
        assert rows - keys <= (set(BUILTIN) if name == "model" else set()), \
            f"[{name}] rows in docs/config.md for no key: {sorted(rows - keys)}"


def test_cuda_gemm_is_checked_where_the_config_is_built_in_code_too(tmp_path):
    """``cuda.gemm``'s choices, also for a Config made with dataclasses.replace (check_ranges, not the TOML reader)."""
    import dataclasses

    from hpctrain.config import CudaConfig
    from hpctrain.config.checks import check_ranges

    cfg = load_config(write(tmp_path, BASE))
    assert cfg.cuda.gemm == "auto"
    assert load_config(write(tmp_path, BASE + '[cuda]\ngemm = "numba"\n')).cuda.gemm == "numba"
    with pytest.raises(ConfigError) as e:
        check_ranges(dataclasses.replace(cfg, cuda=CudaConfig(gemm="cuBLASLt")))
    assert str(e.value) == "cuda.gemm: expected one of 'auto', 'cublaslt', 'numba', got 'cuBLASLt'"
