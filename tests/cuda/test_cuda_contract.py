"""tests/test_backend_contract.py on the CUDA backend: the same checks (backend/base.py), and host arrays refused."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for backend_contract
from backend_contract import CASE_IDS, CASES, OPS, refuses_grown, refuses_host, runs_as_given  # noqa: E402


@pytest.mark.parametrize("op", OPS)
def test_arguments_that_fit_run(be, op):
    runs_as_given(be, op)


@pytest.mark.parametrize("op,name", CASES, ids=CASE_IDS)
def test_a_wrongly_sized_argument_raises(be, op, name):
    refuses_grown(be, op, name)


@pytest.mark.parametrize("op,name", CASES, ids=CASE_IDS)
def test_a_host_argument_raises(be, op, name):
    refuses_host(be, op, name)
