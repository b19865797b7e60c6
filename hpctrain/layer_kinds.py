"""Layer kinds a user registers: the name a config's ``model.layers[i].type`` gives, its keys, and what builds it.

    from hpctrain import register_layer
    register_layer("resmlp", ResidualMLP, keys={"dim": int, "hidden": int}, required=("dim", "hidden"))

``build(**args)`` returns a layer with nn/layers.py's interface (``params``, ``init``, ``forward`` and ``backward``
written with the backend's kernels, so it runs on the CPU and the CUDA backend alike). A registered layer is
never split by tensor parallelism: under ``parallel.tp > 1`` every tp rank holds and computes it whole, as it does
a LayerNorm. The built-in kinds (config.LAYER_KEYS) cannot be replaced.

The table is per process: the command line fills it from ``--plugin MODULE`` and ``HPCTRAIN_PLUGINS`` (modules
imported before the config is read, on every rank); a Python program registers its layers before it builds its
``Trainer``. A checkpoint records the modules of the registered kinds its model uses (``layer_plugins``), which
``hpctrain inspect`` shows; nothing is ever imported because a checkpoint or a config names it.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import tomllib
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import ConfigError

__all__ = ["LayerKind", "load_plugins", "plugin_modules", "plugins_from_env", "register_layer", "registered"]

BUILTIN = ("linear", "relu", "gelu", "tanh", "layernorm")
KEY_TYPES = (int, float, bool, str)
_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")


@dataclass(frozen=True)
class LayerKind:
    name: str
    build: Callable[..., Any]
    keys: dict = field(default_factory=dict)  # key -> int | float | bool | str
    required: tuple = ()
    defaults: dict = field(default_factory=dict)
    module: str = ""


_REGISTERED: dict[str, LayerKind] = {}


def register_layer(name: str, build: Callable[..., Any], *, keys: dict | None = None, required=(),
                   defaults: dict | None = None) -> LayerKind:
    """Make ``type = name`` in ``model.layers`` build ``build(**args)``; ``keys`` are the config keys it takes
    and their types, ``required`` those it must be given, ``defaults`` the values of the others when absent.
    Registering the same name again with the same ``build`` is allowed (a module imported twice); with another
    one, or a built-in name, it is an error."""
    keys, defaults, required = dict(keys or {}), dict(defaults or {}), tuple(required)
    if not isinstance(name, str) or not _NAME.match(name):
        raise ConfigError(f"register_layer: the name must be lower-case letters, digits and _ starting with a "
                          f"letter, got {name!r}")
    if name in BUILTIN:
        raise ConfigError(f"register_layer: {name!r} is a built-in layer kind")
    if not callable(build):
        raise ConfigError(f"register_layer({name!r}): build must be a class or function, got {type(build).__name__}")
    for key, kind in keys.items():
        if key == "type" or kind not in KEY_TYPES:
            raise ConfigError(f"register_layer({name!r}): key {key!r} must be a name other than 'type' with one of "
                              "the types int, float, bool, str")
    unknown = [k for k in (*required, *defaults) if k not in keys]
    if unknown:
        raise ConfigError(f"register_layer({name!r}): {unknown[0]!r} is required or defaulted but not in keys")
    for key, value in defaults.items():
        want = keys[key]
        fits = isinstance(value, want) and not (want is int and isinstance(value, bool)) or \
            (want is float and isinstance(value, int) and not isinstance(value, bool))
        if not fits:
            raise ConfigError(f"register_layer({name!r}): the default of {key!r} must be {want.__name__} as its key "
                              f"says, got {value!r}")
    kind = LayerKind(name, build, keys, required, defaults, _module_name(build))
    known = _REGISTERED.get(name)
    if known is not None and known.build is not build:
        raise ConfigError(f"register_layer: {name!r} is already registered by {known.module or 'another module'}")
    _REGISTERED[name] = kind
    return kind


def _module_name(build) -> str:
    """The module to name in a checkpoint: ``build``'s, or for a script run as ``__main__`` its file's name (what
    ``--plugin`` takes once the script's folder is on PYTHONPATH)."""
    module = getattr(build, "__module__", "") or ""
    if module == "__main__":
        path = getattr(sys.modules.get("__main__"), "__file__", "") or ""
        module = os.path.splitext(os.path.basename(path))[0] if path.endswith(".py") else module
    return module


def registered(name: str) -> LayerKind | None:
    return _REGISTERED.get(name)


def registered_names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTERED))


def plugins_from_env() -> list[str]:
    """The modules ``HPCTRAIN_PLUGINS`` names (comma-separated)."""
    return [m.strip() for m in os.environ.get("HPCTRAIN_PLUGINS", "").split(",") if m.strip()]


def load_plugins(modules) -> None:
    """Import each module (it registers its layers as it is imported); one ConfigError line if one fails."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as e:  # ImportError, or the module's own error while it runs
            raise ConfigError(f"plugin {module}: cannot import it ({type(e).__name__}: {e}); it must be importable "
                              "on every rank (PYTHONPATH, or pip install it)") from None


def plugin_modules(config_text: str) -> list[str]:
    """The modules of the registered kinds a config's ``model.layers`` uses, for a checkpoint to record."""
    try:
        layers = tomllib.loads(config_text).get("model", {}).get("layers", [])
    except (tomllib.TOMLDecodeError, AttributeError):
        return []
    types = {layer.get("type") for layer in layers if isinstance(layer, dict)} if isinstance(layers, list) else set()
    return sorted({_REGISTERED[t].module for t in types if t in _REGISTERED and _REGISTERED[t].module})
