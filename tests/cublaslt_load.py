"""Imports hpctrain/backend/cuda/gemm/cublaslt.py as ``cublaslt``: through its package once backend/cuda/ is a
package (the backend's move into packages), else by its path (while backend/cuda/__init__.py is still a module)."""

import importlib.util
import os
import sys

try:
    from hpctrain.backend.cuda.gemm import cublaslt
except ImportError:
    _name = "hpctrain_backend_cuda_gemm_cublaslt"
    _path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hpctrain", "backend", "cuda",
                         "gemm", "cublaslt.py")
    cublaslt = sys.modules.get(_name)
    if cublaslt is None:
        _spec = importlib.util.spec_from_file_location(_name, _path)
        cublaslt = importlib.util.module_from_spec(_spec)
        sys.modules[_name] = cublaslt  # dataclasses look their module up while the class is made
        _spec.loader.exec_module(cublaslt)
