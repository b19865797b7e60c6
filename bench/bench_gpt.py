"""hpctrain's GPT training step against the same model in plain PyTorch: tokens/s.

    python bench/bench_gpt.py --torch-python /tmp/torchvenv/bin/python   # gpt-char.toml's model, batch 32, 1 thread
    python bench/bench_gpt.py --backend cuda --n-layer 6 --n-embd 384 --n-head 6 --block-size 256 --batch 64
                                                          # on a GPU: hpctrain's CUDA backend against torch on cuda
    python bench/bench_gpt.py --threads 2 --n-layer 6 --n-embd 192 --block-size 128 --batch 16
    python bench/bench_gpt.py --backend cuda --precision bf16             # train.precision = "bf16" against
                                                          # torch's bf16 autocast (tf32: TF32 against TF32)
    HPCTRAIN_TORCH_PYTHON=/path/to/python python bench/bench_gpt.py       # the peer's interpreter (default: python)

Model, AdamW settings and grad clip come from jobs/configs/gpt-char.toml (or --config). hpctrain runs the real
``Trainer.train_step`` over a one-rank Mesh (HDF5 read, forward, loss, backward, norm and clipping, AdamW) on
the bundled pydoc corpus in a temporary token file. PyTorch runs in a subprocess of the torch interpreter,
driven over a pipe: nanoGPT's module (SDPA with is_causal, exact GELU, tied lm_head, no dropout) and
torch.optim.AdamW decaying the tensors hpctrain's AdamW decays (optim.decay_min_ndim: 2 in gpt-char.toml,
nanoGPT's two parameter groups; 0 every tensor),
reading the same windows of the same file each step. Both use --threads threads. The torch model first loads
hpctrain's initial parameters by name and both take 3 identical steps (losses and the largest relative
parameter difference are printed); then warm-up, then --repeats rounds of --steps steps, alternating which
goes first. Prints the median tokens/s of each. Targets: hpctrain / PyTorch >= 1.0 on the CPU,
>= 0.5 against PyTorch eager fp32 on a GPU (--backend cuda: both on the GPU; loss.item() synchronises each step).
Where the interpreter has no torch, the peer is skipped with a message.

Figure: GPT tokens/s, hpctrain / PyTorch eager, on the CPU and (--backend cuda) on a GPU; docs/performance.md, "CPU
step" and "GPU step" (every run behind it: docs/performance-log.md).
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIG = os.path.join(HERE, "..", "jobs", "configs", "gpt-char.toml")
CHECK_STEPS = 3
MODEL_KEYS = ("n_layer", "n_embd", "n_head", "block_size")


# ---------------------------------------------------------------- the PyTorch side (torch interpreter)

def torch_gpt(torch, V, T, L, H, C, p=0.0):
    """nanoGPT's GPT (bias = True) with its parameter names; lm_head tied to wte; dropout ``p`` where nanoGPT
    drops (the embedding, SDPA's dropout_p on the probabilities, both residual branches), in training."""
    nn, F = torch.nn, torch.nn.functional

    class CausalSelfAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_attn, self.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)

        def forward(self, x):
            B, T_, _ = x.shape
            q, k, v = (t.view(B, T_, H, C // H).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p if self.training else 0.0)
            return F.dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T_, C)), p, self.training)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(C), CausalSelfAttention(), nn.LayerNorm(C)
            self.mlp = nn.ModuleDict({"c_fc": nn.Linear(C, 4 * C), "c_proj": nn.Linear(4 * C, C)})

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + F.dropout(self.mlp.c_proj(F.gelu(self.mlp.c_fc(self.ln_2(x)))), p, self.training)  # exact GELU

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.ModuleDict({"wte": nn.Embedding(V, C), "wpe": nn.Embedding(T, C),
                                                "h": nn.ModuleList(Block() for _ in range(L)), "ln_f": nn.LayerNorm(C)})
            self.lm_head = nn.Linear(C, V, bias=False)
            self.transformer.wte.weight = self.lm_head.weight

        def forward(self, idx):
            t = self.transformer
            x = F.dropout(t.wte(idx) + t.wpe(torch.arange(idx.shape[1], device=idx.device)), p, self.training)
            for block in t.h:
                x = block(x)
            return self.lm_head(t.ln_f(x))

    return GPT()


def torch_setup(torch, np, h5py, setup):
    """The torch model with hpctrain's initial parameters, and ``step(s)``: one training step on batch s."""
    with np.load(setup) as f:
        m = json.loads(str(f["meta"]))
        rows, init = f["rows"], {k[2:]: torch.from_numpy(f[k]) for k in f.files if k.startswith("p:")}
    V, T = m["vocab_size"], m["block_size"]
    device = m.get("device", "cpu")
    precision = m.get("precision", "fp32")
    if device == "cuda":  # float32 products as written, unless --tf32 (NVIDIA_TF32_OVERRIDE=0 still forces them off)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = bool(m.get("tf32")) or \
            precision == "tf32"
    # --precision bf16: the forward and the loss under bf16 autocast, fp32 master weights (what hpctrain's matches)
    autocast = (lambda: torch.autocast(device, dtype=torch.bfloat16)) if precision == "bf16" else contextlib.nullcontext
    model = torch_gpt(torch, V, T, m["n_layer"], m["n_head"], m["n_embd"], m.get("dropout", 0.0))
    missing, unexpected = model.load_state_dict(init, strict=False)
    if missing != ["lm_head.weight"] or unexpected:  # lm_head.weight is wte.weight: loaded with it
        raise SystemExit(f"torch worker: the names differ: missing {missing}, unexpected {unexpected}")
    model.to(device)
    # optim.decay_min_ndim: 0 decays every tensor (one group), 2 only the matrices (nanoGPT's two groups)
    ndim = m.get("decay_min_ndim", 0)
    groups = [{"params": [p for p in model.parameters() if p.dim() >= ndim], "weight_decay": m["weight_decay"]},
              {"params": [p for p in model.parameters() if p.dim() < ndim], "weight_decay": 0.0}]
    opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=m["lr"], betas=m["betas"], eps=m["eps"])
    tokens = h5py.File(m["path"], "r", locking=False)[m["tokens"]]

    def step(s):
        windows = np.stack([tokens[r * T : r * T + T + 1] for r in rows[s]]).astype(np.int64)  # as hpctrain reads
        x, y = torch.from_numpy(windows[:, :-1]).to(device), torch.from_numpy(windows[:, 1:]).to(device)
        with autocast():
            loss = torch.nn.functional.cross_entropy(model(x).view(-1, V).float(), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if m["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), m["grad_clip"])
        opt.step()
        return loss.item()

    return model, step


def torch_worker(threads):
    """Line protocol on stdin/stdout: ``setup FILE``, ``run A B`` (steps A..B-1: seconds, first loss), ``save FILE``."""
    try:
        import h5py
        import numpy as np
        import torch
    except ImportError as e:
        print(f"missing {e.name}", flush=True)
        return
    torch.set_num_threads(threads)
    print(f"ready {torch.__version__}", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "setup":
            model, step = torch_setup(torch, np, h5py, args[0])
            print("ok", flush=True)
        elif cmd == "run":
            t0 = time.perf_counter()
            losses = [step(s) for s in range(int(args[0]), int(args[1]))]
            print(f"{time.perf_counter() - t0} {losses[0]}", flush=True)
        elif cmd == "save":
            np.savez(args[0], **{k: v.detach().cpu().numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"})
            print("ok", flush=True)


class TorchPeer:
    """The worker subprocess; ``version`` is None (and ``why`` says why) when it could not start."""

    def __init__(self, python, threads):
        self.version, self.why = None, ""
        try:
            self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--torch-worker", "--threads",
                                          str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        except OSError as e:
            self.why = f"cannot run {python}: {e.strerror}"
            return
        first = self.proc.stdout.readline().split()
        if first[:1] == ["ready"]:
            self.version = first[1]
        else:
            status = self.proc.wait()
            self.why = f"{python} has no {first[1]}" if first[:1] == ["missing"] else f"{python} exited ({status})"

    def ask(self, line):
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise SystemExit(f"the torch worker stopped (exit status {self.proc.wait()}) after {line!r}")
        return answer.split()

    def run(self, a, b):
        seconds, loss = self.ask(f"run {a} {b}")
        return float(seconds), float(loss)

    def close(self):
        if self.version:
            self.proc.stdin.close()
            self.proc.wait()


# ---------------------------------------------------------------- hpctrain's side and the comparison

def make_trainer(a, path):
    """A Trainer over a one-rank Mesh for --config with the overrides; data.corpus writes ``path`` on first use."""
    from hpctrain.config import load_config
    from hpctrain.parallel.mesh import Mesh
    from hpctrain.train import Trainer

    sets = [f"data.path={json.dumps(path)}", 'data.corpus="pydoc"', f"train.batch_size={a.batch}",
            f'train.backend="{a.backend}"', 'train.metrics=""', "train.eval_every=0", 'checkpoint.dir=""',
            'checkpoint.resume="never"']
    sets += [f"model.{k}={getattr(a, k)}" for k in MODEL_KEYS if getattr(a, k) is not None]
    sets += [f"model.dropout={a.dropout}"] if a.dropout is not None else []
    sets += [f'model.attention="{a.attention}"'] if a.attention else []
    sets += [f'train.precision="{a.precision}"'] if a.precision else []
    sets += a.set  # any other setting, e.g. --set cuda.arena=false
    mesh = Mesh()
    return mesh, Trainer(load_config(a.config, sets), mesh=mesh, log=lambda *args: None)


def check(trainer, init, runs, peer, tmp):
    """CHECK_STEPS steps of each from the same parameters on the same batches: losses, then parameter differences."""
    import numpy as np

    def max_rel_diff(got, want):  # (worst max|got - want| / max|want| over the tensors, its name)
        return max((float(np.abs(got[n] - want[n]).max() / max(float(np.abs(want[n]).max()), 1e-30)), n) for n in want)

    losses = {who: [run(s, s + 1)[1] for s in range(CHECK_STEPS)] for who, run in runs.items()}
    if peer.version is None:
        return
    if trainer.cfg.model.dropout:  # each draws its own masks: the runs differ by design
        print(f"check skipped: model.dropout = {trainer.cfg.model.dropout:g} draws other masks than torch's; loss of "
              f"steps 1..{CHECK_STEPS}: " + ", ".join(f"{who} " + " ".join(f"{x:.6f}" for x in v)
                                                      for who, v in losses.items()))
        return
    peer.ask(f"save {tmp}/torch.npz")
    with np.load(f"{tmp}/torch.npz") as f:
        theirs = {k: f[k] for k in f.files}
    ours = trainer.state_dict()[0]
    dp, dp_name = max_rel_diff(ours, theirs)
    du, du_name = max_rel_diff({k: ours[k] - init[k] for k in init}, {k: theirs[k] - init[k] for k in init})
    print(f"check, same initial parameters and batches: loss of steps 1..{CHECK_STEPS}: "
          + ", ".join(f"{who} " + " ".join(f"{x:.6f}" for x in v) for who, v in losses.items()))
    print(f"  after {CHECK_STEPS} AdamW steps, max relative difference: parameters {dp:.2e} ({dp_name}), "
          f"updates {du:.2e} ({du_name})")


def profile_kernels(run, steps, top=30):
    """GPU time per kernel over ``run()`` (``steps`` training steps), read through CUPTI by torch.profiler, which
    sees every kernel of the process, numba's too; then the kernels' total against the wall-clock time."""
    try:
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        print("profile: this interpreter has no torch; skipped")
        return
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        seconds = run()[0]
    rows = []
    for e in prof.key_averages():
        device_us = getattr(e, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(e, "self_cuda_time_total", 0)
        rows.append((device_us, e.count, e.key, getattr(e, "cpu_time_total", 0)))
    kernels = sorted((r for r in rows if r[0] > 0), reverse=True)
    busy = sum(r[0] for r in kernels) / 1e6
    print(f"profile over {steps} steps: wall {seconds / steps * 1e3:.2f} ms/step, GPU busy {busy / steps * 1e3:.2f} "
          f"ms/step ({busy / seconds:.0%}), {sum(r[1] for r in kernels) / steps:.0f} kernels/step")
    for us, count, name, _ in kernels[:top]:
        print(f"  {us / steps / 1e3:8.3f} ms/step {us / 1e6 / busy:6.1%} {count / steps:6.1f}/step  {name[:90]}")
    waits = [(count, name, cpu_us) for _, count, name, cpu_us in rows if "ynchronize" in name or "Memcpy" in name]
    for count, name, cpu_us in sorted(waits, reverse=True)[:8]:
        print(f"  host: {count / steps:6.1f}/step {cpu_us / steps / 1e3:8.3f} ms/step  {name[:70]}")


def profile_host(run, steps, top=40):
    """Where the host's time goes over ``steps`` of hpctrain's steps (cProfile): on a GPU, the launch path."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    seconds = run()[0]
    prof.disable()
    print(f"host profile over {steps} steps: {seconds / steps * 1e3:.2f} ms/step (cProfile's own cost included)")
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=sys.stdout).sort_stats(key).print_stats(top)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=CONFIG, help="a kind = \"gpt\" config (default: jobs/configs/gpt-char.toml)")
    for key in MODEL_KEYS:
        p.add_argument("--" + key.replace("_", "-"), type=int, help=f"override model.{key}")
    p.add_argument("--dropout", type=float, help="override model.dropout (both sides drop where nanoGPT does; the "
                   "masks differ, so the equality check is skipped)")
    p.add_argument("--attention", choices=("math", "flash"), help="override model.attention (torch's side is SDPA "
                   "either way)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--backend", choices=("cpu", "cuda"), default="cpu", help="hpctrain's backend and torch's device")
    p.add_argument("--steps", type=int, default=10, help="steps per timed round")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds of each")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tf32", action="store_true", help="PyTorch on a GPU may use TF32 for its float32 products")
    p.add_argument("--precision", choices=("fp32", "tf32", "bf16"),
                   help="train.precision for hpctrain, the matching setting for PyTorch (bf16: autocast on the "
                        "forward and the loss; tf32: TF32 products)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="on a GPU: after timing, GPU time per kernel over STEPS of hpctrain's steps (torch.profiler)")
    p.add_argument("--host-profile", type=int, default=0, metavar="STEPS",
                   help="after timing, the host's time per function over STEPS of hpctrain's steps (cProfile)")
    p.add_argument("--torch-python", default=os.environ.get("HPCTRAIN_TORCH_PYTHON", "python"))
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="another setting for hpctrain's side, as hpctrain train --set takes it (repeatable)")
    p.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(a.threads)  # before numpy, hpctrain or torch loads its BLAS
    if a.torch_worker:
        return torch_worker(a.threads)
    peer = TorchPeer(a.torch_python, a.threads)  # started before this process initialises MPI
    import numba
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        mesh, trainer = make_trainer(a, f"{tmp}/pydoc.h5")
        cfg, B = trainer.cfg, a.batch
        m, o, T = cfg.model, cfg.optim, cfg.model.block_size
        warm_end = CHECK_STEPS + a.warmup
        init = {k: np.array(v) for k, v in trainer.state_dict()[0].items()}
        print(f"GPT n_layer {m.n_layer}, n_head {m.n_head}, n_embd {m.n_embd}, block_size {T}, vocab {m.vocab_size} "
              f"({trainer.model.layout.size:,} parameters); batch {B} x {T} = {B * T:,} tokens a step; AdamW lr "
              f"{o.lr:g} betas {tuple(o.betas)} weight decay {o.weight_decay:g}, grad clip {cfg.train.grad_clip:g}; "
              f"{a.threads} thread(s)")

        last_step = {}

        def hpctrain_run(first, last):
            """Steps as ``Trainer.run`` takes them: a GPU step's loss and norm are read at the next step's
            optimizer (train/step.py), the last one's at the end."""
            t0 = time.perf_counter()
            outs = [trainer.runner.train_step(s, o.lr) for s in range(first, last)]
            trainer.runner.settle()
            seconds = time.perf_counter() - t0
            last_step.update(outs[-1])
            return seconds, outs[0]["loss_sum"] / (B * T)

        runs = {"hpctrain": hpctrain_run}
        if peer.version:
            meta = {"vocab_size": m.vocab_size, "block_size": T, "n_layer": m.n_layer, "n_head": m.n_head,
                    "n_embd": m.n_embd, "lr": o.lr, "betas": list(o.betas), "eps": o.eps, "path": cfg.data.path,
                    "weight_decay": o.weight_decay, "decay_min_ndim": o.decay_min_ndim,
                    "grad_clip": cfg.train.grad_clip, "tokens": cfg.data.tokens,
                    "device": a.backend, "tf32": a.tf32, "dropout": m.dropout,
                    "precision": cfg.train.precision}
            rows = np.stack([trainer.sampler.local_rows(s) for s in range(warm_end + a.repeats * a.steps)])
            np.savez(f"{tmp}/setup.npz", meta=json.dumps(meta), rows=rows, **{"p:" + k: v for k, v in init.items()})
            peer.ask(f"setup {tmp}/setup.npz")
            runs["PyTorch"] = peer.run
        check(trainer, init, runs, peer, tmp)
        rates = {who: [] for who in runs}
        for who, run in runs.items():
            run(CHECK_STEPS, warm_end)
        for r in range(a.repeats):  # each goes first every other round
            lo = warm_end + r * a.steps
            for who in list(runs)[:: 1 if r % 2 == 0 else -1]:
                rates[who].append(a.steps * B * T / runs[who](lo, lo + a.steps)[0])
        report(a, rates, peer, f"numpy {np.__version__}, numba {numba.__version__}")
        print_mfu(trainer, rates, T)
        lo = warm_end + a.repeats * a.steps
        if a.profile and a.backend == "cuda":  # after the figures are printed, so a profiler failure loses none
            profile_kernels(lambda: hpctrain_run(lo, lo + a.profile), a.profile)
            lo += a.profile
        if a.host_profile:
            profile_host(lambda: hpctrain_run(lo, lo + a.host_profile), a.host_profile)
        if "device_allocs" in last_step:  # the step arena (backend/arena.py) and the launches from Python
            arena = trainer.be.arena
            print(f"last step: {last_step['device_allocs']} arrays allocated, {last_step['python_launches']} kernels "
                  f"launched from Python; arena " + (f"{arena.slab_bytes / 2**20:.1f} MiB slab, {arena.plans} plan(s)"
                                                      + (f", left: {arena.reason}" if arena.reason else "")
                                                      if arena is not None else "off"))
            graphs = getattr(trainer.be, "graphs", None)  # backend/cuda/graphs.py: the segments replayed
            print(f"graphs: {last_step.get('graph_launches', 0)} segment launches in the last step; "
                  + ("off" if graphs is None else f"off: {graphs.off}" if graphs.off
                     else f"{graphs.segments} segments, {graphs.captures} recording(s)"
                     + (f", left: {graphs.reason}" if graphs.reason else "")))
        launcher = getattr(trainer.be, "launcher", None)  # the CUDA backend's direct launch path (cuda_launch.py)
        if launcher is not None:
            print(f"launches: {launcher.fast:,} direct, {launcher.slow:,} through numba; refused: "
                  + ("; ".join(f"{name} ({why})" for name, why in launcher.refused) or "none"))
        trainer.close()
        mesh.free()
        peer.close()


def report(a, rates, peer, versions):
    precision = f", {a.precision}" if a.precision else ""
    names = {"hpctrain": f"hpctrain {a.backend.upper()} backend{precision} ({versions})",
             "PyTorch": f"PyTorch {peer.version}{precision}"}
    for who, values in rates.items():
        print(f"{names[who]}: median {statistics.median(values):,.0f} tokens/s over {a.repeats} rounds of "
              f"{a.steps} steps (rounds: {', '.join(f'{v:,.0f}' for v in values)})")
    if peer.version is None:
        print(f"PyTorch: skipped ({peer.why}; pass --torch-python or set HPCTRAIN_TORCH_PYTHON)")
        return
    ratio = statistics.median(rates["hpctrain"]) / statistics.median(rates["PyTorch"])
    target = 0.5 if a.backend == "cuda" else 1.0
    print(f"ratio hpctrain / PyTorch: {ratio:.2f} (target >= {target:g})", flush=True)


def print_mfu(trainer, rates, T):
    """Each side's median tokens/s as MFU: the model's training FLOPs (nanoGPT's estimate) against the peak of the
    run's train.precision (hpctrain/train/mfu.py; a CPU's measured, a GPU's from the datasheet table)."""
    from hpctrain.train.mfu import Peak

    cfg = trainer.cfg
    peak = Peak.of(trainer.be, cfg.train.peak_tflops, cfg.train.precision)
    if not peak.flops:
        print(f"mfu: none ({peak.source})")
        return
    per_sample = trainer.model.training_flops()
    shares = ", ".join(f"{who} {peak.mfu(statistics.median(v) / T, per_sample, 1):.1%}" for who, v in rates.items())
    print(f"mfu: {shares} of {peak.flops / 1e12:,.1f} TFLOP/s ({peak.source})", flush=True)


if __name__ == "__main__":
    main()
