"""Compile the CUDA kernels for real GPUs without one: NVVM (numba.cuda.compile_ptx), then ptxas -v.

    LD_LIBRARY_PATH=/path/to/nvidia/cu13/lib python bench/cuda_compile_check.py      # sm_90 and sm_80

NVVM needs libnvrtc (the nvidia-cuda-nvrtc wheel's lib folder on LD_LIBRARY_PATH, or CUDA_HOME); ptxas
must be on PATH. For each kernel: PTX size, float64 instructions, registers and spill stores per thread.
Kernels are compiled at the GPU block size (256 threads) and at the simulator's (16). Device functions
ask the driver for the compute capability, which a machine with no GPU has not got: the target's is
given instead. Exits 1 when a kernel fails to compile, ptxas fails, or a kernel spills.
"""

import os
import re
import subprocess
import sys
import tempfile
from types import SimpleNamespace

from numba import cuda, types

import numba.cuda.dispatcher as dispatcher

from hpctrain.backend.cuda_ops import ops_kernels
from hpctrain.backend.cuda_transformer import transformer_kernels

F1, F2, F4 = types.float32[::1], types.float32[:, ::1], types.float32[:, :, :, ::1]
D1, I1, I2 = types.float64[::1], types.int64[::1], types.int64[:, ::1]
i64, f32, b1 = types.int64, types.float32, types.boolean
TARGET = [(9, 0)]
dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=TARGET[0])


def kernels(nt):
    """(name, kernel, argument types) of the kernels the GPT, the optimizers and the block reductions use."""
    k, o = transformer_kernels(nt), ops_kernels(nt)
    return [
        ("add", o.add, (F1, F1)),
        ("sum_squares_partial", o.sum_squares_partial, (F1, D1)),
        ("layernorm_forward", o.layernorm_forward, (F2, F1, F1, f32, F2, F1, F1)),
        ("adam_update", o.adam_update, (F1, F1, F1, F1) + (f32,) * 9),
        ("embedding_forward", k.embedding_forward, (I2, F2, F2, F2, I1)),
        ("embedding_backward_wte", k.embedding_backward_wte, (F2, I1, I1, I1, F2)),
        ("embedding_backward_wpe", k.embedding_backward_wpe, (F2, i64, i64, F2, b1)),
        ("attention_softmax", k.attention_softmax, (F2, i64, i64, f32, F4)),
        ("attention_values", k.attention_values, (F4, F2, i64, i64, F2)),
        ("attention_softmax_backward", k.attention_softmax_backward, (F2, F2, F4, i64, i64, f32, F4)),
        ("attention_backward_qkv", k.attention_backward_qkv, (F2, F2, F4, F4, i64, i64, F2)),
    ]


def main() -> int:
    failed = 0
    for nt in (256, 16):
        for cc in ((9, 0), (8, 0)):
            TARGET[0] = cc
            for name, kernel, argtypes in kernels(nt):
                ptx, _ = cuda.compile_ptx(kernel.py_func, argtypes, cc=cc)
                with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
                    f.write(ptx)
                r = subprocess.run(["ptxas", f"-arch=sm_{cc[0]}{cc[1]}", "-v", f.name, "-o", os.devnull],
                                   capture_output=True, text=True)
                os.unlink(f.name)
                regs = re.search(r"Used (\d+) registers", r.stderr)
                spills = int(re.search(r"(\d+) bytes spill stores", r.stderr).group(1)) if r.returncode == 0 else -1
                print(f"block {nt:3d} sm_{cc[0]}{cc[1]} {name:28s} ptx {len(ptx):6d} chars, "
                      f"f64 ops {len(re.findall(r'[.]f64', ptx)):3d}, regs {regs.group(1) if regs else '?':>3}, "
                      f"spill stores {spills}" + ("" if r.returncode == 0 else f"  PTXAS FAILED:\n{r.stderr}"))
                failed += r.returncode != 0 or spills != 0
    print("all kernels compile without spills" if not failed else f"{failed} kernel build(s) failed or spilled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
