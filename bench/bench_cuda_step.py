"""One MLP training step through hpctrain's CUDA backend against the same model in PyTorch on the same GPU.

    python bench/bench_cuda_step.py                          # batch 1024, hidden 4096 (the target shape)
    python bench/bench_cuda_step.py --batch 512 --hidden 2048 --optim sgd
    NUMBA_ENABLE_CUDASIM=1 python bench/bench_cuda_step.py   # tiny shapes, losses checked, no timing

Model: Linear(in, H) → GELU → LayerNorm(H) → Linear(H, H) → GELU → Linear(H, 10), softmax
cross-entropy, AdamW (or SGD with momentum). Parameter names are torch's
``nn.Sequential`` ones, so PyTorch starts from hpctrain's initial weights exactly.

A step is what ``Trainer`` does per step minus the HDF5 read and MPI: copy the
batch (pageable host memory) to the GPU, forward, loss (a host scalar back), backward,
the global gradient norm (a host scalar back), the optimizer update, synchronise.
PyTorch does the same: ``.to("cuda")`` of the batch, forward, ``cross_entropy``,
``backward``, ``clip_grad_norm_`` (norm only), ``step``, ``loss.item()``; float32
with TF32 off. Both start from the same weights and batch; their losses over the
first steps are compared before anything is timed. Target: hpctrain <= 2x PyTorch.

Figure: the MLP step on a GPU / PyTorch's; docs/performance.md, "GPU step" (every run behind it:
docs/performance-log.md).
"""

import argparse
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_common import gpu_mode  # noqa: E402

from hpctrain.config import LayerSpec, OptimConfig  # noqa: E402
from hpctrain.nn import ModelSpec, make_loss  # noqa: E402
from hpctrain.optim import make_optimizer  # noqa: E402
from hpctrain.params import FlatBuffer  # noqa: E402

CLASSES = 10


def layer_specs(features, hidden):
    def linear(i, o):
        return LayerSpec("linear", (("bias", True), ("in", i), ("out", o)))

    return [linear(features, hidden), LayerSpec("gelu"), LayerSpec("layernorm", (("dim", hidden), ("eps", 1e-5))),
            linear(hidden, hidden), LayerSpec("gelu"), linear(hidden, CLASSES)]


def optim_config(name):
    if name == "sgd":
        return OptimConfig(name="sgd", lr=1e-2, momentum=0.9)
    return OptimConfig(name="adamw", lr=1e-3)


class HpctrainStep:
    """The Trainer's step on one backend, without data loading and gradient sync."""

    def __init__(self, be, specs, init, optim):
        self.be = be
        self.model = ModelSpec(specs).part()
        self.params, self.grads = FlatBuffer(be, self.model.layout), FlatBuffer(be, self.model.layout)
        self.model.bind(self.params, self.grads)
        self.params.load_host_dict(init)
        self.optim = make_optimizer(optim_config(optim), be, self.params, self.grads)
        self.loss = make_loss("cross_entropy")
        self.lr = self.optim.cfg.lr

    def __call__(self, x_host, y_host):
        be = self.be
        B = len(x_host)
        x, y = be.asarray(x_host), be.asarray(y_host)
        out, saved = self.model.forward(be, x)
        loss_sum, _, dout = self.loss(be, out, y, 1.0 / B)
        self.model.backward(be, dout, saved, need_dinp=False)
        norm = math.sqrt(be.sum_squares(self.grads.data))
        self.optim.step(self.lr)
        be.synchronize()
        return loss_sum / B, norm


class TorchStep:
    def __init__(self, torch, device, features, hidden, init, optim):
        nn = torch.nn
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        self.torch, self.device = torch, device
        self.model = nn.Sequential(nn.Linear(features, hidden), nn.GELU(), nn.LayerNorm(hidden, eps=1e-5),
                                   nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, CLASSES)).to(device)
        self.model.load_state_dict({k: torch.from_numpy(v) for k, v in init.items()})
        cfg = optim_config(optim)
        if optim == "sgd":
            self.opt = torch.optim.SGD(self.model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
        else:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                         weight_decay=cfg.weight_decay)

    def __call__(self, x_host, y_host):
        torch = self.torch
        x = torch.from_numpy(x_host).to(self.device)
        y = torch.from_numpy(y_host).to(self.device)
        self.opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=float("inf"))
        self.opt.step()
        return loss.item(), norm.item()


def best_step_time(step, batches, repeat):
    """Best seconds per step over ``repeat`` rounds of len(batches) steps (each step ends synchronised)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for x, y in batches:
            step(x, y)
        best = min(best, (time.perf_counter() - t0) / len(batches))
    return best


def step_gemm_flops(B, features, hidden):
    """Forward X·Wᵀ, weight gradient and input gradient (none for the first layer) of the three Linears."""
    sizes = [(features, hidden), (hidden, hidden), (hidden, CLASSES)]
    return sum(2 * B * i * o * (2 if n == 0 else 3) for n, (i, o) in enumerate(sizes))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--features", type=int, default=1024)
    p.add_argument("--optim", choices=["adamw", "sgd"], default="adamw")
    p.add_argument("--steps", type=int, default=10, help="steps per timed round")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    mode = gpu_mode("bench_cuda_step")
    if mode == "sim":
        args.batch, args.hidden, args.features, args.steps = 8, 16, 12, 2
    B, H, F = args.batch, args.hidden, args.features

    from hpctrain.backend.cpu import CpuBackend
    from hpctrain.backend.cuda import CudaBackend

    specs = layer_specs(F, H)
    init = ModelSpec(specs).init_params(seed=0)
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((B, F)).astype(np.float32), rng.integers(0, CLASSES, B).astype(np.int64))
               for _ in range(args.steps)]
    ours = HpctrainStep(CudaBackend(), specs, init, args.optim)

    try:
        import torch
    except ImportError:
        torch = None
    if mode == "sim" or torch is None or not torch.cuda.is_available():
        # The reference here is hpctrain's CPU backend (and PyTorch on the CPU when installed).
        reference = HpctrainStep(CpuBackend(), specs, init, args.optim)
        others = [("hpctrain cpu", reference)]
        if torch is not None:
            others.append(("torch cpu", TorchStep(torch, "cpu", F, H, init, args.optim)))
        for x, y in batches[:2]:
            got = ours(x, y)
            for name, other in others:
                want = other(x, y)
                if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
                    print(f"FAIL: hpctrain cuda (loss, grad norm) {got} but {name} {want}")
                    sys.exit(1)
        print(f"hpctrain cuda matches {' and '.join(n for n, _ in others)} over 2 steps (loss, grad norm)")
        if mode == "sim":
            return
        print("PyTorch with CUDA is not installed: timing hpctrain alone")
        theirs = None
    else:
        theirs = TorchStep(torch, "cuda", F, H, init, args.optim)
        for i, (x, y) in enumerate(batches[:3]):
            got, want = ours(x, y), theirs(x, y)
            print(f"step {i + 1}: loss hpctrain {got[0]:.6f} torch {want[0]:.6f}, "
                  f"grad norm hpctrain {got[1]:.6f} torch {want[1]:.6f}")
            if not np.allclose(got, want, rtol=1e-3, atol=1e-5):
                print("FAIL: hpctrain and PyTorch disagree; not timing")
                sys.exit(1)

    flops = step_gemm_flops(B, F, H)
    best_step_time(ours, batches[:2], 1)  # warm-up: kernel compilation, memory pool
    t_ours = best_step_time(ours, batches, args.repeat)
    print(f"MLP {F}-{H}-{H}-{CLASSES} batch {B} {args.optim}: hpctrain {t_ours * 1e3:.2f} ms/step "
          f"({flops / t_ours / 1e12:.2f} TFLOP/s in its GEMMs)")
    if theirs is not None:
        best_step_time(theirs, batches[:2], 1)
        t_theirs = best_step_time(theirs, batches, args.repeat)
        print(f"PyTorch {torch.__version__}: {t_theirs * 1e3:.2f} ms/step ({flops / t_theirs / 1e12:.2f} TFLOP/s)")
        ratio = t_ours / t_theirs
        print(f"target hpctrain <= 2x PyTorch: {ratio:.2f}x -> {'met' if ratio <= 2 else 'NOT met'}")


if __name__ == "__main__":
    main()
