"""Device memory: transfers, staging buffers, flat-buffer views, the caching pool, out-of-memory
errors, and bad arguments (wrong dtype, non-contiguous, wrong shape, host arrays) -> BackendError."""

import gc

import numpy as np
import pytest

from cudatest import SIM, needs_gpu, rand
from hpctrain.backend import get_backend
from hpctrain.backend.cuda import CudaBackend
from hpctrain.backend.cuda.memory import DevicePool, is_out_of_memory, rounded_bytes
from hpctrain.errors import BackendError
from hpctrain.params import FlatBuffer, ParamLayout

# ----------------------------------------------------------------- transfers


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.float64])
def test_asarray_to_host_round_trip(be, rng, dtype):
    host = (rng.standard_normal((4, 3)) * 10).astype(dtype)
    dev = be.asarray(host)
    assert dev.shape == (4, 3) and dev.dtype == dtype and be.is_device
    np.testing.assert_array_equal(be.to_host(dev), host)
    assert be.asarray(dev) is dev  # already on the device
    np.testing.assert_array_equal(be.to_host(be.asarray(host.T)), host.T)  # non-contiguous host input is fine


def test_empty_zeros_and_zero_size(be):
    assert be.empty(5).shape == (5,)
    assert be.empty((2, 3), np.int64).dtype == np.int64
    np.testing.assert_array_equal(be.to_host(be.zeros((3, 2))), np.zeros((3, 2), np.float32))
    assert be.to_host(be.asarray(np.zeros((0, 4), np.float32))).shape == (0, 4)


def test_copy_device_and_host_sources(be, rng):
    a, b = rand(rng, 6), rand(rng, 6)
    dst = be.empty((6,))
    be.copy_(dst, be.asarray(a))
    np.testing.assert_array_equal(be.to_host(dst), a)
    be.copy_(dst, b)
    np.testing.assert_array_equal(be.to_host(dst), b)
    with pytest.raises(BackendError, match=r"copy_: src has shape \(5,\), expected \(6,\)"):
        be.copy_(dst, be.empty((5,)))
    with pytest.raises(BackendError, match="copy_: src must be float32, got float64"):
        be.copy_(dst, np.zeros(6))


def test_staging_through_pinned_host_slices(be, rng):
    """What the data-parallel sync does when MPI is not CUDA-aware: bucket slices out and back."""
    grads = be.asarray(rand(rng, 10))
    host = be.pinned_host((10,))
    assert isinstance(host, np.ndarray) and host.dtype == np.float32 and host.shape == (10,)
    be.to_host_into(grads[6:10], host[6:10])
    be.to_host_into(grads[0:6], host[0:6])
    np.testing.assert_array_equal(host, be.to_host(grads))
    host *= 2  # stands in for the Allreduce
    be.from_host_into(host, grads)
    np.testing.assert_array_equal(be.to_host(grads), host)
    with pytest.raises(BackendError, match=r"to_host_into: host has shape \(4,\), expected \(3,\)"):
        be.to_host_into(grads[0:3], host[0:4])


def test_flat_buffer_views_on_the_device(be, rng):
    layout = ParamLayout([("0.weight", (3, 4)), ("0.bias", (3,)), ("2.weight", (2, 3))])
    buf = FlatBuffer(be, layout)
    np.testing.assert_array_equal(be.to_host(buf.data), np.zeros(layout.size, np.float32))
    arrays = {s.name: rand(rng, *s.shape) for s in layout}
    buf.load_host_dict(arrays)
    for name, arr in buf.to_host_dict().items():
        np.testing.assert_array_equal(arr, arrays[name])
    np.testing.assert_array_equal(be.to_host(buf["0.bias"]), arrays["0.bias"])
    be.fill_(buf["2.weight"], 1.0)  # a view: writes land in the flat buffer
    np.testing.assert_array_equal(be.to_host(buf.data)[-6:], np.ones(6, np.float32))


def test_get_backend_cuda(capsys):
    backend = get_backend("cuda")
    assert isinstance(backend, CudaBackend) and backend.name == "cuda" and backend.is_device
    assert backend.device_name
    auto = get_backend("auto", log=print)
    if SIM:  # the simulator is for testing kernels, not for training: auto takes the CPU and says why
        assert auto.name == "cpu"
        assert "backend auto: the CUDA simulator is on, using the CPU backend" in capsys.readouterr().out
    else:
        assert isinstance(auto, CudaBackend)
        assert f"using the CUDA backend on {auto.device_name}" in capsys.readouterr().out


# ----------------------------------------------------------------- bad arguments


def test_wrong_dtype_names_op_argument_and_shape(be):
    a64 = be.zeros((3, 4), np.float64)
    with pytest.raises(BackendError, match=r"matmul_nt: a must be float32, got float64 with shape \(3, 4\)"):
        be.matmul_nt(a64, be.zeros((2, 4)), be.empty((3, 2)))
    with pytest.raises(BackendError, match=r"cross_entropy: targets must be int64, got int32 with shape \(3,\)"):
        be.cross_entropy(be.zeros((3, 2)), be.zeros((3,), np.int32), be.empty((3, 2)), 1.0)
    with pytest.raises(BackendError, match=r"adam_update: exp_avg_sq must be float32, got float64"):
        be.adam_update(be.zeros((4,)), be.zeros((4,)), be.zeros((4,)), be.zeros((4,), np.float64), lr=1e-3,
                       beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, decoupled=False)


def test_non_contiguous_is_rejected(be):
    x = be.zeros((4, 6))
    with pytest.raises(BackendError, match=r"relu_forward: x must be C-contiguous \(shape \(4, 3\)\)"):
        be.relu_forward(x[:, ::2], be.empty((4, 3)))
    with pytest.raises(BackendError, match=r"matmul_tn: b must be C-contiguous \(shape \(4, 5\)\)"):
        be.matmul_tn(be.zeros((4, 2)), x[:, 1:], be.empty((2, 5)))
    with pytest.raises(BackendError, match="to_host: arr must be C-contiguous"):
        be.to_host(x[:, 1:])


@pytest.mark.parametrize("call,match", [
    (lambda be: be.matmul_nt(be.zeros((3, 4)), be.zeros((2, 5)), be.empty((3, 2))),
     r"matmul_nt: b has shape \(2, 5\), expected 4 columns"),
    (lambda be: be.matmul_nn(be.zeros((3, 4)), be.zeros((4, 5)), be.empty((3, 4))),
     r"matmul_nn: out has shape \(3, 4\), expected \(3, 5\)"),
    (lambda be: be.matmul_nt(be.zeros((3, 4)), be.zeros((2, 4)), be.empty((3, 2)), bias=be.zeros((3,))),
     r"matmul_nt: bias has shape \(3,\), expected \(2,\)"),
    (lambda be: be.matmul_tn(be.zeros((3, 4)), be.zeros((2, 5)), be.empty((4, 5))),
     r"matmul_tn: b has shape \(2, 5\), expected 3 rows"),
    (lambda be: be.bias_grad(be.zeros((3, 4)), be.zeros((3,))), r"bias_grad: dbias has shape \(3,\), expected \(4,\)"),
    (lambda be: be.gelu_backward(be.zeros((3, 4)), be.zeros((4, 3)), be.empty((3, 4))),
     r"gelu_backward: dout has shape \(4, 3\), expected \(3, 4\)"),
    (lambda be: be.layernorm_forward(be.zeros((3, 4)), be.zeros((4,)), be.zeros((4,)), 1e-5, be.empty((3, 4)),
                                     be.empty((2,)), be.empty((3,))),
     r"layernorm_forward: mean has shape \(2,\), expected \(3,\)"),
    (lambda be: be.mse(be.zeros((3, 4)), be.zeros((3, 3)), be.empty((3, 4)), 1.0),
     r"mse: target has shape \(3, 3\), expected \(3, 4\)"),
    (lambda be: be.sum_squares(be.zeros((3, 4))), r"sum_squares: x must have 1 dimensions, got shape \(3, 4\)"),
    (lambda be: be.sgd_update(be.zeros((4,)), be.zeros((5,)), be.zeros((4,)), lr=0.1, momentum=0.0,
                              weight_decay=0.0, nesterov=False),
     r"sgd_update: grad has shape \(5,\), expected \(4,\)"),
])
def test_shape_mismatch_names_op_and_shapes(be, call, match):
    with pytest.raises(BackendError, match=match):
        call(be)


def test_host_arrays_are_rejected_not_copied(be):
    with pytest.raises(BackendError, match=r"matmul_nt: a must be a device array \(backend.asarray\), "
                                           r"got ndarray with shape \(3, 4\)"):
        be.matmul_nt(np.zeros((3, 4), np.float32), be.zeros((2, 4)), be.empty((3, 2)))
    with pytest.raises(BackendError, match="relu_backward: dinp must be a device array"):
        be.relu_backward(be.zeros((2, 2)), be.zeros((2, 2)), np.zeros((2, 2), np.float32))
    with pytest.raises(BackendError, match="sgd_update: param must be a device array"):
        be.sgd_update(np.zeros(3, np.float32), be.zeros((3,)), be.zeros((3,)), lr=0.1, momentum=0.0,
                      weight_decay=0.0, nesterov=False)


# ----------------------------------------------------------------- out of memory


def test_out_of_memory_becomes_backend_error(be):
    """A request no device (and no host, in the simulator) can satisfy: the error names op, shape and size."""
    with pytest.raises(BackendError, match=r"empty: out of GPU memory allocating shape \(1152921504606846976,\) "
                                           r"float32 \(4398046511104\.0 MiB\)"):
        be.empty((2**60,))
    with pytest.raises(BackendError, match=r"zeros: out of GPU memory allocating shape \(1024, 1125899906842624\)"):
        be.zeros((1024, 2**50))
    with pytest.raises(BackendError, match=r"pinned_host: out of pinned host memory allocating shape"):
        be.pinned_host((2**60,))


class _FakeArray:
    """Stands in for a device array: holds its owner as numba's views do."""

    def __init__(self, block, shape, owner):
        self.block, self.shape, self.owner = block, shape, owner

    def view(self):
        return _FakeArray(self.block, self.shape, self.owner)


class _FakeOOM(RuntimeError):
    code = 2  # CUDA_ERROR_OUT_OF_MEMORY


def test_pool_reuses_blocks_once_every_view_is_gone():
    made = []

    def raw_alloc(nbytes):
        made.append(nbytes)
        return f"block{len(made)}"

    pool = DevicePool(raw_alloc, lambda block, shape, dtype, owner: _FakeArray(block, shape, owner))
    a = pool.alloc((100,), np.float32)
    view = a.view()
    del a
    gc.collect()
    b = pool.alloc((100,), np.float32)
    assert b.block != view.block  # the view still holds the first block
    del view
    gc.collect()
    c = pool.alloc((10, 10), np.float32)  # same size class, other shape
    assert c.block == "block1" and made == [512, 512]
    assert pool.hits == 1 and pool.misses == 2
    d = pool.alloc((1000,), np.float32)
    assert d.block == "block3" and made[-1] == rounded_bytes(4000) == 4096
    assert pool.leased_bytes == 512 + 512 + 4096 and pool.cached_bytes == 0


def test_pool_keeps_blocks_alive_through_a_garbage_cycle():
    """An array in a reference cycle: the cycle collector runs weak-reference finalizers before ``__del__``,
    so a block held only by its lease would be freed (numba's finalizer) and then handed back dead."""
    import weakref

    freed = []

    class Block:  # numba's OwnedPointer frees the device memory from a weakref.finalize
        def __init__(self, n):
            self.n = n
            weakref.finalize(self, freed.append, n)

    made = []

    def raw_alloc(nbytes):
        made.append(Block(len(made)))
        block = made[-1]
        made[-1] = None  # the pool's reference is the only one
        return block

    pool = DevicePool(raw_alloc, lambda block, shape, dtype, owner: _FakeArray(block, shape, owner))
    a = pool.alloc((100,), np.float32)
    a.cycle = a
    del a
    gc.collect()
    b = pool.alloc((100,), np.float32)  # the cached block, still allocated
    assert b.block.n == 0 and freed == [] and pool.hits == 1
    del b
    gc.collect()
    pool.release_cached()
    gc.collect()
    assert freed == [0]  # released: now numba may free it


def test_pool_releases_its_cache_and_retries_once_on_out_of_memory():
    state = {"cached_dropped": False, "calls": 0}

    def raw_alloc(nbytes):
        state["calls"] += 1
        if nbytes > 1024 and not state["cached_dropped"]:
            raise _FakeOOM("CUDA_ERROR_OUT_OF_MEMORY")
        return object()

    pool = DevicePool(raw_alloc, lambda block, shape, dtype, owner: _FakeArray(block, shape, owner))
    small = pool.alloc((10,), np.float32)
    del small
    gc.collect()
    assert pool.cached_bytes == 512

    original = pool.release_cached

    def release():
        state["cached_dropped"] = True
        original()

    pool.release_cached = release
    big = pool.alloc((1000,), np.float32)
    assert big is not None and pool.cached_bytes == 0 and state["calls"] == 3

    def always_oom(nbytes):
        raise _FakeOOM("out of memory")

    pool._raw_alloc = always_oom
    with pytest.raises(_FakeOOM):
        pool.alloc((4096,), np.float32)


def test_backend_turns_pool_oom_into_backend_error():
    be = CudaBackend()

    def always_oom(nbytes):
        raise _FakeOOM("CUDA_ERROR_OUT_OF_MEMORY")

    be._pool = DevicePool(always_oom, None)
    with pytest.raises(BackendError, match=r"empty: out of GPU memory allocating shape \(1024, 4096\) float32 "
                                           r"\(16\.0 MiB\)"):
        be.empty((1024, 4096))
    assert is_out_of_memory(MemoryError()) and not is_out_of_memory(ValueError("bad shape"))


@needs_gpu("the simulator has no device pointers, so the backend does not use the pool there")
def test_real_pool_hands_back_the_same_device_memory():
    be = CudaBackend()
    a = be.empty((1000,))
    ptr = a.__cuda_array_interface__["data"][0]
    view = a[10:20]
    del a
    gc.collect()
    b = be.empty((1000,))
    assert b.__cuda_array_interface__["data"][0] != ptr  # the slice keeps the first block leased
    del view
    gc.collect()
    c = be.empty((1000,))
    assert c.__cuda_array_interface__["data"][0] == ptr
    assert be._pool.hits >= 1


def test_simulator_flag_matches_environment():
    import os

    assert SIM == (os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0"))


# ----------------------------------------------------------------- zero = 2: device memory that goes back


@needs_gpu("CUDA's virtual memory management (the simulator has none)")
def test_zero2_gradient_buffer_gives_device_memory_back_and_takes_it_again(be):
    """backend/cuda/vmm.py on the device: the units outside a chunk free device memory once released (the driver's
    free memory grows by as much), read the spare unit meanwhile, and hold what a kernel writes once filled."""
    from numba import cuda

    assert be.release_unsupported == ""
    unit_floats = (2 << 20) // 4
    n = 16 * unit_floats
    half = n // 2
    buf = be.releasable_buffer(n, outside=[(half, n)], keep_bytes=0)
    assert buf.unit % 4 == 0 and n * 4 % buf.unit == 0
    np.testing.assert_array_equal(be.to_host(buf.array), np.zeros(n, np.float32))
    buf.fill(half, n)
    be.fill_(buf.array[half:], 3.0)
    be.synchronize()
    before = cuda.current_context().get_memory_info()[0]
    released = buf.release(half, n)
    after = cuda.current_context().get_memory_info()[0]
    assert released == (n - half) * 4
    assert after - before >= 0.9 * released, (before, after, released)
    buf.fill(half, n)
    be.fill_(buf.array[half:], 5.0)
    host = be.to_host(buf.array)
    assert (host[:half] == 0).all() and (host[half:] == 5).all()
    buf.close()


def test_zero2_on_the_simulator_keeps_the_full_buffer_and_says_why(be):
    if not SIM:
        pytest.skip("the simulator's answer")
    assert "simulator" in be.release_unsupported
    with pytest.raises(BackendError, match="simulator"):
        be.releasable_buffer(8, outside=[(4, 8)], keep_bytes=0)
