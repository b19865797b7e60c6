"""Keep freed activation memory in the process instead of handing it back to the kernel every step.

A step allocates the same activation arrays every time (numpy arrays of a few megabytes).
glibc's malloc serves blocks that large with ``mmap`` and unmaps them on free, so each
step's first write to every page of every activation faults again: on the GPT of
jobs/configs/gpt-char.toml that was 12% of the step (bench/bench_gpt.py: 12,611 tokens/s,
14,403 with the thresholds below). Raising ``M_MMAP_THRESHOLD`` to its 64-bit maximum
(32 MiB) and ``M_TRIM_THRESHOLD`` keeps such blocks on the heap for reuse, as the
caching allocators PyTorch recommends on CPUs (jemalloc, tcmalloc) do. A ``Trainer`` sets
them when it is built (not ``import hpctrain``): the process then keeps up to the trim
threshold of freed heap. Linux with glibc only; a user's own ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_`` take precedence (``MALLOC_TRIM_THRESHOLD_=131072`` restores
glibc's default).
"""

import ctypes
import ctypes.util
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_MAX_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems
_TRIM_THRESHOLD = 1 << 30


def keep_freed_memory(environ=os.environ) -> bool:
    """Set glibc's malloc thresholds unless the user set them; True when they were set."""
    if not sys.platform.startswith("linux") or any(v in environ for v in ("MALLOC_MMAP_THRESHOLD_",
                                                                          "MALLOC_TRIM_THRESHOLD_")):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_MAX_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
