"""train.precision = "bf16" (the CPU reference, hpctrain/backend/cpu/precision.py) against PyTorch's CPU bf16 autocast:
how far each run's parameters land from a float64 PyTorch run of the same model, data and optimizer.

    python bench/bench_precision.py --torch-python /tmp/torchvenv/bin/python            # SGD, 20 steps
    python bench/bench_precision.py --torch-python /tmp/torchvenv/bin/python --optim adamw --lr 3e-3

The model is nanoGPT's GPT (tied head, exact GELU, no dropout) at --n-layer/--n-embd/--n-head/--block-size with a
--vocab token vocabulary, from hpctrain's initialisation; every run takes the same --steps batches (--batch
windows of a fixed Markov chain of tokens, learnable) with the same optimizer in float32 (torch.optim's; hpctrain's
side the same formula in numpy) on float32 master parameters. Runs: PyTorch float64 (the reference), PyTorch
float32, PyTorch bf16 autocast (``torch.autocast("cpu", torch.bfloat16)`` around forward and loss), hpctrain fp32
(CpuBackend) and hpctrain bf16 (Bf16CpuBackend), the last two through hpctrain's GPT part forward/backward and
cross-entropy. PyTorch's attention is the math path (q·kᵀ, masked softmax, att·v: under autocast the products
run in bf16 and softmax in float32, the rounding points of hpctrain's bf16) unless --sdpa, which takes
``F.scaled_dot_product_attention`` (its CPU kernel keeps the scores in float32 inside).

Prints, per run, the largest difference from the float64 run of any tensor relative to that tensor's largest value
(``max``), the same over the whole parameter vector in the 2-norm (``norm``), the final loss and the median step time
(forward and backward only; the CPU reference is not built for speed). Targets (issue 50): hpctrain bf16 within 3×
of PyTorch bf16's distance, and at least 10× hpctrain fp32's. Figures: docs/performance.md, "Precision".
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np


# ---------------------------------------------------------------- the PyTorch side (torch interpreter)

def torch_model(torch, V, T, L, H, C, sdpa):
    nn, F = torch.nn, torch.nn.functional

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)

        def forward(self, x):
            B, T_, _ = x.shape
            q, k, v = (t.view(B, T_, H, C // H).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
            if sdpa:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:  # nanoGPT's slow path
                att = (q @ k.transpose(-2, -1)) * (1.0 / (C // H) ** 0.5)
                mask = torch.ones(T_, T_, dtype=torch.bool).tril()
                y = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1) @ v
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T_, C))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(C), Attention(), nn.LayerNorm(C)
            self.mlp = nn.ModuleDict({"c_fc": nn.Linear(C, 4 * C), "c_proj": nn.Linear(4 * C, C)})

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.ModuleDict({"wte": nn.Embedding(V, C), "wpe": nn.Embedding(T, C),
                                                "h": nn.ModuleList(Block() for _ in range(L)), "ln_f": nn.LayerNorm(C)})
            self.lm_head = nn.Linear(C, V, bias=False)
            self.transformer.wte.weight = self.lm_head.weight

        def forward(self, idx):
            t = self.transformer
            x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1]))
            for block in t.h:
                x = block(x)
            return self.lm_head(t.ln_f(x))

    return GPT()


def torch_worker(setup, out, threads):
    import torch

    torch.set_num_threads(threads)
    with np.load(setup) as f:
        m = json.loads(str(f["meta"]))
        batches, init = f["batches"], {k[2:]: f[k] for k in f.files if k.startswith("p:")}
    results = {}
    for name, dtype, autocast in (("torch fp64", torch.float64, False), ("torch fp32", torch.float32, False),
                                  ("torch bf16 autocast", torch.float32, True)):
        model = torch_model(torch, m["vocab"], m["block_size"], m["n_layer"], m["n_head"], m["n_embd"], m["sdpa"])
        model.load_state_dict({k: torch.from_numpy(v) for k, v in init.items()}, strict=False)
        model.to(dtype)
        opt = (torch.optim.SGD(model.parameters(), lr=m["lr"]) if m["optim"] == "sgd"
               else torch.optim.AdamW(model.parameters(), lr=m["lr"], weight_decay=0.0))
        seconds, loss = [], None
        for windows in batches:
            x, y = torch.from_numpy(windows[:, :-1]), torch.from_numpy(windows[:, 1:])
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, m["vocab"]).float(), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            seconds.append(time.perf_counter() - start)
            opt.step()
        state = {k: v.detach().double().numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        results[name] = (state, float(loss.detach()), float(np.median(seconds)))
    np.savez(out, meta=json.dumps({k: v[1:] for k, v in results.items()} | {"version": torch.__version__}),
             **{f"{run}|{k}": v for run, (state, _, _) in results.items() for k, v in state.items()})


# ---------------------------------------------------------------- the hpctrain side

def markov_batches(V, T, B, steps, seed):
    """``steps`` batches of B windows of T + 1 tokens from a fixed random Markov chain (each token has 3 likely
    successors), so the loss can fall."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, V, (V, 3))
    out = np.empty((steps, B, T + 1), np.int64)
    for s in range(steps):
        for b in range(B):
            tok = rng.integers(V)
            for t in range(T + 1):
                out[s, b, t] = tok
                tok = successors[tok, rng.integers(3)] if rng.random() < 0.9 else rng.integers(V)
    return out


def hpctrain_run(be, spec, init, batches, optim, lr):
    """(final parameters, final loss, median forward+backward seconds) of hpctrain's GPT part on ``be``."""
    from hpctrain.nn import make_loss
    from hpctrain.params import FlatBuffer

    part = spec.part()
    p, g = FlatBuffer(be, part.layout), FlatBuffer(be, part.layout)
    part.bind(p, g)
    params = {k: v.copy() for k, v in init.items()}
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v2 = {k: np.zeros_like(v) for k, v in params.items()}
    loss_fn, seconds, value = make_loss("cross_entropy"), [], None
    for step, windows in enumerate(batches, 1):
        p.load_host_dict(params)
        idx, targets = np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:]).reshape(-1)
        start = time.perf_counter()
        h, saved = part.forward(be, be.asarray(idx))
        value, _, d = loss_fn(be, h, be.asarray(targets), 1.0 / targets.size)
        part.backward(be, d, saved, need_dinp=False)
        seconds.append(time.perf_counter() - start)
        value /= targets.size
        grads = g.to_host_dict()
        for k in params:  # torch.optim's SGD / AdamW (weight decay 0) in float32
            if optim == "sgd":
                params[k] -= np.float32(lr) * grads[k]
                continue
            m[k] = np.float32(0.9) * m[k] + np.float32(0.1) * grads[k]
            v2[k] = np.float32(0.999) * v2[k] + np.float32(0.001) * grads[k] * grads[k]
            denom = np.sqrt(v2[k]) / np.float32(np.sqrt(1 - 0.999 ** step)) + np.float32(1e-8)
            params[k] -= np.float32(lr / (1 - 0.9 ** step)) * m[k] / denom
    return params, float(value), float(np.median(seconds))


def distance(got, want):
    """(largest per-tensor max difference relative to the tensor's largest value, 2-norm over everything)."""
    worst = max(float(np.abs(got[k] - want[k]).max() / np.abs(want[k]).max()) for k in want)
    diff = np.sqrt(sum(float(((got[k] - want[k]) ** 2).sum()) for k in want))
    return worst, diff / np.sqrt(sum(float((want[k] ** 2).sum()) for k in want))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--torch-python", default=os.environ.get("HPCTRAIN_TORCH_PYTHON", "python"))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=65)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--optim", choices=("sgd", "adamw"), default="sgd")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--sdpa", action="store_true", help="PyTorch's attention through scaled_dot_product_attention")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-worker", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(a.threads)
    if a.torch_worker:
        return torch_worker(*a.torch_worker, a.threads)

    from hpctrain.backend.cpu import CpuBackend
    from hpctrain.backend.cpu.precision import Bf16CpuBackend
    from hpctrain.nn.gpt import GPTSpec

    spec = GPTSpec(vocab_size=a.vocab, block_size=a.block_size, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd)
    init = spec.init_params(a.seed)
    batches = markov_batches(a.vocab, a.block_size, a.batch, a.steps, a.seed)
    meta = dict(vocab=a.vocab, block_size=a.block_size, n_layer=a.n_layer, n_head=a.n_head, n_embd=a.n_embd,
                optim=a.optim, lr=a.lr, sdpa=a.sdpa)
    with tempfile.TemporaryDirectory() as tmp:
        np.savez(f"{tmp}/setup.npz", meta=json.dumps(meta), batches=batches, **{f"p:{k}": v for k, v in init.items()})
        proc = subprocess.run([a.torch_python, os.path.abspath(__file__), "--threads", str(a.threads),
                               "--torch-worker", f"{tmp}/setup.npz", f"{tmp}/torch.npz"])
        if proc.returncode:
            raise SystemExit(f"the torch worker ({a.torch_python}) failed with exit status {proc.returncode}")
        with np.load(f"{tmp}/torch.npz") as f:
            tmeta = json.loads(str(f["meta"]))
            runs = {}
            for key in f.files:
                if "|" in key:
                    run, name = key.split("|")
                    runs.setdefault(run, {})[name] = f[key]
    stats = {run: tuple(tmeta[run]) for run in runs}
    for name, be in (("hpctrain fp32", CpuBackend()), ("hpctrain bf16", Bf16CpuBackend())):
        params, loss, seconds = hpctrain_run(be, spec, init, batches, a.optim, a.lr)
        runs[name], stats[name] = params, (loss, seconds)
    exact = runs.pop("torch fp64")
    print(f"GPT V={a.vocab} T={a.block_size} L={a.n_layer} C={a.n_embd} H={a.n_head}, batch {a.batch}, {a.steps} "
          f"{a.optim} steps at lr {a.lr:g}, {'SDPA' if a.sdpa else 'math'} attention in torch "
          f"{tmeta['version']}, {a.threads} thread(s); float64 run's final loss {stats['torch fp64'][0]:.4f}")
    print(f"{'run':<22}{'max':>10}{'norm':>10}{'loss':>9}{'ms/step':>9}")
    dist = {}
    for name in ("torch fp32", "hpctrain fp32", "torch bf16 autocast", "hpctrain bf16"):
        dist[name] = distance(runs[name], exact)
        loss, seconds = stats[name]
        print(f"{name:<22}{dist[name][0]:>10.2e}{dist[name][1]:>10.2e}{loss:>9.4f}{seconds * 1e3:>9.1f}")
    ratio = dist["hpctrain bf16"][1] / dist["torch bf16 autocast"][1]
    rounds = dist["hpctrain bf16"][1] / dist["hpctrain fp32"][1]
    print(f"hpctrain bf16 / torch bf16 distance (norm): {ratio:.2f} (target <= 3); hpctrain bf16 / hpctrain fp32: "
          f"{rounds:.0f} (target >= 10)")


if __name__ == "__main__":
    sys.exit(main())
