"""The tiled, register-blocked GEMM in its three layouts against numpy and the CPU backend.

Shapes are odd and not multiples of any tile, so every launch has partial tiles at
the M, N and K edges; several tilings (including ones where the loads do not
divide evenly over the threads) run the same kernel source.
"""

import numpy as np
import pytest

import reference as ref
from cudatest import AGREE, F32, SIM, needs_gpu, rand
from hpctrain.backend.cuda import CudaBackend
from hpctrain.backend.cuda.gemm.tiled import (GPU_SMALL_TILE, GPU_TILE, GPU_TILES, GPU_TINY_TILE, GPU_TN_TILES, SIM_TILE,
                                        GemmTile, choose_tile, grid_blocks, k_splits)
from hpctrain.errors import BackendError

SHAPES = [(1, 1, 1), (5, 9, 7), (13, 11, 6)]  # (M, K, N)
# The simulator's tilings are unaligned on purpose (the second: 4 threads load 30 and 20 elements per K step); a GPU
# builds aligned tilings only (GemmTile.check(aligned=True)), so there the small and tiny GPU tilings take their place.
TILES = [SIM_TILE, GemmTile(6, 4, 5, 3, 2)] if SIM else [GPU_SMALL_TILE, GPU_TINY_TILE]


@pytest.fixture(scope="module", params=TILES, ids=lambda t: "x".join(map(str, t)))
def tiled(request):
    return CudaBackend(tile=request.param, gemm="numba")


def _linear(rng, M, K, N):
    return rand(rng, M, K), rand(rng, N, K), rand(rng, N), rand(rng, M, N)


@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul_nt_matches_reference_and_cpu(tiled, cpu, rng, M, K, N, with_bias):
    x, w, b, _ = _linear(rng, M, K, N)
    bias = b if with_bias else None
    out = tiled.empty((M, N))
    tiled.matmul_nt(tiled.asarray(x), tiled.asarray(w), out, bias=None if bias is None else tiled.asarray(bias))
    got = tiled.to_host(out)
    np.testing.assert_allclose(got, ref.linear_forward(x, w, bias), **F32)
    want = np.empty((M, N), np.float32)
    cpu.matmul_nt(x, w, want, bias=bias)
    np.testing.assert_allclose(got, want, **AGREE)


@pytest.mark.parametrize("M,K,N", SHAPES)
def test_matmul_nn_matches_reference_and_cpu(tiled, cpu, rng, M, K, N):
    x, w, _, dout = _linear(rng, M, K, N)
    dinp = tiled.empty((M, K))
    tiled.matmul_nn(tiled.asarray(dout), tiled.asarray(w), dinp)
    got = tiled.to_host(dinp)
    np.testing.assert_allclose(got, ref.linear_backward(dout, x, w)[0], **F32)
    want = np.empty((M, K), np.float32)
    cpu.matmul_nn(dout, w, want)
    np.testing.assert_allclose(got, want, **AGREE)


@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("accumulate", [False, True])
def test_matmul_tn_matches_reference_and_cpu(tiled, cpu, rng, M, K, N, accumulate):
    x, w, _, dout = _linear(rng, M, K, N)
    start = rand(rng, N, K)
    dweight = tiled.asarray(start.copy())
    tiled.matmul_tn(tiled.asarray(dout), tiled.asarray(x), dweight, accumulate=accumulate)
    got = tiled.to_host(dweight)
    expected = ref.linear_backward(dout, x, w)[1] + (start if accumulate else 0)
    np.testing.assert_allclose(got, expected, **F32)
    want = start.copy()
    cpu.matmul_tn(dout, x, want, accumulate=accumulate)
    np.testing.assert_allclose(got, want, **AGREE)


@pytest.mark.parametrize("rows,splits", [(40, 2), (301, 8)])
@pytest.mark.parametrize("accumulate", [False, True])
def test_split_k_weight_gradient(be, cpu, rng, rows, splits, accumulate):
    """A weight gradient whose grid is under one wave is summed over K slices, then the slices in order:
    the same result as one pass (to float32 rounding), bit-identical run to run, accumulate honoured."""
    n_out, n_in = 5, 7  # one tile: under a wave (the simulator's 4 blocks, a GPU's one per SM)
    rows = rows if SIM else 64 * rows  # a GPU's wave asks for more slices, each at least 32 rows long
    tile = choose_tile(be.tn_tiles, be.wave, n_out, n_in)
    if SIM:
        assert k_splits(tile, be.wave, n_out, n_in, rows) == splits
    else:
        assert k_splits(tile, be.wave, n_out, n_in, rows) > 1
    dout, x, start = rand(rng, rows, n_out), rand(rng, rows, n_in), rand(rng, n_out, n_in)
    runs = []
    for _ in range(2):
        got = be.asarray(start.copy())
        be.matmul_tn(be.asarray(dout), be.asarray(x), got, accumulate=accumulate)
        runs.append(be.to_host(got))
    expected = dout.astype(np.float64).T @ x + (start if accumulate else 0)
    np.testing.assert_allclose(runs[0], expected, rtol=1e-5, atol=1e-5 * np.sqrt(rows))
    want = start.copy()
    cpu.matmul_tn(dout, x, want, accumulate=accumulate)
    np.testing.assert_allclose(runs[0], want, rtol=1e-5, atol=1e-5 * np.sqrt(rows))
    assert runs[0].tobytes() == runs[1].tobytes()


def test_tile_and_split_choice_fill_an_h100():
    """The shape table: the 128×128 tiling where it fills 132 SMs, 64×64 elsewhere, split-K under a wave."""
    tiles, sms = (GPU_TILE, GPU_SMALL_TILE), 132
    assert choose_tile(tiles, sms, 4096, 4096) == GPU_TILE  # 1024 blocks
    assert choose_tile(tiles, sms, 2048, 512) == GPU_SMALL_TILE  # 64 blocks of 128², 256 of 64²
    assert choose_tile(tiles, sms, 128, 128) == GPU_SMALL_TILE  # neither fills a wave: the smaller
    assert k_splits(GPU_SMALL_TILE, sms, 128, 128, 2048) == 64  # 4 blocks: 66 slices wanted, 64 of 32 allowed
    assert k_splits(GPU_SMALL_TILE, sms, 128, 128, 50) == 1  # K too short to split
    assert k_splits(GPU_SMALL_TILE, sms, 512, 2048, 4096) == 1  # 256 blocks: a wave already
    assert grid_blocks(GPU_SMALL_TILE, 128, 128) * k_splits(GPU_SMALL_TILE, sms, 128, 128, 2048) >= sms


def test_narrow_products_take_the_tiny_tiling_and_weight_gradients_split_instead():
    """gpt-char's 2048×128 outputs (X·Wᵀ of c_proj, dY·W of c_fc) made 64 blocks of 64²: half a wave of an H100.
    The 32×32 tiling makes 256; a weight gradient keeps 64×64 and is split along K."""
    sms = 132
    assert choose_tile(GPU_TILES, sms, 2048, 128) == GPU_TINY_TILE
    assert grid_blocks(GPU_TINY_TILE, 2048, 128) >= sms
    assert choose_tile(GPU_TILES, sms, 2048, 512) == GPU_SMALL_TILE  # the larger tile still wins where it fills
    tile = choose_tile(GPU_TN_TILES, sms, 128, 128)
    assert tile == GPU_SMALL_TILE and grid_blocks(tile, 128, 128) * k_splits(tile, sms, 128, 128, 2048) >= sms


def test_gpu_tilings_read_their_fragments_with_16_byte_loads():
    for tile in GPU_TILES:
        tile.check(aligned=True)
    # TM = TN = 2; TN = 6; BK = 16, whose bank padding leaves 66-float shared rows
    for bad in (GemmTile(64, 64, 8, 2, 2), GemmTile(64, 48, 8, 8, 6), GemmTile(64, 64, 16, 8, 8)):
        with pytest.raises(BackendError, match="16-byte loads"):
            bad.check(aligned=True)
    SIM_TILE.check()  # the simulator's tilings need not be: no vector loads there
    GemmTile(6, 4, 5, 3, 2).check()


def test_gemm_on_views_of_a_flat_buffer(be, rng):
    """Weights are reshaped slices of the flat parameter buffer; the kernel must honour the offset."""
    w, b, x = rand(rng, 7, 5), rand(rng, 7), rand(rng, 3, 5)
    flat = be.asarray(np.concatenate([rand(rng, 4), w.ravel(), b]))
    wv, bv = flat[4:39].reshape(7, 5), flat[39:46]
    out = be.empty((3, 7))
    be.matmul_nt(be.asarray(x), wv, out, bias=bv)
    np.testing.assert_allclose(be.to_host(out), ref.linear_forward(x, w, b), **F32)


@pytest.mark.parametrize("tile,M,K,N,layouts", [
    (GPU_TILE, 3, 9, 5, ("nt", "nn", "tn")),  # the 128×128×8 / 8×8 tiling (256 threads), on one small block
    (GPU_TINY_TILE, 37, 41, 35, ("nt", "nn")),  # 32×32×8 / 4×4 (64 threads), several blocks, ragged edges
], ids=["default-one-block", "tiny-ragged"])
def test_gpu_tilings_match_numpy(rng, tile, M, K, N, layouts):
    """The GPU tilings (X·Wᵀ, dY·W, and dYᵀ·X where the backend runs it at that tiling) against numpy."""
    be = CudaBackend(tile=tile, gemm="numba")
    x, w, b, dout = _linear(rng, M, K, N)
    for layout in layouts:
        if layout == "nt":
            out = be.empty((M, N))
            be.matmul_nt(be.asarray(x), be.asarray(w), out, bias=be.asarray(b))
            expected = ref.linear_forward(x, w, b)
        elif layout == "nn":
            out = be.empty((M, K))
            be.matmul_nn(be.asarray(dout), be.asarray(w), out)
            expected = ref.linear_backward(dout, x, w)[0]
        else:
            out = be.empty((N, K))
            be.matmul_tn(be.asarray(dout), be.asarray(x), out)
            expected = ref.linear_backward(dout, x, w)[1]
        np.testing.assert_allclose(be.to_host(out), expected, **F32)


@needs_gpu("hundreds of 256-thread blocks take minutes in the simulator")
@pytest.mark.parametrize("M,K,N", [(300, 257, 129), (1024, 1000, 513)])
def test_gpu_tile_on_larger_shapes(rng, M, K, N):
    be = CudaBackend(gemm="numba")  # the tiled kernels: cuBLASLt is tests/cuda/test_cuda_cublaslt.py
    x, w, b, dout = _linear(rng, M, K, N)
    tol = dict(rtol=1e-4, atol=1e-4)
    out = be.empty((M, N))
    be.matmul_nt(be.asarray(x), be.asarray(w), out, bias=be.asarray(b))
    np.testing.assert_allclose(be.to_host(out), ref.linear_forward(x, w, b), **tol)
    dinp = be.empty((M, K))
    be.matmul_nn(be.asarray(dout), be.asarray(w), dinp)
    dweight = be.empty((N, K))
    be.matmul_tn(be.asarray(dout), be.asarray(x), dweight)
    rdinp, rdweight, _ = ref.linear_backward(dout, x, w)
    np.testing.assert_allclose(be.to_host(dinp), rdinp, **tol)
    np.testing.assert_allclose(be.to_host(dweight), rdweight, **tol)


def test_empty_product_is_a_no_op_and_k0_gives_bias(be):
    out = be.empty((0, 3))
    be.matmul_nt(be.empty((0, 4)), be.zeros((3, 4)), out)
    bias = np.array([1.0, 2.0, 3.0], np.float32)
    out = be.empty((2, 3))
    be.matmul_nt(be.zeros((2, 0)), be.zeros((3, 0)), out, bias=be.asarray(bias))
    np.testing.assert_array_equal(be.to_host(out), np.tile(bias, (2, 1)))


@pytest.mark.parametrize("tile,match", [((8, 8, 4, 3, 2), "multiple of TM"), ((8, 8, 0, 2, 2), ">= 1"),
                                        ((128, 128, 8, 2, 2), "threads per block"),
                                        ((256, 256, 32, 16, 16), "bytes of shared memory")])
def test_bad_tile_is_rejected(tile, match):
    with pytest.raises(BackendError, match=match):
        CudaBackend(tile=tile)
