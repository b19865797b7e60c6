"""Config -> canonical TOML text (what checkpoints store and compare; ``load_config`` of it gives the same
Config)."""

from __future__ import annotations

import dataclasses

from .sections import GPT_KEYS, SECTIONS, Config, _toml_key

_TOML_ESCAPES = {"\\": "\\\\", '"': '\\"', "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, str):  # a TOML basic string: backslash, quote and every control character escaped
        return '"' + "".join(_TOML_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                             for c in v) + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(type(v))


def config_to_toml(cfg: Config) -> str:
    """The resolved config as TOML text; ``load_config`` of it gives the same Config."""
    lines = []
    for name in SECTIONS:
        section = getattr(cfg, name)
        lines.append(f"[{name}]")
        if name == "model" and section.kind == "gpt":
            lines += [f"{key} = {_toml_value(getattr(section, key))}" for key in ("kind",) + GPT_KEYS]
        elif name == "model":
            lines.append(f"kind = {_toml_value(section.kind)}")
            lines.append("layers = [")
            for layer in section.layers:
                inner = ", ".join(f"{k} = {_toml_value(v)}" for k, v in layer.as_dict().items())
                lines.append(f"  {{{inner}}},")
            lines.append("]")
        else:
            for f in dataclasses.fields(section):
                lines.append(f"{_toml_key(f.name)} = {_toml_value(getattr(section, f.name))}")
        lines.append("")
    return "\n".join(lines)
