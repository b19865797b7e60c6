"""Kernel launches of one GPT micro-batch (forward, cross-entropy, backward) on the CUDA backend, by kernel.

    NUMBA_ENABLE_CUDASIM=1 python bench/count_launches.py                 # the simulator: no GPU needed
    NUMBA_ENABLE_CUDASIM=1 python bench/count_launches.py --n-layer 12    # GPT-2 small's depth (tiny widths)

The counts depend on the depth and on which layers have biases, not on the widths, so tiny widths give a GPT's
figures (the simulator is slow). docs/gpu.md has the counts before and after the fused kernels (issue 49 item 4).
"""

from __future__ import annotations

import argparse
import collections

import numpy as np


def kernel_name(kernel) -> str:
    """A numba CUDA kernel's Python name (the backend's own: hpctrain/backend/cuda/launch.py)."""
    from hpctrain.backend.cuda.launch import kernel_name as name

    return name(kernel)


def count(n_layer: int, batch: int, block_size: int, bias: bool) -> collections.Counter:
    from hpctrain.backend.cuda import CudaBackend
    from hpctrain.nn import make_loss
    from hpctrain.nn.gpt import GPTSpec
    from hpctrain.params import FlatBuffer

    be = CudaBackend()
    spec = GPTSpec(vocab_size=7, block_size=block_size, n_layer=n_layer, n_head=2, n_embd=4, bias=bias)
    part = spec.part()
    p, g = FlatBuffer(be, part.layout), FlatBuffer(be, part.layout)
    part.bind(p, g)
    p.load_host_dict(spec.init_params(1))
    rng = np.random.default_rng(0)
    idx = rng.integers(0, 7, (batch, block_size)).astype(np.int64)
    targets = be.asarray(rng.integers(0, 7, batch * block_size).astype(np.int64))
    launches = collections.Counter()
    original = be._launch

    def counted(kernel, grid, threads, *args):
        launches[kernel_name(kernel)] += 1
        original(kernel, grid, threads, *args)

    be._launch = counted
    logits, saved = part.forward(be, be.asarray(idx))
    _, _, d = make_loss("cross_entropy")(be, logits, targets, 1.0 / idx.size)
    part.backward(be, d, saved, need_dinp=False)
    be.synchronize()
    return launches


def main():
    a = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    a.add_argument("--n-layer", type=int, default=2)
    a.add_argument("--batch", type=int, default=2)
    a.add_argument("--block-size", type=int, default=4)
    a.add_argument("--no-bias", action="store_true")
    args = a.parse_args()
    launches = count(args.n_layer, args.batch, args.block_size, not args.no_bias)
    print(f"GPT, {args.n_layer} layers, bias {not args.no_bias}: {sum(launches.values())} launches a micro-batch")
    for name, n in sorted(launches.items(), key=lambda kv: (-kv[1], kv[0])):
        print(f"  {name:32s} {n}")


if __name__ == "__main__":
    main()
