"""Every op of the backend contract with arguments that fit, for tests that break one argument at a time.

    for op, arrays, call in contract_cases():   # arrays: name -> a host array that fits
        call(backend, {name: backend.asarray(a) for name, a in arrays.items()})

tests/test_backend_contract.py runs ``OPS``/``CASES`` through ``runs_as_given`` and ``refuses_grown`` on the
CPU backend, tests/cuda/test_cuda_contract.py on the CUDA backend: each array argument one row (or column)
too big must raise BackendError naming the op.
"""

import numpy as np
import pytest

from hpctrain.backend.dropout_mask import DropRows
from hpctrain.errors import BackendError

B, T, H, HS, V, C, K, N = 2, 3, 2, 2, 5, 4, 3, 6  # C = H·HS


def _f(*shape):
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def contract_cases():
    """(op, {argument: host array}, call(be, device arrays)) for every op that takes arrays of related shapes."""
    ids = np.random.default_rng(1).integers(0, V, (B, T)).astype(np.int64)
    targets = np.random.default_rng(2).integers(0, C, B * T).astype(np.int64)
    unary = [(f"{k}_forward", {"x": _f(B, C), "out": _f(B, C)},
              lambda be, a, k=k: getattr(be, f"{k}_forward")(a["x"], a["out"])) for k in ("relu", "gelu", "tanh")]
    binary = [(f"{k}_backward", {x: _f(B, C), "dout": _f(B, C), "dinp": _f(B, C)},  # tanh's takes its output y
               lambda be, a, k=k, x=x: getattr(be, f"{k}_backward")(a[x], a["dout"], a["dinp"]))
              for k, x in (("relu", "x"), ("gelu", "x"), ("tanh", "y"))]
    return unary + binary + [
        ("matmul_nt", {"a": _f(B, K), "b": _f(N, K), "out": _f(B, N), "bias": _f(N)},
         lambda be, a: be.matmul_nt(a["a"], a["b"], a["out"], bias=a["bias"])),
        ("matmul_nn", {"a": _f(B, K), "b": _f(K, N), "out": _f(B, N)},
         lambda be, a: be.matmul_nn(a["a"], a["b"], a["out"])),
        ("matmul_tn", {"a": _f(B, K), "b": _f(B, N), "out": _f(K, N)},
         lambda be, a: be.matmul_tn(a["a"], a["b"], a["out"])),
        ("bias_grad", {"dout": _f(B, C), "dbias": _f(C)}, lambda be, a: be.bias_grad(a["dout"], a["dbias"])),
        ("add_", {"out": _f(B, C), "x": _f(B, C)}, lambda be, a: be.add_(a["out"], a["x"])),
        ("dropout", {"x": _f(B, C), "out": _f(B, C)}, lambda be, a: be.dropout(a["x"], a["out"], DropRows(0.5, 3))),
        ("layernorm_forward", {"x": _f(B, C), "weight": _f(C), "bias": _f(C), "out": _f(B, C), "mean": _f(B),
                               "rstd": _f(B)},
         lambda be, a: be.layernorm_forward(a["x"], a["weight"], a["bias"], 1e-5, a["out"], a["mean"], a["rstd"])),
        ("layernorm_backward", {"dout": _f(B, C), "x": _f(B, C), "weight": _f(C), "mean": _f(B),
                                "rstd": np.abs(_f(B)) + 1, "dinp": _f(B, C), "dweight": _f(C), "dbias": _f(C)},
         lambda be, a: be.layernorm_backward(a["dout"], a["x"], a["weight"], a["mean"], a["rstd"], a["dinp"],
                                             a["dweight"], a["dbias"])),
        ("residual_layernorm_forward", {"x": _f(B, C), "residual": _f(B, C), "weight": _f(C), "bias": _f(C),
                                        "out": _f(B, C), "mean": _f(B), "rstd": _f(B)},
         lambda be, a: be.residual_layernorm_forward(a["x"], a["residual"], a["weight"], a["bias"], 1e-5, a["out"],
                                                     a["mean"], a["rstd"])),
        ("residual_layernorm_backward", {"dout": _f(B, C), "dresidual": _f(B, C), "x": _f(B, C), "weight": _f(C),
                                         "mean": _f(B), "rstd": np.abs(_f(B)) + 1, "dinp": _f(B, C),
                                         "dweight": _f(C), "dbias": _f(C)},
         lambda be, a: be.residual_layernorm_backward(a["dout"], a["dresidual"], a["x"], a["weight"], a["mean"],
                                                      a["rstd"], a["dinp"], a["dweight"], a["dbias"])),
        ("cross_entropy", {"logits": _f(B * T, C), "targets": targets, "dlogits": _f(B * T, C)},
         lambda be, a: be.cross_entropy(a["logits"], a["targets"], a["dlogits"], 0.5)),
        ("ce_shard_stats", {"logits": _f(B * T, C), "targets": targets, "mx": _f(B * T),
                            "arg": np.zeros(B * T, np.int64), "tlogit": _f(B * T)},
         lambda be, a: be.ce_shard_stats(a["logits"], a["targets"], a["mx"], a["arg"], a["tlogit"], vocab_start=1,
                                         vocab=C + 2)),
        ("ce_shard_sumexp", {"logits": _f(B * T, C), "mx": _f(B * T), "sumexp": np.zeros(B * T)},
         lambda be, a: be.ce_shard_sumexp(a["logits"], a["mx"], a["sumexp"])),
        ("ce_shard_grad", {"logits": _f(B * T, C), "targets": targets, "logz": np.ones(B * T),
                           "dlogits": _f(B * T, C)},
         lambda be, a: be.ce_shard_grad(a["logits"], a["targets"], a["logz"], a["dlogits"], 0.5, vocab_start=1,
                                        vocab=C + 2)),
        ("mse", {"pred": _f(B, C), "target": _f(B, C), "dpred": _f(B, C)},
         lambda be, a: be.mse(a["pred"], a["target"], a["dpred"], 0.5)),
        ("sgd_update", {"param": _f(N), "grad": _f(N), "momentum_buf": _f(N)},
         lambda be, a: be.sgd_update(a["param"], a["grad"], a["momentum_buf"], lr=0.1, momentum=0.9,
                                     weight_decay=0.0, nesterov=False)),
        ("adam_update", {"param": _f(N), "grad": _f(N), "exp_avg": _f(N), "exp_avg_sq": np.abs(_f(N))},
         lambda be, a: be.adam_update(a["param"], a["grad"], a["exp_avg"], a["exp_avg_sq"], lr=0.1, beta1=0.9,
                                      beta2=0.999, eps=1e-8, weight_decay=0.0, step=1, decoupled=True)),
        ("embedding_forward", {"idx": ids, "wte": _f(V, C), "wpe": _f(T, C), "out": _f(B * T, C)},
         lambda be, a: be.embedding_forward(a["idx"], a["wte"], a["wpe"], a["out"])),
        ("embedding_backward", {"dout": _f(B * T, C), "idx": ids, "dwte": _f(V, C), "dwpe": _f(T, C)},
         lambda be, a: be.embedding_backward(a["dout"], a["idx"], a["dwte"], a["dwpe"])),
        ("attention_forward", {"qkv": _f(B * T, 3 * C), "out": _f(B * T, C), "att": _f(B, H, T, T)},
         lambda be, a: be.attention_forward(a["qkv"], T, H, a["out"], a["att"])),
        ("attention_backward", {"dout": _f(B * T, C), "qkv": _f(B * T, 3 * C), "att": _f(B, H, T, T),
                                "dqkv": _f(B * T, 3 * C)},
         lambda be, a: be.attention_backward(a["dout"], a["qkv"], a["att"], T, H, a["dqkv"])),
        ("flash_attention_forward", {"qkv": _f(B * T, 3 * C), "out": _f(B * T, C), "lse": _f(B, H, T)},
         lambda be, a: be.flash_attention_forward(a["qkv"], T, H, a["out"], a["lse"])),
        ("flash_attention_backward", {"dout": _f(B * T, C), "qkv": _f(B * T, 3 * C), "out": _f(B * T, C),
                                      "lse": _f(B, H, T), "dqkv": _f(B * T, 3 * C)},
         lambda be, a: be.flash_attention_backward(a["dout"], a["qkv"], a["out"], a["lse"], T, H, a["dqkv"])),
    ]


# arguments whose number of rows is free (any batch, a vocabulary, a position table at least T long): made
# wrong by one more column instead
FREE_ROWS = {("bias_grad", "dout"), ("embedding_forward", "wte"), ("embedding_forward", "wpe"),
             ("embedding_backward", "dwte"), ("embedding_backward", "dwpe")}


def grown(op, name, arr):
    """``arr`` one row (or, where rows are free, one column; 1-D: one element) too big: the wrong argument."""
    axis = -1 if (op, name) in FREE_ROWS else 0
    return np.concatenate([arr, arr[:1] if axis == 0 else arr[..., :1]], axis=axis)


def _case(op):
    ((arrays, call),) = [(a, c) for o, a, c in contract_cases() if o == op]
    return arrays, call


OPS = [op for op, _, _ in contract_cases()]
CASES = [(op, name) for op, arrays, _ in contract_cases() for name in arrays]
CASE_IDS = [f"{op}-{name}" for op, name in CASES]


def runs_as_given(be, op):
    arrays, call = _case(op)
    call(be, {k: be.asarray(v.copy()) for k, v in arrays.items()})


def refuses_grown(be, op, name):
    arrays, call = _case(op)
    args = {k: be.asarray(grown(op, k, v) if k == name else v.copy()) for k, v in arrays.items()}
    with pytest.raises(BackendError, match=f"^{op}: "):
        call(be, args)


IDS = ("idx", "targets")  # token ids and class targets: a step keeps them in host memory (backend/base.py)


def refuses_host(be, op, name):
    """A device backend: the argument ``name`` left in host memory is refused, naming it; token ids and class
    targets are taken from the host instead (the backend checks and uploads them)."""
    arrays, call = _case(op)
    args = {k: (v.copy() if k == name else be.asarray(v.copy())) for k, v in arrays.items()}
    if name in IDS and arrays[name].dtype == np.int64:
        call(be, args)
        return
    with pytest.raises(BackendError, match=f"^{op}: {name} must be a device array"):
        call(be, args)
