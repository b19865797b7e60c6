"""The launch grid of every GEMM of one GPT training step, against a GPU's streaming multiprocessors.

    python bench/gemm_grids.py                 # gpt-char (jobs/configs/gpt-char.toml) and GPT-2 small, H100 (132 SMs)
    python bench/gemm_grids.py --sms 108       # an A100
    python bench/gemm_grids.py --markdown      # the tables in docs/gpu.md

No GPU needed: the grids are what CudaBackend launches (cuda_gemm.choose_tile, k_splits, the attention's
batched products with grid.z over batch × head), computed for each product of one micro-batch's forward and
backward pass. The list of products comes from the model's layers (``gpt_products``); tests/test_gemm_grids.py
checks it against the products a real training step asks its backend for. A product passes when its grid
makes at least one wave (a block per SM) or it carries under 1% of the step's GEMM FLOPs.

Figure: the launch grid of every GEMM of a GPT step against the SMs (--markdown: the tables in docs/gpu.md);
docs/performance.md, "GEMM" (every run behind it: docs/performance-log.md).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hpctrain.backend.cuda.gemm.tiled import (GPU_SMALL_TILE, GPU_TILES, GPU_TN_TILES, choose_tile, grid_blocks,  # noqa: E402
                                        k_splits)

H100_SMS = 132
ATTENTION_TILE = GPU_SMALL_TILE  # CudaBackend's batched attention products use the 64×64 tiling


@dataclass(frozen=True)
class Product:
    """One GEMM: out[M, N] = op(a)·op(b), K deep, Z times (attention's batch × heads); ``causal``: about half of
    the tiles do work (the others are skipped or cut short)."""

    name: str
    layout: str  # nt, nn or tn (backend/cuda/__init__.py)
    M: int
    N: int
    K: int
    Z: int = 1
    causal: bool = False

    @property
    def flops(self) -> float:
        return 2.0 * self.M * self.N * self.K * self.Z * (0.5 if self.causal else 1.0)


def linear_products(name: str, rows: int, n_in: int, n_out: int, *, need_dinp: bool = True) -> list[Product]:
    """A Linear(n_in, n_out) on ``rows`` rows: X·Wᵀ, then dY·W (unless it is the first layer) and dYᵀ·X."""
    out = [Product(f"{name} forward", "nt", rows, n_out, n_in)]
    if need_dinp:
        out.append(Product(f"{name} input grad", "nn", rows, n_in, n_out))
    out.append(Product(f"{name} weight grad", "tn", n_out, n_in, rows))
    return out


def attention_products(B: int, T: int, H: int, hs: int) -> list[Product]:
    """CudaBackend.attention_forward/backward: two batched products forward, four backward."""
    Z = B * H
    return [Product("attention q·kᵀ", "nt", T, T, hs, Z, True), Product("attention att·v", "nn", T, hs, T, Z, True),
            Product("attention dy·vᵀ", "nt", T, T, hs, Z, True), Product("attention ds·k", "nn", T, hs, T, Z, True),
            Product("attention dsᵀ·q", "tn", T, hs, T, Z, True), Product("attention attᵀ·dy", "tn", T, hs, T, Z, True)]


def gpt_products(*, B: int, T: int, C: int, H: int, V: int, L: int) -> list[Product]:
    """Every GEMM of one forward and backward pass of nanoGPT's GPT on B×T tokens (n_embd C, n_head H,
    vocabulary V, L blocks): per block c_attn, attention, c_proj, c_fc, mlp c_proj; then the head tied to wte."""
    rows, products = B * T, []
    for layer in range(L):
        products += linear_products(f"block {layer} c_attn", rows, C, 3 * C)
        products += attention_products(B, T, H, C // H)
        products += linear_products(f"block {layer} attn c_proj", rows, C, C)
        products += linear_products(f"block {layer} c_fc", rows, C, 4 * C)
        products += linear_products(f"block {layer} mlp c_proj", rows, 4 * C, C)
    products += linear_products("head (tied wte)", rows, C, V)
    return products


def grid(product: Product, sms: int) -> tuple[int, str]:
    """(blocks launched, how) for ``product`` on a GPU with ``sms`` SMs, as CudaBackend chooses."""
    if product.Z > 1:
        return grid_blocks(ATTENTION_TILE, product.M, product.N) * product.Z, "64×64, grid.z = B·H"
    tile = choose_tile(GPU_TN_TILES if product.layout == "tn" else GPU_TILES, sms, product.M, product.N)
    splits = k_splits(tile, sms, product.M, product.N, product.K) if product.layout == "tn" else 1
    how = f"{tile.BM}×{tile.BN}" + (f", split-K {splits}" if splits > 1 else "")
    return grid_blocks(tile, product.M, product.N) * splits, how


def report(title: str, products: list[Product], sms: int, markdown: bool) -> int:
    """Print one table (distinct shapes once, with their count); returns the number of products that fail."""
    total = sum(p.flops for p in products)
    rows, failed = {}, 0
    for p in products:
        key = (p.name.split(" ", 2)[-1] if p.name.startswith("block") else p.name, p.layout, p.M, p.N, p.K, p.Z)
        rows.setdefault(key, []).append(p)
    print(f"\n{title}: {len(products)} GEMMs, {total / 1e9:.2f} GFLOP per micro-batch, {sms} SMs\n")
    head = ("product", "layout", "M×N×K", "Z", "count", "tiling", "blocks", "waves", "FLOP share", "ok")
    if markdown:
        print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    else:
        print("{:<22} {:<6} {:>18} {:>6} {:>5} {:<20} {:>8} {:>6} {:>10} {:>4}".format(*head))
    for (name, layout, M, N, K, Z), same in rows.items():
        blocks, how = grid(same[0], sms)
        share = sum(p.flops for p in same) / total
        ok = blocks >= sms or share < 0.01
        failed += 0 if ok else len(same)
        cells = (name, layout, f"{M}×{N}×{K}", str(Z), str(len(same)), how, str(blocks), f"{blocks / sms:.1f}",
                 f"{share:.1%}", "yes" if ok else "NO")
        if markdown:
            print("| " + " | ".join(cells) + " |")
        else:
            print("{:<22} {:<6} {:>18} {:>6} {:>5} {:<20} {:>8} {:>6} {:>10} {:>4}".format(*cells))
    return failed


def gpt_char() -> dict:
    """gpt-char.toml's model and one micro-batch of its batch."""
    from hpctrain.config import load_config

    cfg = load_config(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs", "configs",
                                   "gpt-char.toml"))
    m = cfg.model
    return dict(B=cfg.train.batch_size // cfg.train.micro_batches, T=m.block_size, C=m.n_embd, H=m.n_head,
                V=m.vocab_size, L=m.n_layer)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sms", type=int, default=H100_SMS, help="streaming multiprocessors (H100 SXM: 132)")
    ap.add_argument("--markdown", action="store_true", help="markdown tables")
    args = ap.parse_args(argv)
    failed = report("gpt-char (jobs/configs/gpt-char.toml)", gpt_products(**gpt_char()), args.sms, args.markdown)
    failed += report("GPT-2 small (n_embd 768, 12 heads, 12 layers, T 1024, B 8, V 50304)",
                     gpt_products(B=8, T=1024, C=768, H=12, V=50304, L=12), args.sms, args.markdown)
    print(f"\n{failed} products under one wave with 1% or more of their step's FLOPs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
