"""bench/gemm_grids.py's list of a GPT step's GEMMs is the list a real step asks its backend for, and at the
shapes docs/gpu.md reports every product fills a wave of an H100 or is under 1% of the step's FLOPs."""

import collections
import importlib.util
import os
import sys

from helpers import gpt_config, make_tokens
from hpctrain.parallel.mesh import Mesh
from hpctrain.train import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location("gemm_grids", os.path.join(ROOT, "bench", "gemm_grids.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def _recorded_products(trainer, bench):
    """(layout, M, N, K, Z) of every product one training step asks for, attention expanded as CudaBackend runs
    it (two batched products forward, four backward)."""
    be, seen = trainer.be, collections.Counter()
    shapes = {"matmul_nt": lambda a, b: (a.shape[0], b.shape[0], a.shape[1]),
              "matmul_nn": lambda a, b: (a.shape[0], b.shape[1], a.shape[1]),
              "matmul_tn": lambda a, b: (a.shape[1], b.shape[1], a.shape[0])}

    def recording(op):
        plain = getattr(be, op)

        def call(*args, **kw):
            if op in shapes:
                seen[(op[-2:], *shapes[op](args[0], args[1]), 1)] += 1
            else:  # attention_forward(qkv, T, n_head, ...) / attention_backward(dout, qkv, att, T, n_head, dqkv)
                qkv, T, H = (args[0], args[1], args[2]) if op == "attention_forward" else (args[1], args[3], args[4])
                B, C = qkv.shape[0] // T, qkv.shape[1] // 3
                products = bench.attention_products(B, T, H, C // H)
                for p in products[:2] if op == "attention_forward" else products[2:]:
                    seen[(p.layout, p.M, p.N, p.K, p.Z)] += 1
            return plain(*args, **kw)

        setattr(be, op, call)

    for op in (*shapes, "attention_forward", "attention_backward"):
        recording(op)
    trainer.train_step(0, 0.01)
    return seen


def test_the_listed_products_are_the_model_s(tmp_path):
    bench = _bench()
    make_tokens(tmp_path / "t.h5", n=400)
    cfg = gpt_config(tmp_path / "t.h5", model={"n_layer": 2, "n_head": 2, "n_embd": 8, "block_size": 8},
                     data={"val_fraction": 0.0}, train={"steps": 1, "batch_size": 3})
    mesh = Mesh()
    trainer = Trainer(cfg, mesh=mesh, log=lambda *a: None)
    try:
        seen = _recorded_products(trainer, bench)
    finally:
        trainer.close()
        mesh.free()
    listed = collections.Counter((p.layout, p.M, p.N, p.K, p.Z)
                                 for p in bench.gpt_products(B=3, T=8, C=8, H=2, V=12, L=2))
    assert seen == listed


def test_every_product_fills_a_wave_or_is_negligible(capsys):
    bench = _bench()
    bench.main([])
    assert capsys.readouterr().out.rstrip().endswith("0 products under one wave with 1% or more of their step's FLOPs")
