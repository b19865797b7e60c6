"""tests/test_backend_contract.py on the CUDA backend: the same checks (backend/base.py), and host arrays refused."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for backend_contract
from backend_contract import contract_cases, grown  # noqa: E402
from hpctrain.errors import BackendError  # noqa: E402

CASES = [(op, name) for op, arrays, _ in contract_cases() for name in arrays]


@pytest.mark.parametrize("op", [op for op, _, _ in contract_cases()])
def test_arguments_that_fit_run(be, op):
    (arrays, call), = [(a, c) for o, a, c in contract_cases() if o == op]
    call(be, {k: be.asarray(v.copy()) for k, v in arrays.items()})


@pytest.mark.parametrize("op,name", CASES, ids=[f"{op}-{name}" for op, name in CASES])
def test_a_wrongly_sized_argument_raises(be, op, name):
    (arrays, call), = [(a, c) for o, a, c in contract_cases() if o == op]
    args = {k: be.asarray(grown(op, k, v) if k == name else v.copy()) for k, v in arrays.items()}
    with pytest.raises(BackendError, match=f"^{op}: "):
        call(be, args)


@pytest.mark.parametrize("op,name", CASES, ids=[f"{op}-{name}" for op, name in CASES])
def test_a_host_argument_raises(be, op, name):
    (arrays, call), = [(a, c) for o, a, c in contract_cases() if o == op]
    args = {k: (v.copy() if k == name else be.asarray(v.copy())) for k, v in arrays.items()}
    with pytest.raises(BackendError, match=f"^{op}: {name} must be a device array"):
        call(be, args)
