"""The backend contract's argument checks live once, in backend/base.py: on the CPU backend every array argument
of every op, one row too many, is a BackendError naming the op (tests/cuda/test_cuda_contract.py: the same on the
CUDA backend), and the arguments that fit run."""

import pytest

from backend_contract import contract_cases, grown
from hpctrain.backend.cpu import CpuBackend
from hpctrain.errors import BackendError

CASES = [(op, name) for op, arrays, _ in contract_cases() for name in arrays]


@pytest.fixture(scope="module")
def cpu():
    return CpuBackend()


@pytest.mark.parametrize("op", [op for op, _, _ in contract_cases()])
def test_arguments_that_fit_run(cpu, op):
    (arrays, call), = [(a, c) for o, a, c in contract_cases() if o == op]
    call(cpu, {k: cpu.asarray(v.copy()) for k, v in arrays.items()})


@pytest.mark.parametrize("op,name", CASES, ids=[f"{op}-{name}" for op, name in CASES])
def test_a_wrongly_sized_argument_raises(cpu, op, name):
    (arrays, call), = [(a, c) for o, a, c in contract_cases() if o == op]
    args = {k: cpu.asarray(grown(op, k, v) if k == name else v.copy()) for k, v in arrays.items()}
    with pytest.raises(BackendError, match=f"^{op}: "):
        call(cpu, args)
