"""One setting's value checked and converted: TOML's scalars against a field's annotation, floats against the
ranges the kernels compute in, and ``model.layers``' tables (built-in kinds and registered ones)."""

from __future__ import annotations

import math
import re

from ..errors import ConfigError
from ..layer_kinds import registered, registered_names
from .sections import LayerSpec

LAYER_KEYS = {
    "linear": {"in": int, "out": int, "bias": bool},
    "relu": {},
    "gelu": {},
    "tanh": {},
    "layernorm": {"dim": int, "eps": float},
}
LAYER_REQUIRED = {"linear": ("in", "out"), "layernorm": ("dim",)}
INT64_MAX = 2**63 - 1  # TOML integers are 64-bit; checkpoints store steps and seeds as int64
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38  # the smallest normal float32: below it a value is subnormal, or 0 on a GPU
# float settings the kernels read as float32: a value beyond float32's range overflows there (optim.eps = 1e308 gives
# inf, then NaN), one below its smallest normal number is flushed to 0 (optim.lr = 1e-39 trains nothing)
FLOAT32_KEYS = frozenset({"optim.lr", "optim.momentum", "optim.eps", "optim.betas", "optim.weight_decay",
                          "optim.min_lr", "train.grad_clip", "model.dropout", "eps"})


class _Literal(float):
    """A TOML float as written: ``1e-400`` reads as 0.0, and only its text tells it was not zero."""

    text = ""


def _parse_float(text: str) -> float:
    value = _Literal(text.replace("_", ""))
    value.text = text
    return value


def _type_name(value) -> str:
    kind = float if isinstance(value, _Literal) else type(value)
    return {bool: "bool", int: "integer", float: "float", str: "string", list: "array", dict: "table"}.get(
        kind, kind.__name__
    )


def _coerce(key: str, value, annotation: str):
    """Check one scalar against the dataclass annotation; return the stored value."""
    bad = ConfigError(f"{key}: expected {annotation.replace('|', 'or')}, got {_type_name(value)} {value!r}")
    if annotation == "bool":
        if not isinstance(value, bool):
            raise bad
        return value
    if annotation == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad
        return _int64(key, value)
    if annotation == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        if not math.isfinite(value):
            raise ConfigError(f"{key}: must be finite, got {value!r}")
        return _float_in_range(key, value)
    if annotation == "str":
        if not isinstance(value, str):
            raise bad
        if "\0" in value:  # no file name, schedule or backend holds one; the OS refuses them in paths
            raise ConfigError(f"{key}: must not contain a NUL character")
        return value
    if annotation == "int | str":  # parallel.dp
        if isinstance(value, str) and value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f'{key}: expected a positive integer or "auto", got {value!r}')
        return _int64(key, value)
    if annotation == "bool | str":  # parallel.cuda_aware
        if isinstance(value, bool) or value == "auto":
            return value
        raise ConfigError(f'{key}: expected true, false or "auto", got {value!r}')
    if annotation == "tuple[tuple[int, int], ...]":  # parallel.stages
        form = f"{key}: expected an array of [first, last] layer index pairs like [[0, 3], [4, 6]], got {value!r}"
        if not isinstance(value, list) or not all(isinstance(v, list) and len(v) == 2 for v in value):
            raise ConfigError(form)
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for v in value for i in v):
            raise ConfigError(form + " (indices are integers >= 0)")
        return tuple((int(a), int(b)) for a, b in value)
    if annotation == "tuple[str, ...]":  # checkpoint.allow_changed
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f'{key}: expected an array of setting names like ["optim.lr"], got {value!r}')
        return tuple(value)
    if annotation == "tuple[float, float]":
        if not isinstance(value, list) or len(value) != 2:
            raise ConfigError(f"{key}: expected an array of two floats, got {value!r}")
        return tuple(_coerce(f"{key}[{i}]", v, "float") for i, v in enumerate(value))
    raise AssertionError(annotation)


def _float_in_range(key: str, value) -> float:
    """``value`` as a float, refused where it is not the number written: a literal beyond double precision's range
    that reads as 0 (``1e-400``), or, for a setting the kernels read as float32 (FLOAT32_KEYS), one that float32
    turns into inf or flushes towards 0."""
    text = getattr(value, "text", "")
    mantissa = text.lower().split("e")[0]
    if value == 0 and any(c in "123456789" for c in mantissa):
        raise ConfigError(f"{key}: {text} is below double precision's range and reads as 0; write 0 if 0 is meant")
    name = re.sub(r"\[\d+\]", "", key)  # optim.betas[1] -> optim.betas, model.layers[2].eps -> model.layers.eps
    if name in FLOAT32_KEYS or name.rsplit(".", 1)[-1] in FLOAT32_KEYS:
        shown_value = text or repr(float(value))
        if abs(value) > FLOAT32_MAX:
            raise ConfigError(f"{key}: {shown_value} overflows float32 (at most {FLOAT32_MAX:.7g}), which the "
                              "kernels compute in")
        if 0 < abs(value) < FLOAT32_TINY:
            raise ConfigError(f"{key}: {shown_value} is below float32's smallest normal number ({FLOAT32_TINY:.7g}), "
                              "which the kernels compute in: it would act as 0; write 0 if 0 is meant")
    return float(value)


def _int64(key: str, value: int) -> int:
    # tomllib accepts any size of integer; numpy and HDF5 attributes take int64 only
    if not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ConfigError(f"{key}: must fit in a 64-bit signed integer (at most 2**63 - 1), got {value}")
    return value


def _param_count(kind: str, args: dict) -> int:
    """Parameters of one layer, as the model lays them out (weight and bias)."""
    if kind == "linear":
        return args["in"] * args["out"] + (args["out"] if args["bias"] else 0)
    if kind == "layernorm":
        return 2 * args["dim"]
    plugin = registered(kind)
    if plugin is not None:  # a registered kind says its shapes once built (building allocates nothing)
        return sum(math.prod(shape) for _, shape in plugin.build(**args).params)
    return 0


def _plugin_layer(where: str, plugin, table: dict) -> LayerSpec:
    """A registered kind's table, checked against the keys it declared, with its defaults filled in."""
    args = {}
    for key, v in table.items():
        if key == "type":
            continue
        if key not in plugin.keys:
            raise ConfigError(f"{where}: unknown key {key!r} for a {plugin.name} layer (known: "
                              f"{', '.join(plugin.keys) or 'none'})")
        args[key] = _coerce(f"{where}.{key}", v, plugin.keys[key].__name__)
    for key in plugin.required:
        if key not in args:
            raise ConfigError(f"{where}: a {plugin.name} layer needs {key!r}")
    args = {**plugin.defaults, **args}
    from ..nn.layers import Layer, not_a_layer

    try:
        layer = plugin.build(**args)
        names = [name for name, _ in layer.params] if isinstance(layer, Layer) else []
        shapes = [tuple(int(n) for n in shape) for _, shape in layer.params] if isinstance(layer, Layer) else []
    except Exception as e:  # the layer's own check of its arguments
        raise ConfigError(f"{where}: {plugin.name} layer ({plugin.module}): {type(e).__name__}: {e}") from None
    if not isinstance(layer, Layer):
        raise ConfigError(f"{where}: {not_a_layer(plugin.name, plugin, layer)}")
    if any(n < 1 for shape in shapes for n in shape):
        raise ConfigError(f"{where}: {plugin.name} layer: every parameter dimension must be >= 1, got {shapes}")
    bad = next((n for n in names if not isinstance(n, str) or not all(p.isidentifier() for p in n.split("."))), None)
    if bad is not None or len(set(names)) != len(names):
        what = f"{bad!r} is not a name (letters, digits and _, dotted as torch's fc.weight)" if bad is not None \
            else "a name repeats"
        raise ConfigError(f"{where}: {plugin.name} layer ({plugin.module}): its params {names}: {what}; each "
                          "parameter needs its own name, as torch.nn's do")
    return LayerSpec(plugin.name, tuple(sorted(args.items())))


def _parse_layers(value) -> tuple[LayerSpec, ...]:
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError("model.layers: expected an array of tables like {type = \"linear\", in = 64, out = 10}")
    layers, total = [], 0
    for i, table in enumerate(value):
        where = f"model.layers[{i}]"
        if "type" not in table:
            raise ConfigError(f"{where}.type: required (one of {', '.join(LAYER_KEYS)})")
        kind = table["type"]
        plugin = registered(kind) if isinstance(kind, str) else None
        if plugin is not None:
            layers.append(_plugin_layer(where, plugin, table))
            total += _param_count(kind, dict(layers[-1].args))
            continue
        if not isinstance(kind, str) or kind not in LAYER_KEYS:
            got = f"{_type_name(kind)} {kind!r}" if not isinstance(kind, str) else repr(kind)
            known = ", ".join((*LAYER_KEYS, *registered_names()))
            raise ConfigError(f"{where}.type: expected one of {known}, got {got} (a kind of your own is registered "
                              "by its module: hpctrain --plugin MODULE, or HPCTRAIN_PLUGINS=MODULE; `hpctrain inspect "
                              "CHECKPOINT` names a checkpoint's)")
        allowed = LAYER_KEYS[kind]
        args = {}
        for key, v in table.items():
            if key == "type":
                continue
            if key not in allowed:
                raise ConfigError(f"{where}: unknown key {key!r} for a {kind} layer (known: {', '.join(allowed) or 'none'})")
            args[key] = _coerce(f"{where}.{key}", v, allowed[key].__name__)
        for key in LAYER_REQUIRED.get(kind, ()):
            if key not in args:
                raise ConfigError(f"{where}: a {kind} layer needs {key!r}")
        for key in ("in", "out", "dim"):
            if key in args and args[key] < 1:
                raise ConfigError(f"{where}.{key}: must be >= 1, got {args[key]}")
        if kind == "linear":
            args.setdefault("bias", True)
        if kind == "layernorm":
            args.setdefault("eps", 1e-5)
            if args["eps"] <= 0:
                raise ConfigError(f"{where}.eps: must be > 0, got {args['eps']}")
        total += _param_count(kind, args)
        if total * 4 > INT64_MAX:  # no float32 buffer (params, grads) of this size can exist: numpy refuses it
            raise ConfigError(f"{where}: the model has {total:,} parameters up to here; a float32 buffer of "
                              f"that size exceeds 2**63 bytes")
        layers.append(LayerSpec(kind, tuple(sorted(args.items()))))
    return tuple(layers)

