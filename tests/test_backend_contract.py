"""The backend contract's argument checks live once, in backend/base.py: on the CPU backend every array argument
of every op, one row too many, is a BackendError naming the op (tests/cuda/test_cuda_contract.py: the same on the
CUDA backend), and the arguments that fit run."""

import pytest

from backend_contract import CASE_IDS, CASES, OPS, refuses_grown, runs_as_given
from hpctrain.backend.cpu import CpuBackend


@pytest.fixture(scope="module")
def cpu():
    return CpuBackend()


@pytest.mark.parametrize("op", OPS)
def test_arguments_that_fit_run(cpu, op):
    runs_as_given(cpu, op)


@pytest.mark.parametrize("op,name", CASES, ids=CASE_IDS)
def test_a_wrongly_sized_argument_raises(cpu, op, name):
    refuses_grown(cpu, op, name)
