"""bench/cuda_common.py for the GEMM variants kept here: their ``from cuda_common import ...`` finds this file first.

It loads bench/cuda_common.py itself (one copy of the helpers, which also puts the checkout's root on sys.path)
and re-exports its names, so ``python bench/history/cuda_gemm_1_naive.py`` runs as it did from bench/.
"""

import importlib.util
import os

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cuda_common.py")
_spec = importlib.util.spec_from_file_location("_bench_cuda_common", _PATH)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
globals().update({k: v for k, v in vars(_module).items() if not k.startswith("__")})
