"""A TOML document -> Config: sections and keys checked by name (with a "did you mean"), each value by its
field (config/values.py), paths resolved, the whole checked (config/checks.py); ``--set`` overrides; files."""

from __future__ import annotations

import dataclasses
import keyword
import os
import tomllib

from .._files import MAX_CONFIG_BYTES, read_capped, shown
from ..errors import ConfigError
from .checks import check_ranges
from .sections import GPT_KEYS, SECTIONS, Config, DataConfig, _toml_key
from .values import _coerce, _parse_float, _parse_layers, _type_name

PATH_KEYS = {("data", "path"), ("data", "val_path"), ("train", "metrics"), ("train", "trace"), ("train", "tensorboard"),
             ("checkpoint", "init"),
             ("checkpoint", "dir")}
CHOICES = {
    ("model", "kind"): ("mlp", "gpt"),
    ("model", "attention"): ("math", "flash"),
    ("data", "corpus"): ("", "pydoc"),
    ("data", "sampling"): ("windows", "random"),
    ("train", "loss"): ("cross_entropy", "mse"),
    ("train", "recompute"): ("none", "blocks"),
    ("train", "backend"): ("auto", "cpu", "cuda"),
    ("optim", "name"): ("sgd", "adam", "adamw"),
    ("optim", "schedule"): ("constant", "cosine", "linear", "nanogpt"),
    ("parallel", "schedule"): ("1f1b", "gpipe", "zero-bubble", "zero-bubble-h2", "interleaved-1f1b"),
    ("train", "progress"): ("auto", "bar", "lines"),
    ("parallel", "mode"): ("sync", "async_ps"),
    ("parallel", "zero_reduce"): ("auto", "reduce_scatter", "allreduce"),
    ("parallel", "reduce_dtype"): ("fp32", "bf16"),
    ("train", "precision"): ("fp32", "tf32", "bf16"),
    ("cuda", "gemm"): ("auto", "cublaslt", "numba"),
}



def _nearest(key: str, section: str | None) -> str:
    """'; did you mean X?' for an unknown key: a close spelling in its own section (or among the sections when
    ``section`` is None), else the same key in another section (``train.lr`` -> ``optim.lr``); '' when none."""
    import difflib

    if section is None:
        close = difflib.get_close_matches(key, list(SECTIONS), n=1, cutoff=0.6)
        return f"; did you mean [{close[0]}]?" if close else ""
    fields = [_toml_key(f.name) for f in dataclasses.fields(SECTIONS[section])]
    prefix = [f for f in fields if min(len(f), len(key)) >= 3 and (key.startswith(f) or f.startswith(key))]
    if prefix:  # zero_stage -> zero, batch -> batch_size
        return f"; did you mean {section}.{max(prefix, key=len)}?"
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.75)
    if close:
        return f"; did you mean {section}.{close[0]}?"
    elsewhere = [f"{name}.{key}" for name, cls in SECTIONS.items() if name != section
                 and key in {_toml_key(f.name) for f in dataclasses.fields(cls)}]
    if elsewhere:
        return f"; did you mean {elsewhere[0]}?"
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6)
    return f"; did you mean {section}.{close[0]}?" if close else ""


# checkpoint.resume values that read as "never" or "auto" rather than as a path
_NEVER_LIKE = frozenset({"none", "no", "off", "false", "fresh", "new", "scratch"})
_AUTO_LIKE = frozenset({"latest", "last", "newest", "yes", "on", "true", "resume"})


def parse_config(data: dict, base_dir: str = ".", source: str = "<config>", *, cwd_keys=frozenset()) -> Config:
    """Build a Config from a parsed TOML document (a dict). A relative path resolves against ``base_dir``
    (the config file's folder), one of ``cwd_keys`` ((section, key) pairs given on the command line) against
    the working directory; a bare file name for ``train.metrics``, ``train.trace`` or ``train.tensorboard`` lands in
    ``checkpoint.dir`` when that is set (a new run folder keeps its own metrics)."""
    if not isinstance(data, dict):
        raise ConfigError(f"a config is a table of sections ([model], [data], ...), got {_type_name(data)}")
    base_dir = os.path.abspath(base_dir)  # the paths it holds are absolute: to_toml() reads back the same anywhere
    sections = {}
    for name, table in data.items():
        if not isinstance(name, str):
            raise ConfigError(f"a section name must be a string, got {name!r}")
        if name not in SECTIONS:
            raise ConfigError(f"unknown section [{name}]{_nearest(name, None)} (known: {', '.join(SECTIONS)})")
        if not isinstance(table, dict):
            raise ConfigError(f"[{name}] must be a table, got {_type_name(table)}")
        cls = SECTIONS[name]
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for key, value in table.items():
            full, given = f"{name}.{key}", key
            if keyword.iskeyword(key) and key + "_" in fields:  # ``async`` is the field ``async_``
                key = key + "_"
            elif key.endswith("_") and keyword.iskeyword(key[:-1]):
                key = ""  # ``async_``: the field's Python spelling, not a config key
            if key not in fields:
                raise ConfigError(f"{full}: unknown key{_nearest(given, name)} (known in [{name}]: "
                                  f"{', '.join(map(_toml_key, fields))})")
            if name == "model" and key == "layers":
                values[key] = _parse_layers(value)
                continue
            values[key] = _coerce(full, value, fields[key].type)
            if (name, key) == ("optim", "weight_decay") and values[key] < 0:
                raise ConfigError(f"{full}: must be >= 0, got {value!r}")
            choices = CHOICES.get((name, key))
            if choices and values[key] not in choices:
                raise ConfigError(f"{full}: expected one of {', '.join(map(repr, choices))}, got {value!r}")
            here = os.getcwd() if (name, key) in cwd_keys else base_dir
            if (name, key) in PATH_KEYS and values[key]:
                values[key] = os.path.normpath(os.path.join(here, os.path.expanduser(values[key])))
            if (name, key) == ("checkpoint", "resume") and values[key] not in ("auto", "never"):
                if not values[key].strip() or values[key].strip().lower() in ("auto", "never"):
                    raise ConfigError(f'{full}: expected "auto", "never" or the path of a checkpoint, got '
                                      f"{value!r}" + ("" if not values[key].strip() else
                                                      f' (a file of that name: write it as "./{values[key]}")'))
                values[key] = os.path.normpath(os.path.join(here, os.path.expanduser(values[key])))
                word = value.strip().lower()
                meant = "never" if word in _NEVER_LIKE else "auto" if word in _AUTO_LIKE else ""
                if meant and not os.path.lexists(values[key]):  # not a checkpoint (or link) of that name either
                    raise ConfigError(f'{full}: expected "auto", "never" or the path of a checkpoint, got {value!r} '
                                      f'(no such file): did you mean "{meant}"?')
        sections[name] = cls(**values)
    model = data.get("model", {})
    if model.get("kind", "mlp") != "gpt":
        extra = [key for key in GPT_KEYS if key in model]
        if extra:
            raise ConfigError(f"model.{extra[0]}: only used by kind = \"gpt\" (this model is kind = "
                              f"{model.get('kind', 'mlp')!r})")
    folder = sections["checkpoint"].dir if "checkpoint" in sections else ""
    files = {k: v for k, v in data.get("train", {}).items() if k in ("metrics", "trace", "tensorboard") and isinstance(v, str)
             and v and os.path.basename(v) == v and v not in (".", "..")}
    if folder and files:  # bare names: inside the run's folder
        sections["train"] = dataclasses.replace(sections["train"], **{k: os.path.join(folder, v)
                                                                      for k, v in files.items()})
    if "model" in sections and sections["model"].kind == "gpt" and "vocab_size" not in model and "data" in sections:
        found = _data_vocab_size(sections["data"])  # nanoGPT's meta.pkl: the data says how many ids it has
        if found:
            sections["model"] = dataclasses.replace(sections["model"], vocab_size=found)
    cfg = Config(**sections, source=source)
    check_ranges(cfg)
    return cfg


def _data_vocab_size(d: "DataConfig") -> int:
    """model.vocab_size when the config leaves it out: the vocabulary the token files (data.path, data.val_path)
    declare, else their largest id + 1; the bundled corpus's when data.path is still to be written; 0 when no
    file says (the start-up then reports the file's problem, and 50304 stands)."""
    from ..data import token_vocab_size

    sizes = []
    for path in (d.path, d.val_path):
        if path and os.path.isfile(path) and d.tokens:
            sizes.append(token_vocab_size(path, d.tokens, allow_external=d.allow_external))
        elif path == d.path and d.corpus and path:
            from ..text import CharTokenizer, corpus_text

            sizes.append(len(CharTokenizer.from_text(corpus_text(d.corpus))))
    return max(sizes, default=0)


def _parse_override(item: str):
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {item!r}: the key must be section.key, got {key!r}")
    try:
        value = tomllib.loads(f"v = {text}", parse_float=_parse_float)["v"]
        # one TOML value and nothing after it: "3#x" parses as 3 with a comment, which [3#x] does not
        tomllib.loads(f"v = [{text}]")
    except tomllib.TOMLDecodeError:
        value = text  # not a TOML value: take it as a string
    except RecursionError:
        raise ConfigError(f"--set {item!r}: arrays or tables nested too deeply") from None
    return parts[0], parts[1], value


def apply_overrides(data: dict, overrides) -> dict:
    """``section.key=value`` overrides (``--set``) into a parsed TOML document ``data``; returns it."""
    for item in overrides:
        section, key, value = _parse_override(item)
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise ConfigError(f"[{section}] must be a table")
        table[key] = value
    return data


def load_config(path: str, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a TOML config file and apply ``section.key=value`` overrides.

    Only a regular file of at most 16 MiB is read (a FIFO would block, /dev/zero never end).
    """
    text = read_capped(path, f"config file {path!r}", ConfigError, MAX_CONFIG_BYTES)
    try:
        # a byte order mark (some editors write one) is no TOML; floats keep their text (_float_in_range)
        data = tomllib.loads(text.decode("utf-8-sig"), parse_float=_parse_float)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: malformed TOML: {e}") from None
    except RecursionError:  # tomllib parses nested arrays and tables recursively
        raise ConfigError(f"{path}: malformed TOML: arrays or tables nested too deeply") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file") from None
    apply_overrides(data, overrides)
    given = frozenset(tuple(_parse_override(item)[:2]) for item in overrides)  # command-line paths: from the cwd
    try:
        return parse_config(data, base_dir=os.path.dirname(os.path.abspath(path)), source=path, cwd_keys=given)
    except ConfigError as e:  # a quoted TOML key may hold a newline: the message stays one line
        raise ConfigError(shown(str(e))) from None
