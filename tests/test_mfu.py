"""MFU (hpctrain/train/mfu.py): the model's training FLOPs against the device's peak, in the log and the metrics."""

import pytest

from helpers import config, make_classification, run_trainer
from hpctrain.config import parse_config
from hpctrain.errors import ConfigError
from hpctrain.nn.gpt import make_model
from hpctrain.parallel.mesh import Mesh
from hpctrain.train.mfu import Peak, device_peak, measured_cpu_peak


@pytest.fixture(scope="module")
def mesh():
    m = Mesh()
    yield m
    m.free()


def nanogpt_flops_per_token(n_params_non_embedding, L, H, Q, T):
    """nanoGPT's model.py estimate_mfu, line for line (per token: fwdbwd = flops_per_token · T per sample)."""
    return 6 * n_params_non_embedding + 12 * L * H * Q * T


def test_the_gpt_counts_nanogpts_flops_for_gpt2_small():
    cfg = parse_config({"model": {"kind": "gpt", "vocab_size": 50304, "block_size": 1024, "n_layer": 12,
                                  "n_head": 12, "n_embd": 768},
                        "data": {"path": "x.h5", "tokens": "tokens"}})
    spec = make_model(cfg.model)
    N = spec.layout.size - 1024 * 768  # nanoGPT's get_num_params(non_embedding=True): wpe left out
    assert N == 123_689_472  # nanoGPT prints "number of parameters: 123.69M" for gpt2 with vocab_size 50304
    assert spec.training_flops() == nanogpt_flops_per_token(N, 12, 12, 64, 1024) * 1024


def test_a_dense_network_counts_six_flops_per_weight_and_sample():
    spec = make_model(parse_config({"model": {"layers": [{"type": "linear", "in": 64, "out": 32, "bias": False},
                                                        {"type": "relu"},
                                                        {"type": "linear", "in": 32, "out": 10, "bias": False}]},
                                    "data": {"path": "x.h5", "inputs": "x", "targets": "y"}}).model)
    assert spec.training_flops() == 6 * (64 * 32 + 32 * 10)


@pytest.mark.parametrize("name, precision, tflops", [
    ("NVIDIA H100 80GB HBM3", "fp32", 66.9), ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 PCIe", "fp32", 51.2), ("NVIDIA H200", "tf32", 494.7), ("NVIDIA A100-SXM4-40GB", "bf16", 312.0),
    ("NVIDIA A10", "fp32", 31.2), ("Tesla V100-SXM2-16GB", "bf16", None), ("SIMULATOR", "fp32", None)])
def test_the_peak_table_takes_the_most_specific_name_first(name, precision, tflops):
    assert device_peak(name, precision) == tflops


def test_mfu_is_the_share_of_the_worlds_peak():
    peak = Peak(100e12, "test")
    assert peak.mfu(samples_per_s=50, flops_per_sample=1e12, ranks=2) == pytest.approx(0.25)
    assert Peak(0.0, "unknown device").mfu(50, 1e12, 2) is None


def test_a_cpu_peak_is_measured_and_plausible():
    tflops = measured_cpu_peak(n=256, repeats=2)
    assert 1e-4 < tflops < 100  # above 0.1 GFLOP/s, below any CPU


@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan")])
def test_a_peak_that_is_no_number_of_tflops_is_refused(tmp_path, value):
    with pytest.raises(ConfigError, match="train.peak_tflops"):
        config(tmp_path / "d.h5", train={"peak_tflops": value})


def test_an_mlp_run_on_the_cpu_measures_its_peak(tmp_path, mesh):
    make_classification(tmp_path / "d.h5")
    lines = []
    run_trainer(config(tmp_path / "d.h5"), mesh, log=lines.append)
    if mesh.rank == 0:
        assert any(line.startswith("MFU against ") and "measured" in line for line in lines)


def test_a_device_whose_name_cannot_be_read_logs_no_mfu_and_does_not_raise(monkeypatch):
    """Only the logging rank asks: a raise there would leave the other ranks waiting in a collective."""
    from numba import cuda

    class Device:
        is_device = True

    def no_driver():
        raise RuntimeError("CUDA driver library cannot be found")

    monkeypatch.setattr(cuda, "get_current_device", no_driver)
    peak = Peak.of(Device())
    assert peak.flops == 0 and "no MFU" in peak.source
    assert Peak.of(Device(), override_tflops=2.0).flops == 2e12


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_the_peak_is_the_runs_precisions(tmp_path, mesh, monkeypatch, precision):
    """MFU's denominator is the peak of the run's ``train.precision`` (docs/config.md's peak_tflops): a bf16 run on
    a GPU against the tensor cores' bf16 figure, not the CUDA cores' float32 one."""
    from hpctrain.train import loop

    asked = []

    def of(cls, backend, override_tflops=0.0, precision="fp32"):
        asked.append(precision)
        return cls(1e12, "test")

    monkeypatch.setattr(loop.Peak, "of", classmethod(of))
    make_classification(tmp_path / "d.h5")
    run_trainer(config(tmp_path / "d.h5", train={"precision": precision, "steps": 1}), mesh)
    assert asked == ([precision] if mesh.rank == 0 else [])
