"""The type gradients travel in over the data-parallel group: float32 as they are, or bfloat16.

``parallel.reduce_dtype = "bf16"`` halves the bytes of every gradient Allreduce and Reduce_scatter, as
PyTorch DDP's ``bf16_compress_hook`` does: a bucket is rounded to bfloat16 (to nearest even, ml_dtypes'
cast), summed over the group in bfloat16 (each partial sum rounded again, in whatever order MPI's algorithm
adds), and widened back into the float32 gradient buffer. The gradients, the optimizer and the master weights stay
float32; only the messages are narrower, so a step's result differs from the float32 sum by the
roundings (at most 2⁻⁸ of a value, relative, each: bfloat16 keeps 7 bits of mantissa).

    wire = Wire(size)                     # a packed buffer for ``size`` gradients; one MPI operator
    packed = wire.pack(buf, lo)           # buf (host float32) rounded into the packed buffer at lo
    comm.Allreduce(MPI.IN_PLACE, wire.message(packed), op=wire.op)
    wire.unpack(packed, buf)              # the sum, widened into buf
    wire.close()                          # frees the operator (not collective)

MPI has no bfloat16 type: the packed buffer travels as ``MPI.UINT16_T`` and a user-defined, commutative
operator adds two such buffers through float32. Host memory only: a device's gradients are staged
through host memory first (parallel/data_parallel.py decides that).
"""

from __future__ import annotations

import numpy as np

__all__ = ["REDUCE_DTYPES", "Wire"]

REDUCE_DTYPES = ("fp32", "bf16")


def _bfloat16():
    import ml_dtypes

    return ml_dtypes.bfloat16


class Wire:
    """bfloat16 messages for up to ``size`` float32 gradients (one packed host buffer, reused every step)."""

    itemsize = 2

    def __init__(self, size: int):
        from mpi4py import MPI

        self.MPI = MPI
        self.bf16 = _bfloat16()
        self.packed = np.empty(size, dtype=np.uint16)
        bf16 = self.bf16

        def add(inbuf, inoutbuf, datatype):  # MPI's reduction of two packed buffers: inout = in + inout
            a = np.frombuffer(inbuf, dtype=bf16)
            b = np.frombuffer(inoutbuf, dtype=bf16)
            with np.errstate(over="ignore", invalid="ignore"):  # a non-finite sum is the step's to skip
                np.add(a, b, out=b)

        self.op = MPI.Op.Create(add, commute=True)

    def pack(self, buf: np.ndarray, lo: int = 0) -> np.ndarray:
        """``buf`` (float32, host) rounded to bfloat16 into the packed buffer at ``lo``; the packed slice."""
        packed = self.packed[lo : lo + buf.shape[0]]
        with np.errstate(over="ignore", invalid="ignore"):
            packed.view(self.bf16)[:] = buf
        return packed

    def unpack(self, packed: np.ndarray, buf: np.ndarray) -> None:
        """The packed values widened (exactly) into ``buf`` (float32, host)."""
        buf[:] = packed.view(self.bf16)

    def message(self, packed: np.ndarray):
        """What MPI is handed for a packed slice."""
        return [packed, self.MPI.UINT16_T]

    def close(self) -> None:
        if self.op is not None and self.op != self.MPI.OP_NULL:
            self.op.Free()
        self.op = None
