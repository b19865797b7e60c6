"""The Python API used as docs/api.md shows it, where a script can go wrong: a mesh of sizes that are not
sizes, a config the Trainer does not run, a failed construction caught and retried."""

import pytest
from mpi4py import MPI

from helpers import config, make_classification
from hpctrain.errors import ConfigError, DataError, LayoutError
from hpctrain.parallel.mesh import Mesh
from hpctrain.train import Trainer


@pytest.mark.parametrize("kwargs, message", [
    ({"pp": 0}, "parallel.pp = 0: expected a positive integer"),
    ({"tp": -1}, "parallel.tp = -1: expected a positive integer"),
    ({"dp": 1.0}, 'parallel.dp = 1.0: expected a positive integer or "auto"'),
    ({"dp": "AUTO"}, "parallel.dp = 'AUTO': expected a positive integer or \"auto\""),
    ({"comm": "x"}, "Mesh\\(comm=...\\): expected an mpi4py communicator, got str"),
])
def test_a_mesh_of_sizes_that_are_not_sizes_is_a_layout_error(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        Mesh(**kwargs)


def test_the_trainer_refuses_the_parameter_server_mode_naming_its_class(tmp_path):
    make_classification(tmp_path / "d.h5", n=64)
    with pytest.raises(ConfigError, match=r'parallel.mode = "async_ps": Trainer trains synchronously; the '
                                          r"parameter server is hpctrain.train.async_ps.AsyncTrainer\(cfg\)"):
        Trainer(config(tmp_path / "d.h5", parallel={"mode": "async_ps"}), log=lambda *a: None)


def test_a_failed_construction_gives_its_communicators_back(tmp_path):
    """A sweep that catches a bad config and goes on: each failed Trainer used to keep the ~5 communicators of
    the mesh it made, and MPI ran out after about 400 (a raw MPI error)."""
    make_classification(tmp_path / "d.h5", n=64)
    bad = config(tmp_path / "d.h5", data={"inputs": "nope"})
    for _ in range(600):
        with pytest.raises(DataError, match="no dataset 'nope'"):
            Trainer(bad, log=lambda *a: None)
    mesh = Mesh(comm=MPI.COMM_SELF)  # communicators are still there to be had
    mesh.free()
