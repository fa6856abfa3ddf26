"""FLOP accounting: torch's FlopCounterMode against an analytic count of the layers (the named
reference), the issue's AlexNet anchor, peaks and MFU arithmetic."""

import json

import pytest
from torch import nn

from ddp_lab.perf import compute
from ddp_lab.models import AlexNet, AlexNetCifar


@pytest.mark.parametrize("make, size", [(lambda: AlexNet(num_classes=1000), 224),
                                        (lambda: AlexNetCifar(num_classes=10), 32)])
def test_counter_matches_analytic_count_of_the_layers(make, size):
    model = make()
    counted = compute.count_flops(model, (3, size, size))
    analytic, layers = compute.analytic_flops(model, size)
    assert counted.forward == analytic.forward
    assert counted.backward == analytic.backward
    assert [l["kind"] for l in layers] == ["conv"] * 5 + ["linear"] * 3


def test_alexnet_anchor_4_14_gflop_per_training_step():
    flops, layers = compute.analytic_flops(AlexNet(num_classes=1000), 224)
    assert layers[0]["forward"] == 2 * 64 * 55 * 55 * 3 * 11 * 11  # conv1: 55x55 output
    assert layers[-1]["forward"] == 2 * 4096 * 1000
    assert flops.forward == pytest.approx(1.428e9, rel=1e-3)  # = 0.714 GMAC: the seed's "0.7 G"
    assert flops.step == pytest.approx(4.14e9, rel=2e-3)  # the 4.14 GFLOP / image / step
    # backward = 2 x forward, except the first layer's input gradient
    assert flops.backward == 2 * flops.forward - layers[0]["forward"]


def test_count_leaves_real_model_untouched():
    model = AlexNetCifar()
    before = model.features[0].weight.clone()
    compute.count_flops(model, (3, 32, 32))
    assert model.features[0].weight.device.type == "cpu" and model.features[0].weight.equal(before)


def test_analytic_refuses_layers_it_cannot_count():
    with pytest.raises(ValueError, match="BatchNorm2d"):
        compute.analytic_flops(nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8)), 32)
    with pytest.raises(ValueError, match="expects 4 channels"):
        compute.analytic_flops(nn.Sequential(nn.Conv2d(4, 8, 3)), 32)


def test_peaks_and_mfu():
    assert compute.datasheet_peak("NVIDIA H200", "bf16") == pytest.approx(989.4)
    assert compute.datasheet_peak("NVIDIA H100 80GB HBM3", "fp32") == 67.0
    assert compute.device_family("NVIDIA H100 PCIe") == "H100 PCIe"
    assert compute.datasheet_peak("cpu", "fp32") != compute.datasheet_peak("cpu", "fp32")  # nan
    achieved = compute.achieved_tflops(4.14e9, 35.6e3)  # the bf16 + channels_last anchor
    assert achieved == pytest.approx(147.4, rel=1e-3)
    assert compute.mfu(achieved, 989.4) == pytest.approx(0.149, rel=1e-2)
    assert compute.mfu(1.0, float("nan")) != compute.mfu(1.0, float("nan"))


def test_measured_peaks_from_gemm_rows(tmp_path):
    rows = [{"device": "cuda", "dtype": "bf16", "n": 4096, "tflops": 700.0, "ok": True},
            {"device": "cuda", "dtype": "bf16", "n": 8192, "tflops": 781.0, "ok": True},
            {"device": "cuda", "dtype": "fp32", "n": 8192, "tflops": 900.0, "ok": False},  # wrong
            {"device": "cuda", "dtype": "fp32", "n": 4096, "tflops": 51.0, "ok": True},
            {"device": "cpu", "dtype": "fp32", "n": 4096, "tflops": 1.1, "ok": True}]
    path = tmp_path / "gemm.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert compute.measured_peaks(str(path)) == {"bf16": 781.0, "fp32": 51.0}


def test_the_command_line_prints_both_alexnets(capsys):
    """`python -m ddp_lab.perf.compute`: counted and analytic FLOPs of both AlexNets."""
    compute._main()
    out = capsys.readouterr().out
    assert "alexnet_cifar" in out and "analytic_step_gflop" in out
