"""``hpctrain sample``'s generation with and without the key/value cache (nn/decode.py).

    python bench/bench_sample.py                          # CPU, nanoGPT's baby GPT at block 256, 300 tokens
    python bench/bench_sample.py --backend cuda --rounds 5

The model is nanoGPT's shakespeare-char "baby GPT" (6 layers, 6 heads, width 384, block_size 256, 65 ids) with its
initial weights (the cost of a token does not depend on what the weights are). A one-token prompt, ``--tokens``
new tokens at temperature 1 from seed 0: ``Generator.generate`` with ``cache=True`` (the prompt's window once,
then one position a token until block_size, then the slid window again for each token past it) and with
``cache=False`` (``--no-cache``: the whole window for every token), alternated, ``--rounds`` times each, after
one untimed round of each. Prints the median seconds of each, the ratio cached / uncached, and checks that both
drew the same tokens.
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-head", type=int, default=6)
    ap.add_argument("--n-embd", type=int, default=384)
    ap.add_argument("--vocab-size", type=int, default=65)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    from hpctrain.backend import get_backend
    from hpctrain.nn.gpt import GPTSpec
    from hpctrain.sample import Generator

    spec = GPTSpec(vocab_size=args.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                   n_head=args.n_head, n_embd=args.n_embd)
    gen = Generator(spec, spec.init_params(0), get_backend(args.backend))

    def run(cache):
        gen.be.synchronize()
        t0 = time.perf_counter()
        ids = gen.generate([1], args.tokens, temperature=1.0, top_k=0, rng=np.random.default_rng(0), cache=cache)
        gen.be.synchronize()
        return time.perf_counter() - t0, ids

    times = {True: [], False: []}
    _, want = run(False)
    _, got = run(True)
    for _ in range(args.rounds):
        for cache in (True, False):
            seconds, ids = run(cache)
            times[cache].append(seconds)
            assert ids == want, "the cached and uncached runs drew different tokens"
    assert got == want, "the cached and uncached runs drew different tokens"
    cached, full = statistics.median(times[True]), statistics.median(times[False])
    print(f"model: {args.n_layer} layers, {args.n_head} heads, width {args.n_embd}, block_size {args.block_size}, "
          f"{args.vocab_size} ids; {args.tokens} tokens from a one-token prompt on {args.backend}; "
          f"median of {args.rounds}")
    print(f"with the cache:  {cached:8.3f} s  ({1e3 * cached / args.tokens:.2f} ms a token)")
    print(f"--no-cache:      {full:8.3f} s  ({1e3 * full / args.tokens:.2f} ms a token)")
    print(f"cached / uncached: {cached / full:.3f}; the same {args.tokens} tokens either way")


if __name__ == "__main__":
    main()
