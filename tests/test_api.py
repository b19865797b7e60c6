"""The Python API used as docs/api.md shows it, where a script can go wrong: a mesh of sizes that are not
sizes, a config the Trainer does not run, a failed construction caught and retried."""

import pytest
from mpi4py import MPI

from helpers import config, make_classification
from hpctrain.errors import ConfigError, DataError, HpctrainError, LayoutError
from hpctrain.parallel.mesh import Mesh
from hpctrain.train import Trainer


@pytest.mark.parametrize("kwargs, message", [
    ({"pp": 0}, r"pp = 0 \(parallel.pp\): expected a positive integer"),
    ({"tp": -1}, r"tp = -1 \(parallel.tp\): expected a positive integer"),
    ({"dp": 1.0}, r'dp = 1.0 \(parallel.dp\): expected a positive integer or "auto"'),
    ({"dp": "AUTO"}, r"dp = 'AUTO' \(parallel.dp\): expected a positive integer or \"auto\""),
    ({"tp": True}, r"tp = True \(parallel.tp\): expected a positive integer"),
    ({"comm": "x"}, "Mesh\\(comm=...\\): expected an mpi4py communicator, got str"),
])
def test_a_mesh_of_sizes_that_are_not_sizes_is_a_layout_error(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        Mesh(**kwargs)


def test_numpy_integers_are_sizes():
    import numpy as np

    mesh = Mesh(dp=np.int64(1), pp=np.int32(1), comm=MPI.COMM_SELF)
    assert (mesh.dp, mesh.pp, mesh.tp) == (1, 1, 1) and type(mesh.dp) is int
    mesh.free()


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


def test_a_parsed_config_reads_back_the_same_from_anywhere(tmp_path, monkeypatch):
    """parse_config's relative paths (against base_dir, "." by default) are made absolute: cfg.to_toml() saved in
    another folder loads back to an equal config (which file it came from is not part of the config)."""
    from hpctrain.config import load_config, parse_config

    monkeypatch.chdir(tmp_path)
    cfg = parse_config({"model": {"layers": [{"type": "linear", "in": 64, "out": 10}]},
                        "data": {"path": "digits.h5", "inputs": "x", "targets": "y"},
                        "checkpoint": {"dir": "runs/x"}})
    assert cfg.data.path == str(tmp_path / "digits.h5") and cfg.checkpoint.dir == str(tmp_path / "runs" / "x")
    (tmp_path / "elsewhere").mkdir()
    saved = tmp_path / "elsewhere" / "saved.toml"
    saved.write_text(cfg.to_toml())
    assert load_config(str(saved)) == cfg


@pytest.mark.parametrize("data, message", [([], "a config is a table of sections"),
                                           ({1: {}}, "a section name must be a string, got 1")])
def test_parse_config_of_what_is_no_config_is_a_config_error(data, message):
    from hpctrain.config import parse_config

    with pytest.raises(ConfigError, match=message):
        parse_config(data)


def test_a_closed_trainer_says_so(tmp_path):
    make_classification(tmp_path / "d.h5", n=64)
    trainer = Trainer(config(tmp_path / "d.h5", train={"steps": 2}), log=lambda *a: None)
    trainer.run()
    trainer.close()
    trainer.close()  # a second close does nothing
    for call in (trainer.run, trainer.evaluate, trainer.state_dict, lambda: trainer.train_step(2, 0.1)):
        with pytest.raises(HpctrainError, match=r"this Trainer is closed \(close\(\) gave back its data file"):
            call()
