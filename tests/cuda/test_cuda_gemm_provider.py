"""``cuda.gemm``: the CUDA backend's GEMMs through the cuBLASLt provider (hpctrain/backend/cuda/gemm/__init__.py),
under the simulator, with tests/cublaslt_fake.py's ``SimulatorCublaslt`` in the provider's place (the planned
call emulated on the simulated arrays' memory). The products equal numpy; the provider gets the requests the
docs promise (NT + bias epilogue, NN, TN accumulating with beta 1) on the backend's stream; what it refuses runs
in the numba kernels; a few training steps equal the numba GEMMs' within float32 tolerance, with the step graphs
on (each cuBLASLt call a segment boundary) and off; "auto" and "cublaslt" choose and refuse in one line. The real
library on a GPU: tests/cuda/test_cuda_cublaslt.py."""

import dataclasses

import numpy as np
import pytest
from cublaslt_fake import SimulatorCublaslt
from cublaslt_load import cublaslt

from cudatest import F32, SIM, kept_qkv_backward, rand
from helpers import config, gpt_config, make_classification, make_tokens
from hpctrain.backend import get_backend
from hpctrain.backend.cuda import CudaBackend
from hpctrain.backend.cuda import gemm as gemm_module
from hpctrain.config import CudaConfig
from hpctrain.errors import BackendError
from hpctrain.parallel.mesh import Mesh
from hpctrain.train import Trainer

pytestmark = pytest.mark.skipif(not SIM, reason="the fake provider reads simulated arrays as host memory")


@pytest.fixture
def fake(monkeypatch):
    """cuBLASLt "available" under the simulator: every provider the backends make is a SimulatorCublaslt (refusing
    what ``made.refuse`` names)."""
    made = Made()

    def make():
        made.append(SimulatorCublaslt(refuse=made.refuse))
        return made[-1]

    monkeypatch.setattr(gemm_module, "cublaslt_unavailable", lambda simulator: None)
    monkeypatch.setattr(cublaslt, "Cublaslt", make)
    return made


class Made(list):
    refuse = None


@pytest.fixture
def be(fake):
    backend = CudaBackend(gemm="cublaslt")
    assert backend.gemm_provider == "cublaslt" and backend.gemm_why == ""
    return backend


def last_request(be, fake):
    req, stream, _ = fake[-1].calls[-1]
    assert stream is be.stream
    return req.op, req.epilogue, req.accumulate, req.M, req.N, req.K


@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul_nt_is_one_provider_call_with_the_bias_epilogue(be, fake, rng, with_bias):
    M, K, N = 5, 7, 6
    x, w, b = rand(rng, M, K), rand(rng, N, K), rand(rng, N)
    out, launches = be.empty((M, N)), be.launches
    be.matmul_nt(be.asarray(x), be.asarray(w), out, bias=be.asarray(b) if with_bias else None)
    want = x.astype(np.float64) @ w.T.astype(np.float64) + (b if with_bias else 0)
    np.testing.assert_allclose(be.to_host(out), want, **F32)
    assert last_request(be, fake) == ("nt", "bias" if with_bias else "none", False, M, N, K)
    assert len(fake[-1].calls) == 1 and be.launches == launches + 1 and be.gemm_fallbacks == {}


def test_matmul_nn(be, fake, rng):
    M, K, N = 4, 9, 3
    a, b = rand(rng, M, K), rand(rng, K, N)
    out = be.empty((M, N))
    be.matmul_nn(be.asarray(a), be.asarray(b), out)
    np.testing.assert_allclose(be.to_host(out), a.astype(np.float64) @ b, **F32)
    assert last_request(be, fake) == ("nn", "none", False, M, N, K)


@pytest.mark.parametrize("accumulate", [False, True])
def test_matmul_tn_accumulates_with_beta_one(be, fake, rng, accumulate):
    K, M, N = 11, 4, 6  # K: the batch's rows, the reduction of a weight gradient
    a, b, c0 = rand(rng, K, M), rand(rng, K, N), rand(rng, M, N)
    out = be.asarray(c0)
    be.matmul_tn(be.asarray(a), be.asarray(b), out, accumulate=accumulate)
    want = a.T.astype(np.float64) @ b + (c0 if accumulate else 0)
    np.testing.assert_allclose(be.to_host(out), want, **F32)
    assert last_request(be, fake) == ("tn", "none", accumulate, M, N, K)


def test_a_bias_short_of_16_byte_alignment_is_copied_where_the_epilogue_can_read_it(be, fake, rng):
    """A Linear's bias is a view into the flat parameters, 4-byte aligned: cuBLASLt's BIAS epilogue reads a copy."""
    M, K, N = 3, 5, 4
    x, w, flat_b = rand(rng, M, K), rand(rng, N, K), rand(rng, N + 1)
    params = be.asarray(flat_b)
    bias = params[1:]
    assert gemm_module.address(bias) % 16 == 4
    out = be.empty((M, N))
    be.matmul_nt(be.asarray(x), be.asarray(w), out, bias=bias)
    np.testing.assert_allclose(be.to_host(out), x.astype(np.float64) @ w.T + flat_b[1:], **F32)
    _, _, addresses = fake[-1].calls[-1]
    assert addresses["bias"] % 16 == 0 and addresses["bias"] != gemm_module.address(bias)
    assert be.gemm_fallbacks == {}


def test_what_the_provider_refuses_runs_in_the_numba_kernels(be, fake, rng):
    fake[-1].refuse = lambda req: "cuBLASLt has no algorithm for tn (test)" if req.op == "tn" else None
    K, M, N = 7, 3, 5
    a, b = rand(rng, K, M), rand(rng, K, N)
    out = be.empty((M, N))
    be.matmul_tn(be.asarray(a), be.asarray(b), out)
    np.testing.assert_allclose(be.to_host(out), a.T.astype(np.float64) @ b, **F32)
    assert fake[-1].calls == [] and be.gemm_fallbacks == {"cuBLASLt has no algorithm for tn (test)": 1}
    be.matmul_nn(be.asarray(a), be.asarray(rand(rng, M, 2)), be.empty((K, 2)))  # other ops still go to cuBLASLt
    assert len(fake[-1].calls) == 1 and sum(be.gemm_fallbacks.values()) == 1


def test_an_empty_product_runs_in_the_numba_kernels(be, fake, rng):
    """K = 0 (cuBLASLt takes K >= 1): out = the bias, from the numba kernel."""
    b = rand(rng, 3)
    out = be.empty((2, 3))
    be.matmul_nt(be.empty((2, 0)), be.empty((3, 0)), out, bias=be.asarray(b))
    np.testing.assert_array_equal(be.to_host(out), np.broadcast_to(b, (2, 3)))
    assert fake[-1].calls == [] and be.gemm_fallbacks == {"K = 0 (cuBLASLt takes K >= 1)": 1}


def test_tf32_asks_cublaslt_for_tf32_products(fake, rng):
    """train.precision = "tf32": the Linear products as TF32 requests (inputs rounded to 10 mantissa bits by the
    emulator, as the tensor cores do), measurably off float32; under "auto" on the simulator the numba kernels,
    which have no TF32, with one log line saying so."""
    from cublaslt_fake import round_tf32

    be = CudaBackend(gemm="cublaslt", tf32=True)
    a, w = rand(rng, 9, 33), rand(rng, 7, 33)
    out = be.empty((9, 7))
    be.matmul_nt(be.asarray(a), be.asarray(w), out)
    assert fake[-1].calls[-1][0].precision == "tf32"
    np.testing.assert_allclose(be.to_host(out), round_tf32(a) @ round_tf32(w).T, rtol=1e-5, atol=1e-5)
    assert np.abs(be.to_host(out) - a.astype(np.float64) @ w.T).max() > 1e-4
    lines = []
    plain = get_backend("cuda", precision="tf32", gemm="auto", log=lines.append)
    assert plain.gemm_provider == "numba" and plain._lt_precision == "tf32"
    assert lines[-1] == ('train.precision = "tf32": the numba GEMM kernels have no TF32, the products compute in '
                         "float32")


def test_use_numba_closes_the_provider_and_runs_every_product_in_the_numba_kernels(be, fake, rng):
    """What start-up does on every rank when another has no cuBLASLt (train/startup.py's agree_gemm)."""
    launches = be.launches
    be.use_numba("another rank has no cuBLASLt")
    assert fake[-1].closed and be.gemm_provider == "numba" and be.gemm_why == "another rank has no cuBLASLt"
    a, w = rand(rng, 4, 6), rand(rng, 5, 6)
    out = be.empty((4, 5))
    be.matmul_nt(be.asarray(a), be.asarray(w), out)
    np.testing.assert_allclose(be.to_host(out), a.astype(np.float64) @ w.T, **F32)
    assert fake[-1].calls == [] and be.gemm_fallbacks == {} and be.launches > launches


# ----------------------------------------------------------------- choosing the provider


def test_auto_takes_the_numba_kernels_under_the_simulator_and_logs_why_once(fake):
    lines = []
    be = get_backend("cuda", log=lines.append, gemm="auto")
    assert be.gemm_provider == "numba" and "simulator" in be.gemm_why and fake == []
    said = [line for line in lines if "cuda.gemm" in line]
    assert len(said) == 1 and said[0].startswith('cuda.gemm = "auto": the numba GEMM kernels, since the CUDA '
                                                 "simulator has no cuBLASLt"), lines
    numba = get_backend("cuda", log=lines.append, gemm="numba")
    assert numba.gemm_provider == "numba" and numba.gemm_why == ""
    assert [line for line in lines if "cuda.gemm" in line] == said  # "numba" asked for: nothing to say


def test_cublaslt_where_it_cannot_load_is_one_line(monkeypatch):
    monkeypatch.setattr(cublaslt, "unavailable", lambda: "cuBLASLt cannot load: no libcublasLt.so here")
    with pytest.raises(BackendError) as e:
        CudaBackend(gemm="cublaslt")
    assert str(e.value) == ('cuda.gemm = "cublaslt" but cuBLASLt cannot load: no libcublasLt.so here; use "auto" '
                            'or "numba"')
    monkeypatch.setattr(cublaslt, "unavailable", lambda: None)  # loads, but the simulator's arrays are host memory
    with pytest.raises(BackendError, match='^cuda.gemm = "cublaslt" but the CUDA simulator has no cuBLASLt') as e:
        CudaBackend(gemm="cublaslt")
    assert "\n" not in str(e.value)


def test_an_unknown_provider_is_refused():
    with pytest.raises(BackendError, match="cuda.gemm must be one of 'auto', 'cublaslt', 'numba', got 'cublas'"):
        CudaBackend(gemm="cublas")


# ----------------------------------------------------------------- training steps


@pytest.fixture(scope="module")
def mesh():
    m = Mesh()
    yield m
    m.free()


def train(cfg, mesh, gemm, graphs, steps):
    """(parameters after ``steps``, per step (python_launches, graph_launches), the trainer's backend)."""
    trainer = Trainer(dataclasses.replace(cfg, cuda=CudaConfig(gemm=gemm, graphs=graphs)), mesh=mesh,
                      log=lambda *a: None)
    seen = []
    for step in range(steps):
        out = trainer.train_step(step, 0.01 * (step + 1))
        seen.append((out["python_launches"], out.get("graph_launches")))
    params, be = trainer.be.to_host(trainer.params.data), trainer.be
    trainer.close()
    return params, seen, be


def test_an_mlp_trains_as_with_the_numba_gemms_with_graphs_on_and_off(tmp_path, mesh, fake):
    make_classification(tmp_path / "d.h5", n=48)
    cfg = config(tmp_path / "d.h5", train={"steps": 4, "batch_size": 8, "micro_batches": 2, "backend": "cuda",
                                           "grad_clip": 0.5}, optim={"name": "adamw", "lr": 0.01})
    numba, _, _ = train(cfg, mesh, "numba", False, 4)
    plain, _, be = train(cfg, mesh, "cublaslt", False, 4)
    assert be.gemm_provider == "cublaslt" and be.graphs is None and be.gemm_fallbacks == {}
    # three Linears, two micro-batches: a forward product, a weight gradient and (but the first's) an input
    # gradient each
    assert len(fake[-1].calls) == 4 * 2 * (3 + 3 + 2)
    np.testing.assert_allclose(plain, numba, rtol=1e-4, atol=1e-5)
    calls = len(fake[-1].calls)
    graphed, seen, be = train(cfg, mesh, "cublaslt", True, 4)
    assert be.graphs.captures == 1 and be.graphs.reason == "" and be.graphs.off == ""
    assert len(fake[-1].calls) == calls  # each product ran once a step, replayed ones with their segment
    _, numba_seen, _ = train(cfg, mesh, "numba", True, 4)
    # replayed from the third step: the cuBLASLt calls captured in the graphs, none made from Python, the step's
    # segments as many as with the numba kernels
    assert seen[2:] == numba_seen[2:] and all(s[1] > 0 for s in seen[2:]), (seen, numba_seen)
    assert np.array_equal(graphed, plain)  # replayed in their order among the kernels: the same bits


def test_a_gpt_trains_as_with_the_numba_gemms(tmp_path, mesh, fake):
    make_tokens(tmp_path / "t.h5", n=300)
    cfg = gpt_config(tmp_path / "t.h5", model={"block_size": 4, "n_embd": 4, "n_layer": 1},
                     data={"val_fraction": 0.1}, train={"steps": 3, "batch_size": 2, "backend": "cuda"},
                     optim={"name": "adamw", "lr": 0.01})
    numba, _, _ = train(cfg, mesh, "numba", "auto", 3)
    graphed, seen, be = train(cfg, mesh, "cublaslt", "auto", 3)
    assert be.gemm_provider == "cublaslt" and be.gemm_fallbacks == {} and fake[-1].calls
    assert {req.op for req, _, _ in fake[-1].calls} == {"nt", "nn", "tn"}
    # the third step replayed its graphs, the cuBLASLt calls (attention's strided ones too) captured in them
    assert seen[2][0] == 0 and seen[2][1] > 0, seen
    np.testing.assert_allclose(graphed, numba, rtol=1e-4, atol=1e-5)


def test_a_training_run_logs_each_fallback_reason_once(tmp_path, mesh, fake):
    make_classification(tmp_path / "d.h5", n=24)
    cfg = config(tmp_path / "d.h5", train={"steps": 2, "batch_size": 8, "backend": "cuda"})
    fake.refuse = lambda req: "cuBLASLt has no algorithm for tn (test)" if req.op == "tn" else None
    lines = []
    trainer = Trainer(dataclasses.replace(cfg, cuda=CudaConfig(gemm="cublaslt")), mesh=mesh, log=lines.append)
    for step in range(2):
        trainer.train_step(step, 0.01)
    assert trainer.be.gemm_fallbacks == {"cuBLASLt has no algorithm for tn (test)": 2 * 3}  # 3 Linears, 2 steps
    trainer.close()
    said = [line for line in lines if line.startswith("cuda.gemm")]
    assert said == ["cuda.gemm: step 1 ran a product in the numba kernels: cuBLASLt has no algorithm for tn (test)"]


def test_bf16_rounds_around_the_cublaslt_products(fake, rng):
    """train.precision = "bf16" (cuda/precision.py) rounds each product's inputs and output around whichever
    provider runs it: with cuBLASLt the same bfloat16 values as with the numba kernels (the float32 sums before
    the rounding may differ in their last bits, so an output may land one bfloat16 step away)."""
    from hpctrain.backend.cuda.precision import Bf16CudaBackend

    M, K, N = 6, 9, 5
    x, w, b, dy = rand(rng, M, K), rand(rng, N, K), rand(rng, N), rand(rng, M, N)
    results = []
    for gemm in ("cublaslt", "numba"):
        be = Bf16CudaBackend(gemm=gemm)
        out, dx, dw = be.empty((M, N)), be.empty((M, K)), be.asarray(np.ones((N, K), np.float32))
        be.matmul_nt(be.asarray(x), be.asarray(w), out, bias=be.asarray(b))
        be.matmul_nn(be.asarray(dy), be.asarray(w), dx)
        be.matmul_tn(be.asarray(dy), be.asarray(x), dw, accumulate=True)
        results.append([be.to_host(a) for a in (out, dx, dw)])
    assert [(req.op, req.precision, req.out) for req, _, _ in fake[-1].calls] == [
        ("nt", "bf16", "fp32"), ("nn", "bf16", "fp32"), ("tn", "bf16", "fp32")]  # bf16 operands: tensor cores
    for lt, numba in zip(*results):
        np.testing.assert_allclose(lt, numba, rtol=2 ** -7, atol=1e-6)


def test_bf16_operands_cublaslt_refuses_are_widened_for_the_numba_kernels(fake, rng):
    """A Linear's kept input is bfloat16 words (``product_input``); where cuBLASLt refuses the product, the numba
    kernels get it widened to float32 (``from_bf16``) and compute the bits the numba provider computes."""
    from hpctrain.backend.cuda.precision import Bf16CudaBackend

    M, K, N = 6, 9, 5
    x, w, dy = rand(rng, M, K), rand(rng, N, K), rand(rng, M, N)
    fake.refuse = lambda req: "no algorithm (test)"
    results = []
    for gemm in ("cublaslt", "numba"):
        be = Bf16CudaBackend(gemm=gemm)
        xs = be.product_input(be.asarray(x))
        assert xs.dtype == np.uint16 and be.product_input(xs) is xs
        out, dw = be.empty((M, N)), be.empty((N, K))
        be.matmul_nt(xs, be.asarray(w), out)
        be.matmul_tn(be.asarray(dy), xs, dw)
        results.append([be.to_host(a) for a in (out, dw)])
        if gemm == "cublaslt":
            assert be.gemm_fallbacks == {"no algorithm (test)": 2}
    for refused, numba in zip(*results):
        assert refused.tobytes() == numba.tobytes()


@pytest.mark.parametrize("dropout", [None, 0.3])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_math_attention_runs_as_strided_batched_cublaslt_products(fake, rng, precision, dropout):
    """With cuBLASLt, math attention's products are strided-batched calls over the B·H heads, copied out of qkv
    (and dy) into contiguous heads (attention.py: ``attention_heads``, bfloat16 words in bf16) and back
    (``attention_rows``): two calls forward and four backward, and the same values as the numba kernels' (within
    float32 tolerance; in bf16 within one bfloat16 step, as both round the same values; in tf32 the products are
    TF32 requests, as PyTorch's allow_tf32 makes its attention matmuls, within TF32's rounding of float32)."""
    from hpctrain.backend.cuda.precision import Bf16CudaBackend
    from hpctrain.nn.dropout import DropoutKey

    make = {"fp32": CudaBackend, "bf16": Bf16CudaBackend,
            "tf32": lambda gemm: CudaBackend(gemm=gemm, tf32=True)}[precision]
    B, T, H, hs = 2, 5, 2, 3
    C = H * hs
    qkv, dout = rand(rng, B * T, 3 * C), rand(rng, B * T, C)
    draw = None if dropout is None else DropoutKey(1, 2, 3).attention(dropout, 4, T, 0, H, H)
    results = []
    for gemm in ("cublaslt", "numba"):
        be = make(gemm=gemm)
        out, att, dqkv = be.empty((B * T, C)), be.empty((B, H, T, T)), be.empty((B * T, 3 * C))
        be.attention_forward(be.asarray(qkv), T, H, out, att, dropout=draw)
        be.attention_backward(be.asarray(dout), be.asarray(qkv), att, T, H, dqkv, dropout=draw)
        results.append([be.to_host(a) for a in (out, att, dqkv)])
    want = precision
    assert [(req.op, req.batch, req.M, req.N, req.K, req.precision) for req, _, _ in fake[-1].calls] == [
        ("nt", B * H, T, T, hs, want), ("nn", B * H, T, hs, T, want),  # scores, att·v
        ("nt", B * H, T, T, hs, want), ("tn", B * H, T, hs, T, want),  # datt = dy·vᵀ, dv = attᵀ·dy
        ("nn", B * H, T, hs, T, want), ("tn", B * H, T, hs, T, want)]  # dq = ds·k, dk = dsᵀ·q
    tol = {"fp32": dict(rtol=1e-5, atol=1e-6), "tf32": dict(rtol=2 ** -8, atol=2 ** -8),
           "bf16": dict(rtol=2 ** -6, atol=2 ** -6)}[precision]
    for lt, numba in zip(*results):
        np.testing.assert_allclose(lt, numba, **tol)


def test_bf16_attention_copies_its_kept_qkv_into_heads_as_they_are(fake, rng):
    """Under bf16 attention keeps q, k and v as bfloat16 words; with cuBLASLt the backward copies them into its
    heads as they are (``attention_heads`` on uint16), and dqkv has the bits of the float32 qkv's backward."""
    from hpctrain.backend.cuda.precision import Bf16CudaBackend

    got, want, _ = kept_qkv_backward(Bf16CudaBackend(gemm="cublaslt"), rng)
    assert got.tobytes() == want.tobytes()
    assert [req.precision for req, _, _ in fake[-1].calls] == ["bf16"] * 10


def _gpt_pass(be, L, seed):
    """One forward and backward of a small GPT (L blocks) on ``be``, from ``seed``: (the loss, the gradients, the
    kernels launched in the forward, in the whole pass)."""
    from hpctrain.nn import make_loss
    from hpctrain.nn.gpt import GPTSpec
    from hpctrain.params import FlatBuffer

    spec = GPTSpec(vocab_size=10, block_size=4, n_layer=L, n_head=2, n_embd=8)
    rng = np.random.default_rng(seed)
    idx, targets = rng.integers(0, 10, (2, 4)).astype(np.int64), rng.integers(0, 10, 8).astype(np.int64)
    part = spec.part()
    p, g = FlatBuffer(be, part.layout), FlatBuffer(be, part.layout)
    part.bind(p, g)
    p.load_host_dict(spec.init_params(seed))
    be.launch_trace = []
    h, saved = part.forward(be, be.asarray(idx))
    forward = [name for name, *_ in be.launch_trace]
    value, _, d = make_loss("cross_entropy")(be, h, be.asarray(targets), 1.0 / targets.size)
    part.backward(be, d, saved, need_dinp=False)
    return value, g.to_host_dict(), forward, [name for name, *_ in be.launch_trace]


def _same_bits(a, b) -> bool:
    """Two _gpt_pass results with the same loss and gradients, bit for bit."""
    return a[0] == b[0] and all(a[1][k].tobytes() == b[1][k].tobytes() for k in b[1])


@pytest.mark.parametrize("gemm", ["cublaslt", "numba"])
def test_bf16_products_read_the_weights_from_the_parts_held_copy(fake, gemm):
    """Under bf16 a GPT's forward rounds its flat parameters into the backend's bfloat16 copy once (one ``to_bf16``
    launch) and every Linear product reads its weight's view of it: with cuBLASLt no product rounds its weight
    any more (2·(4·L + 1) - 1 fewer ``to_bf16`` launches a forward and backward than rounding each weight at each
    product), with the numba kernels each widens its view instead of rounding the weight (``from_bf16`` for
    ``round_bf16``). The loss and gradients are the same bits either way."""
    import contextlib

    from hpctrain.backend.cuda.precision import Bf16CudaBackend

    class RoundsEachProduct(Bf16CudaBackend):
        def product_weights(self, data, refresh):
            return contextlib.nullcontext()

    L = 1
    runs = [_gpt_pass(make(gemm=gemm), L, seed=3) for make in (Bf16CudaBackend, RoundsEachProduct)]
    assert _same_bits(*runs)
    held, each = ({k: run[3].count(k) for k in ("to_bf16", "round_bf16", "from_bf16")} for run in runs)
    products = 2 * (4 * L + 1)  # each Linear's and the head's X·Wᵀ and dY·W
    if gemm == "cublaslt":
        assert each["to_bf16"] - held["to_bf16"] == products - 1
    else:
        assert each["round_bf16"] - held["round_bf16"] == products
        assert held["from_bf16"] - each["from_bf16"] == products and held["to_bf16"] == each["to_bf16"] + 1


def test_bf16_layernorms_and_gelu_write_what_the_products_read(fake):
    """Under bf16 a GPT block's two LayerNorms and its GELU, and the head's ln_f, write their outputs as bfloat16
    words (``empty_product_input``) that the next product reads as they are: with cuBLASLt 3·L + 1 fewer
    ``to_bf16`` launches a forward than writing float32 and rounding a copy, and the same loss and gradients."""
    from hpctrain.backend.cuda.precision import Bf16CudaBackend

    class WritesFloat32(Bf16CudaBackend):
        def empty_product_input(self, shape):
            return self.empty(shape)

    L = 2
    fused, rounded = (_gpt_pass(make(gemm="cublaslt"), L, seed=4) for make in (Bf16CudaBackend, WritesFloat32))
    assert _same_bits(fused, rounded)
    assert rounded[2].count("to_bf16") - fused[2].count("to_bf16") == 3 * L + 1


def test_attention_products_cublaslt_refuses_run_in_the_numba_kernels(fake, rng):
    """A strided product the provider refuses runs in tiled.py's batched kernels on the same contiguous heads:
    the same values, the refusals counted."""
    B, T, H, hs = 2, 4, 2, 4
    C = H * hs
    qkv = rand(rng, B * T, 3 * C)
    fake.refuse = lambda req: "no algorithm (test)" if req.batch > 1 else None
    outs = []
    for gemm in ("cublaslt", "numba"):
        be = CudaBackend(gemm=gemm)
        out, att = be.empty((B * T, C)), be.empty((B, H, T, T))
        be.attention_forward(be.asarray(qkv), T, H, out, att)
        outs.append(be.to_host(out))
        if gemm == "cublaslt":
            assert be.gemm_fallbacks == {"no algorithm (test)": 2}
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-7)
