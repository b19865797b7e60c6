"""Kernel launches without numba's per-call dispatch, for the CUDA backend on a real GPU.

``kernel[grid, block, stream](*args)`` types every argument, looks the overload up, builds a launch configuration
and converts every argument through numba's general path (a strided memory view per array), on every call. On an
H100 that is most of the host's time in a gpt-char step: 211 launches, about 140 µs of Python each against 12 µs
of GPU work (docs/performance.md, "The asynchronous step on a GPU"). The backend launches the same kernels with
the same argument types every step, so ``Launcher``:

- launches a (kernel, argument kinds) pair's first call through numba, which compiles it, then keeps the overload
  numba chose and its CUDA function;
- from then on flattens the arguments itself, in numba's kernel ABI (an array: meminfo, parent, size, itemsize,
  data pointer, shape, strides; an integer or float as its ctypes scalar; a tuple as its elements in order), and
  calls ``cuda.core.launch`` with a launch configuration kept per (grid, block);
- accepts a pair only if its flattening of that first call equals numba's own (``_Kernel._prepare_args``), so a
  numba whose kernel ABI differs falls back to numba's path, pair by pair, instead of launching wrong arguments.

Only C-contiguous device arrays, Python and numpy ints, floats and bools, and tuples of these take the fast path;
anything else (and every launch under the simulator, where the backend does not build a Launcher) goes through
numba. ``fast`` and ``slow`` count the launches of each kind; ``refused`` names each pair the check sent back and why.
"""

import ctypes
import threading

import numpy as np

_MISSING = object()


def traced_arguments(args) -> tuple:
    """What a launch passes, as a CUDA graph would freeze it: each device array as ("@", its address, shape, dtype;
    the simulator's with its strides), each scalar as itself (NaN as "nan", equal to itself), tuples in order (the
    backend's ``launch_trace``, and the step graphs' key of a launch: two steps whose traces are equal are
    replayed by the same graphs)."""
    out = []
    for a in args:
        if isinstance(a, tuple):
            out.append(traced_arguments(a))
        elif hasattr(a, "device_ctypes_pointer"):
            out.append(("@", a.device_ctypes_pointer.value, tuple(a.shape), a.dtype.str))
        elif hasattr(a, "_ary"):  # the simulator's device array: its numpy memory's address
            ary = a._ary
            out.append(("@", ary.__array_interface__["data"][0], ary.shape, ary.dtype.str, ary.strides))
        else:
            a = a.item() if isinstance(a, np.generic) else a
            out.append("nan" if a != a else a)  # NaN (a fill's) equal to itself, as its bits in a graph are
    return tuple(out)


def _cuda_core_launch():
    """(launch, LaunchConfig) from cuda.core, as numba-cuda's own launch path uses them; None where absent."""
    try:
        from cuda.core import LaunchConfig, launch
    except ImportError:
        try:
            from cuda.core.experimental import LaunchConfig, launch
        except ImportError:
            return None
    return launch, LaunchConfig


def _device_array_type():
    try:
        from numba.cuda.cudadrv.devicearray import DeviceNDArray
    except ImportError:
        return None
    return DeviceNDArray


_SCALARS = (int, float, bool, np.float32, np.float64, np.int32, np.int64, np.uint32, np.uint64, np.bool_)


def argument_kinds(args, array_type):
    """A cheap key of ``args``' numba types: equal keys mean equal types. None: an argument this module leaves
    to numba (a non-contiguous or host array, an object)."""
    kinds = []
    for a in args:
        t = type(a)
        if t in _SCALARS:
            kinds.append(t)
        elif t is tuple:
            inner = argument_kinds(a, array_type)
            if inner is None:
                return None
            kinds.append(inner)
        elif isinstance(a, array_type) and a.is_c_contiguous():
            kinds.append((a.dtype, a.ndim))
        else:
            return None
    return tuple(kinds)


def _converter(ty):
    """A function appending one argument of numba type ``ty`` to the flat parameter list, as numba's
    ``_Kernel._prepare_args`` does for that type; raises TypeError for a type this module does not handle."""
    from numba.cuda import types

    if isinstance(ty, types.Array):
        def array(v, out):
            out += (0, 0, v.size, v.dtype.itemsize, v.device_ctypes_pointer.value)
            out += v.shape
            out += v.strides
        return array
    if isinstance(ty, types.Boolean):
        return lambda v, out: out.append(v)
    if isinstance(ty, types.Integer):
        ctype = getattr(ctypes, f"c_{ty}")
        return lambda v, out: out.append(ctype(v))
    if ty == types.float32:
        return lambda v, out: out.append(ctypes.c_float(v))
    if ty == types.float64:
        return lambda v, out: out.append(ctypes.c_double(v))
    if isinstance(ty, types.BaseTuple):
        inner = [_converter(t) for t in ty]

        def tuple_(v, out):
            for convert, x in zip(inner, v):
                convert(x, out)
        return tuple_
    raise TypeError(f"argument type {ty}")


def same_parameters(ours, numbas):
    """Whether two flat parameter lists pass the same bytes: equal ints, or ctypes scalars of one type and value."""
    if len(ours) != len(numbas):
        return False
    for a, b in zip(ours, numbas):
        if type(a) is not type(b):
            return False
        if isinstance(a, ctypes._SimpleCData):
            if a.value != b.value:
                return False
        elif a != b:
            return False
    return True


def _dims(d):
    """A grid or block as cuda.core takes it: an int or a tuple of ints (not numpy integers)."""
    return tuple(int(x) for x in d) if isinstance(d, tuple) else int(d)


def _name(dispatcher) -> str:
    return getattr(getattr(dispatcher, "py_func", None), "__name__", repr(dispatcher))


def kernel_name(kernel) -> str:
    """A kernel's Python name, numba's or the simulator's (which keeps the function as ``fn``); else the object's
    own ``__name__`` (a library call's stand-in: gemm/__init__.py's CUBLASLT)."""
    fn = getattr(kernel, "py_func", None) or getattr(kernel, "fn", None)
    return getattr(fn, "__name__", None) or getattr(kernel, "__name__", type(kernel).__name__)


class _Entry:
    __slots__ = ("handle", "converters")

    def __init__(self, handle, converters):
        self.handle, self.converters = handle, converters

    def parameters(self, args):
        out = []
        for convert, v in zip(self.converters, args):
            convert(v, out)
        return out


class _Graph:
    __slots__ = ("graph", "stream")

    def __init__(self, graph, stream):
        self.graph, self.stream = graph, stream

    def launch(self) -> None:
        self.graph.launch(self.stream)


class Launcher:
    """Launches ``dispatcher`` on ``stream``: numba's path for a pair's first call, the direct one after (above)."""

    def __init__(self, stream, core=None, array_type=None, core_stream=None):
        self.stream = stream
        if core is None:  # (launch, LaunchConfig); False: none, numba's path for every launch
            core = _cuda_core_launch()
        self._launch, self._config = core or (None, None)
        self._array_type = array_type if array_type is not None else _device_array_type()
        self._core_stream = core_stream  # cuda.core's view of ``stream``, made once (numba makes one per launch)
        self._entries = {}  # (dispatcher, kinds) -> _Entry, or None: numba's path for good
        self._configs = {}  # (grid, block) -> LaunchConfig
        self._lock = threading.Lock()
        self.fast = self.slow = 0
        self.refused = []  # (kernel name, why)

    def __call__(self, dispatcher, grid, block, args):
        entry = None
        if self._launch is not None and self._array_type is not None:
            kinds = argument_kinds(args, self._array_type)
            if kinds is not None:
                entry = self._entries.get((dispatcher, kinds), _MISSING)
                if entry is _MISSING:  # numba compiles and launches the first call; then the pair is decided
                    dispatcher[grid, block, self.stream](*args)
                    self.slow += 1
                    with self._lock:
                        self._entries[(dispatcher, kinds)] = self._prepare(dispatcher, args)
                    return
        if entry is None:
            dispatcher[grid, block, self.stream](*args)
            self.slow += 1
            return
        try:
            config = self._configs.get((grid, block))
            if config is None:
                config = self._config(grid=_dims(grid), block=_dims(block), shmem_size=0)
                self._configs[(grid, block)] = config
            self._launch(self._core_stream, config, entry.handle, *entry.parameters(args))
        except Exception as e:  # refused before the launch (an argument cuda.core will not take): numba's path,
            self._entries[(dispatcher, kinds)] = None  # which launches it or raises its own error
            self.refused.append((_name(dispatcher), f"at launch, {type(e).__name__}: {e}"))
            dispatcher[grid, block, self.stream](*args)
            self.slow += 1
            return
        self.fast += 1

    def freeze(self, dispatcher, grid, block, args):
        """This launch as a graph holds it: (launch configuration, the CUDA function, its flat parameters), with
        no Python object of the call kept (graphs.py). None where the pair has not been launched yet; raises
        graphs.CannotReplay where numba's path launches it for good (it has no direct form)."""
        from .graphs import CannotReplay

        if self._launch is None or self._array_type is None:
            raise CannotReplay("cuda.core's launch is not available")
        kinds = argument_kinds(args, self._array_type)
        if kinds is None:
            raise CannotReplay("an argument only numba's path takes (a host or non-contiguous array, an object)")
        entry = self._entries.get((dispatcher, kinds), _MISSING)
        if entry is _MISSING:
            return None
        if entry is None:
            why = next((w for n, w in reversed(self.refused) if n == _name(dispatcher)), "refused")
            raise CannotReplay(f"numba's path launches it ({why})")
        config = self._configs.get((grid, block))
        if config is None:
            config = self._config(grid=_dims(grid), block=_dims(block), shmem_size=0)
            self._configs[(grid, block)] = config
        return config, entry.handle, tuple(entry.parameters(args))

    def run_frozen(self, frozen) -> None:
        """Launch a ``freeze``-d launch on the stream now (a library call: its ``run`` on the stream)."""
        if hasattr(frozen, "run"):
            frozen.run(self.stream)
            return
        config, handle, parameters = frozen
        self._launch(self._core_stream, config, handle, *parameters)
        self.fast += 1

    def build_graph(self, frozen_list):
        """One CUDA graph of ``frozen_list``'s launches in order, built by capturing them on a graph builder
        (cuda.core), not run; returns an object whose ``launch()`` queues the graph on the stream."""
        builder = self._core_stream.create_graph_builder()
        builder.begin_building()
        try:
            for frozen in frozen_list:
                if hasattr(frozen, "run"):  # a library call (cuBLASLt): captured from the builder's stream
                    frozen.run(builder.stream)
                    continue
                config, handle, parameters = frozen
                self._launch(builder, config, handle, *parameters)
        finally:
            builder.end_building()
        return _Graph(builder.complete(), self._core_stream)

    def _prepare(self, dispatcher, args):
        """The direct path for this pair, or None (and the reason in ``refused``) where numba must keep it."""
        name = _name(dispatcher)
        try:
            if getattr(dispatcher, "_launch_config_sensitive", False) or dispatcher.targetoptions.get("extensions"):
                raise TypeError("its compilation depends on the launch configuration or on argument extensions")
            argtypes = tuple(dispatcher.typeof_pyval(a) for a in args)
            kernel = dispatcher.overloads.get(argtypes)
            if kernel is None:
                raise TypeError(f"no overload for {argtypes} after numba's launch")
            if getattr(kernel, "debug", False) or getattr(kernel, "cooperative", False):
                raise TypeError("a debug or cooperative kernel")
            if self._core_stream is None:
                from numba.cuda.cudadrv import driver

                self._core_stream = driver._to_core_stream(self.stream)
            entry = _Entry(kernel._codelibrary.get_cufunc().kernel, [_converter(t) for t in kernel.argument_types])
            numbas = []
            for ty, v in zip(kernel.argument_types, args):
                kernel._prepare_args(ty, v, self._core_stream, [], numbas)
            if not same_parameters(entry.parameters(args), numbas):
                raise TypeError("its parameters differ from numba's for the same call")
            return entry
        except Exception as e:  # anything unexpected in numba's internals: numba's path, which is always right
            self.refused.append((name, f"{type(e).__name__}: {e}"))
            return None
