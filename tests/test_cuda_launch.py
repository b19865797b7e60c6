"""The CUDA backend's direct launch path (hpctrain/backend/cuda/launch.py), without a GPU: device arrays over fake
memory, numba-cuda's own argument flattening (``_Kernel._prepare_args``) as the reference, and a recording
``launch`` in place of cuda.core's."""

import ctypes

import numpy as np
import pytest

pytest.importorskip("numba.cuda.dispatcher", reason="needs numba-cuda")
from numba.cuda.cudadrv.devicearray import DeviceNDArray  # noqa: E402
from numba.cuda.dispatcher import CUDADispatcher, _Kernel  # noqa: E402

from hpctrain.backend.cuda.launch import Launcher, argument_kinds, same_parameters  # noqa: E402


class Memory:
    """What a DeviceNDArray reads of its allocation: the device pointer."""

    def __init__(self, address):
        self.device_ctypes_pointer = ctypes.c_void_p(address)


def device_array(shape, dtype=np.float32, address=0x10000, strides=None):
    dtype = np.dtype(dtype)
    if strides is None:
        strides = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) * dtype.itemsize for i in range(len(shape)))
    return DeviceNDArray(tuple(shape), strides, dtype, gpu_data=Memory(address))


class CompiledKernel:
    """numba's _Kernel as the launcher reads it, with numba's own argument flattening."""

    debug = cooperative = False
    extensions = []

    def __init__(self, argtypes, extra=False):
        self.argument_types = argtypes
        self.extra = extra  # a numba whose ABI differs from the one the launcher knows

        class Library:
            def get_cufunc(self):
                return type("CuFunction", (), {"kernel": "kernel-handle"})()

        self._codelibrary = Library()

    def _prepare_args(self, ty, val, stream, retr, out):
        _Kernel._prepare_args(self, ty, val, stream, retr, out)
        if self.extra and ty is self.argument_types[-1]:
            out.append(0)

    def flat(self, args):
        out = []
        for ty, v in zip(self.argument_types, args):
            self._prepare_args(ty, v, None, [], out)
        return out


class Dispatcher:
    """A numba dispatcher as the launcher uses it: ``[grid, block, stream](*args)`` compiles and launches."""

    targetoptions = {}
    _launch_config_sensitive = False
    typeof_pyval = CUDADispatcher.typeof_pyval

    def __init__(self, name="kernel", extra=False):
        self.py_func = lambda: None
        self.py_func.__name__ = name
        self.overloads, self.numba_launches, self.extra = {}, [], extra

    def __getitem__(self, config):
        def launch(*args):
            argtypes = tuple(self.typeof_pyval(a) for a in args)
            kernel = self.overloads.setdefault(argtypes, CompiledKernel(argtypes, self.extra))
            self.numba_launches.append((config[:2], kernel.flat(args)))
        return launch


class Recorder:
    def __init__(self):
        self.launches = []

    def launch(self, stream, config, handle, *params):
        self.launches.append((stream, config, handle, list(params)))

    def config(self, **kw):
        return kw


def launcher():
    rec = Recorder()
    return Launcher(stream=0, core=(rec.launch, rec.config), array_type=DeviceNDArray, core_stream="stream"), rec


def mixed_args(address):
    """Every argument kind the backend passes: arrays of two ranks and dtypes, ints, float32, float64, bool, a tuple."""
    return (device_array((4, 6), address=address), device_array((5,), np.int64, address + 4096), 7, np.float32(0.5),
            2.25, True, (1, 2, 3))


def test_the_first_call_goes_through_numba_and_later_ones_pass_numbas_own_parameters():
    go, rec = launcher()
    k = Dispatcher()
    go(k, 3, 128, mixed_args(0x10000))
    assert (go.slow, go.fast, rec.launches) == (1, 0, [])
    later = mixed_args(0x90000)  # other arrays of the same kinds: other pointers
    go(k, (3, 2), 128, later)
    assert (go.slow, go.fast, go.refused) == (1, 1, [])
    stream, config, handle, params = rec.launches[0]
    assert (stream, handle, config) == ("stream", "kernel-handle", {"grid": (3, 2), "block": 128, "shmem_size": 0})
    kernel = next(iter(k.overloads.values()))
    assert same_parameters(params, kernel.flat(later))
    assert 0x90000 in params and 0x90000 + 4096 in params and (4, 6) == tuple(params[5:7])


def test_the_check_compares_types_and_values_of_ctypes_scalars():
    assert same_parameters([1, ctypes.c_float(0.5)], [1, ctypes.c_float(0.5)])
    assert not same_parameters([1, ctypes.c_float(0.5)], [1, ctypes.c_double(0.5)])
    assert not same_parameters([1, ctypes.c_int64(3)], [1, ctypes.c_int64(4)])
    assert not same_parameters([1, 2], [1, 2, 0])


def test_other_argument_kinds_are_other_pairs():
    go, rec = launcher()
    k = Dispatcher()
    go(k, 1, 32, (device_array((8,)), 3))
    go(k, 1, 32, (device_array((8,), np.float64), 3))  # float64: a new pair, first call through numba
    go(k, 1, 32, (device_array((9,)), 4))
    assert (go.slow, go.fast, len(k.overloads)) == (2, 1, 2)


def test_a_non_contiguous_array_or_a_host_array_always_goes_through_numba():
    go, rec = launcher()
    k = Dispatcher()
    strided = device_array((4, 3), strides=(24, 8))  # every other column of a 4 x 6 array
    assert argument_kinds((strided,), DeviceNDArray) is None
    assert argument_kinds((np.zeros(3),), DeviceNDArray) is None
    for _ in range(3):
        go(k, 1, 32, (strided,))
    assert (go.slow, go.fast, rec.launches) == (3, 0, [])


def test_a_numba_whose_parameters_differ_keeps_numbas_path_and_says_which_kernel():
    go, rec = launcher()
    k = Dispatcher("column_finish", extra=True)
    for _ in range(3):
        go(k, 1, 32, (device_array((8,)), 3))
    assert (go.slow, go.fast, rec.launches) == (3, 0, [])
    assert go.refused == [("column_finish", "TypeError: its parameters differ from numba's for the same call")]


def test_a_launch_configuration_sensitive_kernel_or_no_cuda_core_keeps_numbas_path():
    go, rec = launcher()
    k = Dispatcher("sensitive")
    k._launch_config_sensitive = True
    for _ in range(2):
        go(k, 1, 32, (device_array((8,)),))
    assert (go.fast, go.slow) == (0, 2) and go.refused[0][0] == "sensitive"
    bare = Launcher(stream=0, core=False, array_type=DeviceNDArray)  # cuda.core missing
    k2 = Dispatcher()
    for _ in range(2):
        bare(k2, 1, 32, (device_array((8,)),))
    assert (bare.fast, bare.slow, len(k2.numba_launches)) == (0, 2, 2)


def test_a_launch_cuda_core_refuses_goes_through_numba_and_numpy_sizes_become_ints():
    go, rec = launcher()
    k = Dispatcher("fill")
    go(k, np.int64(2), 32, (device_array((8,)), 3))
    go(k, (np.int64(2), 1), np.int32(32), (device_array((8,)), 3))  # numpy sizes, as a grid computation gives
    assert rec.launches[-1][1] == {"grid": (2, 1), "block": 32, "shmem_size": 0}
    assert all(type(x) is int for x in rec.launches[-1][1]["grid"])

    def refuse(*a):
        raise ValueError("grid too large")

    go._launch = refuse
    go(k, 4, 32, (device_array((8,)), 3))
    assert (go.fast, go.slow, len(k.numba_launches)) == (1, 2, 2)
    assert go.refused == [("fill", "at launch, ValueError: grid too large")]
    go(k, 4, 32, (device_array((8,)), 3))  # the pair stays on numba's path
    assert (go.fast, go.slow, len(k.numba_launches)) == (1, 3, 3)


def test_dropouts_uint64_key_and_threshold_pass_as_numba_passes_them():
    """The dropout kernel's site key and threshold are np.uint64, the key above 2⁶³: the same bytes as numba's."""
    go, rec = launcher()
    k = Dispatcher("dropout")
    args = lambda address: (device_array((12,), address=address), device_array((12,), address=address + 4096),  # noqa: E731
                            4, np.uint64(2**64 - 5), np.uint64(2**31), np.float32(1.25), 0, 3, 3)
    go(k, 1, 128, args(0x10000))
    go(k, 1, 128, args(0x20000))
    assert (go.slow, go.fast, go.refused) == (1, 1, [])
    kernel = next(iter(k.overloads.values()))
    assert same_parameters(rec.launches[0][3], kernel.flat(args(0x20000)))
