"""Data-parallel training equals single-process training; ranks stay bit-identical.

Run under ``mpiexec -n 1`` and ``-n 2`` by tests/test_suites.py; expectations come from the world size.
Each rank also trains the same config alone on COMM_SELF, which is the single-process reference.
"""

import hashlib

import numpy as np
import pytest
from mpi4py import MPI

from helpers import config, make_classification, train_params as train
from hpctrain.parallel.agree import QuietExit
from hpctrain.parallel.mesh import Mesh
from hpctrain.errors import LayoutError
from hpctrain.train import Trainer

quiet = dict(log=lambda *a: None)


def digest(params):
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(params[name].tobytes())
    return np.frombuffer(h.digest(), dtype=np.uint8).copy()


@pytest.mark.parametrize("optim", [{"name": "sgd", "lr": 0.1, "momentum": 0.9}, {"name": "adamw", "lr": 0.01}],
                         ids=["sgd", "adamw"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
@pytest.mark.parametrize("micro", [1, 2], ids=["1-micro", "2-micro"])
def test_world_equals_single_process(comm, data, optim, overlap, micro):
    batch = 8 * comm.size  # every world size gets an even share
    cfg = config(data, optim=optim, train={"steps": 6, "batch_size": batch, "micro_batches": micro},
                 data={"shuffle": True}, parallel={"overlap": overlap, "bucket_mb": 0.0002})  # 50-float buckets
    world = train(cfg, comm)
    alone = train(cfg, MPI.COMM_SELF)
    for name in world:
        np.testing.assert_allclose(world[name], alone[name], rtol=2e-5, atol=2e-6, err_msg=name)
    # every rank holds bit-identical parameters
    mine = digest(world)
    root = mine.copy()
    comm.Bcast(root, root=0)
    same = np.array([int(np.array_equal(mine, root))], dtype=np.int32)
    comm.Allreduce(MPI.IN_PLACE, same, op=MPI.MIN)
    assert same[0] == 1


def test_grad_sync_uses_several_buckets(comm, data):
    cfg = config(data, train={"steps": 1, "batch_size": 8 * comm.size}, parallel={"bucket_mb": 0.0002})
    mesh = Mesh(comm=comm)
    t = Trainer(cfg, mesh=mesh, **quiet)
    assert len(t.sync.buckets) == -(-t.model.layout.size // 50)
    assert t.sync.active == (comm.size > 1)
    t.close()
    mesh.free()


def test_config_mismatch_is_caught(comm, data):
    if comm.size < 2:
        pytest.skip("needs two ranks: a layout can only differ between ranks")
    hidden = 8 if comm.rank == 0 else 9
    cfg = config(data, hidden=hidden, train={"batch_size": 8 * comm.size})
    mesh = Mesh(comm=comm)
    expected = LayoutError if comm.rank == 0 else QuietExit
    with pytest.raises(expected) as info:
        Trainer(cfg, mesh=mesh, **quiet)
    if comm.rank == 0:
        assert "rank 1 has a different config from rank 0" in str(info.value)
    mesh.free()


def test_parameter_layout_mismatch_names_the_first_difference(comm):
    if comm.size < 2:
        pytest.skip("needs two ranks: a layout can only differ between ranks")
    from hpctrain.parallel.agree import check_same_everywhere
    from hpctrain.params import ParamLayout

    shape = (4, 3) if comm.rank == 0 else (4, 5)
    layout = ParamLayout([("0.weight", shape), ("0.bias", (4,))])
    expected = LayoutError if comm.rank == 0 else QuietExit
    with pytest.raises(expected) as info:
        check_same_everywhere(comm, "parameter layout", layout.describe(), layout.first_difference)
    if comm.rank == 0:
        assert "rank 1 has a different parameter layout from rank 0: parameter #0: '0.weight 4x5 0' here, " \
               "'0.weight 4x3 0' there" in str(info.value)


def test_world_size_that_does_not_fit_is_an_error(comm, data):
    with pytest.raises(LayoutError, match=f"does not match the world size {comm.size}"):
        Mesh(comm=comm, dp=comm.size + 1)


def test_batch_not_divisible_by_dp(comm, data):
    if comm.size < 2:
        pytest.skip("needs two ranks")
    cfg = config(data, train={"batch_size": 8 * comm.size + 1})
    mesh = Mesh(comm=comm)
    with pytest.raises((QuietExit, Exception)) as info:
        Trainer(cfg, mesh=mesh, **quiet)
    if comm.rank == 0:
        assert f"not divisible by the data-parallel size {comm.size}" in str(info.value)
    mesh.free()


def test_nonblocking_path_equals_single_process(comm, data):
    """The Iallreduce path (what device buffers use) on host buffers: same result as one process."""
    cfg = config(data, train={"steps": 4, "batch_size": 8 * comm.size}, parallel={"bucket_mb": 0.0002})
    mesh = Mesh(comm=comm)
    t = Trainer(cfg, mesh=mesh, **quiet)
    t.sync._worker = None  # what GradSync does without MPI_THREAD_MULTIPLE or with a device backend
    t.run()
    t.close()
    mesh.free()
    alone = train(cfg, MPI.COMM_SELF)
    for name, value in t.params.to_host_dict().items():
        np.testing.assert_allclose(value, alone[name], rtol=2e-5, atol=2e-6, err_msg=name)


def test_a_mesh_that_differs_from_the_config_is_refused(comm, data):
    if comm.size < 2:
        pytest.skip("needs two ranks for pp = 2")
    mesh = Mesh(comm=comm, dp=comm.size // 2, pp=2)
    cfg = config(data, train={"batch_size": 8 * comm.size})
    with pytest.raises((LayoutError, QuietExit)) as info:
        Trainer(cfg, mesh=mesh, **quiet)
    if comm.rank == 0:
        assert "the mesh has pp = 2 but parallel.pp = 1" in str(info.value)
    mesh.free()


def test_uneven_validation_shares_match_single_process(comm, shared_dir):
    """31 validation rows split over the ranks unevenly: no hang, and the same loss and accuracy as one process."""
    path = f"{shared_dir}/odd.h5"
    if comm.rank == 0:
        make_classification(path, n=124 + 31)  # val_fraction 0.2 -> 31 validation rows
    comm.Barrier()
    cfg = config(path, train={"steps": 3, "batch_size": 8 * comm.size}, data={"val_fraction": 0.2})
    results = []
    for c in (comm, MPI.COMM_SELF):
        mesh = Mesh(comm=c)
        t = Trainer(cfg, mesh=mesh, **quiet)
        results.append(t.run())
        t.close()
        mesh.free()
    world, alone = results
    assert world["val_accuracy"] == pytest.approx(alone["val_accuracy"])
    assert world["val_loss"] == pytest.approx(alone["val_loss"], rel=1e-5)


def test_bad_init_file_is_reported_without_a_hang(comm, data, shared_dir):
    """Only rank 0 reads checkpoint.init: its failure must reach every rank before any broadcast."""
    from hpctrain.errors import CheckpointError

    cfg = config(data, train={"batch_size": 8 * comm.size}, checkpoint={"init": f"{shared_dir}/missing.h5"})
    mesh = Mesh(comm=comm)
    with pytest.raises(CheckpointError if comm.rank == 0 else QuietExit):
        Trainer(cfg, mesh=mesh, **quiet)
    mesh.free()
