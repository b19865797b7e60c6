"""GEMM variant 4: variant 3 with unsigned indexing, 128-bit shared loads and two pipelined stages (the kernel hpctrain uses).

    python bench/history/cuda_gemm_4_pipelined.py                 # every tiling at 1024², 2048², 4096²
    python bench/history/cuda_gemm_4_pipelined.py --tiles 128,128,8,8,8 64,64,8,4,4
    NUMBA_ENABLE_CUDASIM=1 python bench/history/cuda_gemm_4_pipelined.py   # correctness only, tiny tilings

The kernel is hpctrain/backend/cuda/gemm/tiled.py's. Against variant 3
(bench/history/cuda_gemm_3_regblock.py), compiled for sm_90 and sm_80 (bench/cuda_sass_report.py):

- every index is uint64, so numba drops its negative-index wraparound check (a compare and a
  select) from each shared-memory load: the stack frame goes and registers fall from 128-160
  to at most 128, two blocks of 256 threads per SM;
- a thread's TM rows and TN columns are contiguous and the tile rows 16-byte aligned, so ptxas
  reads each fragment with 128-bit shared loads (LDS.128): multiply-adds are 85% of the K loop
  (40% before);
- two shared-memory stages: the global loads of the next K slice are issued into registers
  before the current slice is multiplied and stored into the other stage after it, one barrier
  per slice.

Sweeps the same tilings as variant 3 (the first check is correctness in all three layouts on
odd sizes); bench/bench_cuda_gemm.py compares the library against cuBLAS.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_gemm_3_regblock import main  # noqa: E402

from hpctrain.backend.cuda.gemm.tiled import gemm_kernels  # noqa: E402

if __name__ == "__main__":
    main(gemm_kernels, "cuda_gemm_4_pipelined", "pipelined", __doc__)
