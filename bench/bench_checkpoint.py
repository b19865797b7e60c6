"""Checkpoint write throughput: save_checkpoint against numpy.tofile + fsync of the same bytes.

    python bench/bench_checkpoint.py                 # 256 MiB of parameters + Adam state = 768 MiB per write
    python bench/bench_checkpoint.py --mib 32        # smaller
    python bench/bench_checkpoint.py --dir /scratch/$USER/bench   # the file system you checkpoint to

Both writers get the same arrays and must make them durable (fsync) before
the clock stops; save_checkpoint also computes a sha256 per dataset, writes the
HDF5 metadata, renames into place and fsyncs the directory. Runs alternate
between the two writers and the median of ``--repeat`` runs is compared; the
target is a ratio of at least 0.7. MB here is 10^6 bytes. Also reports reading
back: load_checkpoint (with verification) against numpy.fromfile.
One process, no MPI.

Figure: single-file save_checkpoint / numpy.tofile + fsync; docs/performance.md, "Checkpoints" (every run behind
it: docs/performance-log.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hpctrain.checkpoint import CheckpointState, load_checkpoint, save_checkpoint  # noqa: E402
from hpctrain.params import ParamLayout  # noqa: E402


def make_state(mib: int, tensors: int, seed: int = 0):
    """``tensors`` Linear layers (weight + bias) holding ``mib`` MiB of float32 parameters, with Adam slots."""
    cols = 1024
    total = mib * 2**20 // 4
    rows = max(1, total // (tensors * (cols + 1)))
    shapes = []
    for i in range(tensors):
        shapes += [(f"{2 * i}.weight", (rows, cols)), (f"{2 * i}.bias", (rows,))]
    layout = ParamLayout(shapes)
    rng = np.random.default_rng(seed)
    flat = [rng.standard_normal(layout.size, dtype=np.float32) for _ in range(3)]
    views = [{s.name: f[s.offset : s.end].reshape(s.shape) for s in layout} for f in flat]
    state = CheckpointState(step=0, epoch=0, data_position=0, config_text="# bench\n",
                            layout=dict(world_size=1, dp=1, pp=1, tp=1), params=views[0], optim_name="adam",
                            optim_step=0, slots={"exp_avg": views[1], "exp_avg_sq": views[2]},
                            rng=dict(data_seed=0, shuffle=True, train_seed=0))
    return layout, state, [a for v in views for a in v.values()]


def write_tofile(path, arrays):
    with open(path, "wb") as f:
        for a in arrays:
            a.tofile(f)
        f.flush()
        os.fsync(f.fileno())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=256, help="MiB of parameters (the file holds 3x: params + Adam state)")
    p.add_argument("--tensors", type=int, default=8, help="number of Linear layers the parameters are split into")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir under $TMPDIR)")
    args = p.parse_args(argv)

    import h5py

    layout, state, arrays = make_state(args.mib, args.tensors)
    nbytes = sum(a.nbytes for a in arrays)
    base = tempfile.mkdtemp(prefix="hpctrain-bench-", dir=args.dir)
    print(f"command: python {' '.join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:]))}")
    print(f"h5py {h5py.version.version}, HDF5 {h5py.version.hdf5_version}, numpy {np.__version__}, "
          f"{os.cpu_count()} CPUs, writing to {base}")
    print(f"{len(layout)} tensors, {layout.size * 4 / 2**20:.1f} MiB of parameters, x3 with Adam state = "
          f"{nbytes / 1e6:.1f} MB per write")
    h5_times, raw_times, cpu = [], [], {"h5": [], "raw": []}
    try:
        ckpt_dir = os.path.join(base, "ckpt")
        # Nothing is deleted until the end: unlinking on a file system mounted with ``discard`` slows the
        # next write down, whichever writer that is. Run 0 warms both up and is not counted.
        for r in range(args.repeat + 1):
            order = ("h5", "raw") if r % 2 == 0 else ("raw", "h5")
            for which in order:
                os.sync()
                c0, t0 = time.process_time(), time.perf_counter()
                if which == "h5":
                    state.step = r
                    path = save_checkpoint(ckpt_dir, state, keep=args.repeat + 2)
                    t = time.perf_counter() - t0
                    if r:
                        h5_times.append(t)
                else:
                    raw_path = os.path.join(base, f"raw-{r}.bin")
                    write_tofile(raw_path, arrays)
                    t = time.perf_counter() - t0
                    if r:
                        raw_times.append(t)
                if r:
                    cpu[which].append(time.process_time() - c0)
                print(f"  run {r}{' (warm-up)' if r == 0 else ''}: {'save_checkpoint' if which == 'h5' else 'numpy.tofile+fsync':<19}"
                      f" {t:.3f} s")
        # read back the last pair: verification cost (from the page cache where it still holds the file)
        t0 = time.perf_counter()
        loaded = load_checkpoint(path, layout, optim_name="adam")
        t_load = time.perf_counter() - t0
        if any(not np.array_equal(loaded.params[k], v) for k, v in state.params.items()):
            raise SystemExit("read back differs from what was written")
        t0 = time.perf_counter()
        np.fromfile(raw_path, dtype=np.float32)
        t_fromfile = time.perf_counter() - t0
    finally:
        shutil.rmtree(base, ignore_errors=True)

    def mbs(t):
        return nbytes / t / 1e6

    h5, raw = statistics.median(h5_times), statistics.median(raw_times)
    print(f"write, median of {args.repeat}: save_checkpoint {mbs(h5):8.0f} MB/s ({h5:.3f} s)   "
          f"numpy.tofile+fsync {mbs(raw):8.0f} MB/s ({raw:.3f} s)   ratio {raw / h5:.2f}")
    print(f"write, best of {args.repeat}:   save_checkpoint {mbs(min(h5_times)):8.0f} MB/s   "
          f"numpy.tofile+fsync {mbs(min(raw_times)):8.0f} MB/s   ratio {min(raw_times) / min(h5_times):.2f}")
    print(f"CPU seconds per write (all threads, median): save_checkpoint {statistics.median(cpu['h5']):.3f}   "
          f"numpy.tofile+fsync {statistics.median(cpu['raw']):.3f}   (sha256 runs in up to 4 threads)")
    print(f"read: load_checkpoint with sha256 verification {mbs(t_load):8.0f} MB/s   "
          f"numpy.fromfile {mbs(t_fromfile):8.0f} MB/s")
    ok = raw / h5 >= 0.7
    print(f"target ratio >= 0.70: {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
