"""A checkpoint written on the world resumes on one process and vice versa, to float tolerance.

Run under mpiexec -n 1 and -n 2 by tests/test_suites.py.
"""

import os

import numpy as np
import pytest
from mpi4py import MPI

from helpers import config, copy_checkpoint, train_params as train


@pytest.fixture
def job(data, comm):
    path = data

    def cfg(**checkpoint):
        return config(path, train={"steps": 10, "batch_size": 8 * comm.size}, optim={"name": "adamw", "lr": 0.01},
                      data={"shuffle": True}, checkpoint=checkpoint)
    return cfg


def assert_close(a, b):
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=2e-5, atol=2e-6, err_msg=name)


def test_world_checkpoint_resumes_on_one_process(comm, shared_dir, job):
    world_dir = f"{shared_dir}/world"
    straight = train(job(dir=world_dir, every=5), comm)
    mine = f"{shared_dir}/alone-{comm.rank}"
    os.makedirs(mine)
    copy_checkpoint(f"{world_dir}/ckpt-00000005.h5", mine)
    resumed = train(job(dir=mine), MPI.COMM_SELF)
    assert_close(straight, resumed)


def test_single_process_checkpoint_resumes_on_the_world(comm, shared_dir, job):
    mine = f"{shared_dir}/alone-{comm.rank}"
    straight = train(job(dir=mine, every=5), MPI.COMM_SELF)
    resumed = train(job(dir=f"{shared_dir}/world", resume=f"{shared_dir}/alone-0/ckpt-00000005.h5"), comm)
    assert_close(straight, resumed)
