"""Memory accounting: bytes per parameter for known counts, GPU counts, parameter counts of
published architectures, and activation bytes of a model small enough to count by hand."""

import pytest
import torch
from torch import nn

from ddp_lab.models import AlexNetCifar
from ddp_lab.perf import memory as mem


def test_fp32_sgd_momentum_is_12_bytes_per_param():
    b = mem.training_bytes(1e9, "fp32", "sgd_momentum")
    assert (b["weights"], b["grads"], b["optimizer"], b["master"]) == (4e9, 4e9, 4e9, 0)
    assert b["total"] == 12e9 and b["bytes_per_param"] == 12


def test_mixed_precision_adam_is_the_usual_16_bytes_per_param():
    b = mem.training_bytes(1e9, "mixed", "adam")
    assert (b["weights"], b["grads"], b["master"], b["optimizer"]) == (2e9, 2e9, 4e9, 8e9)
    assert b["bytes_per_param"] == 16
    assert mem.training_bytes(1e9, "fp32", "adam")["bytes_per_param"] == 16  # no saving
    amp = mem.training_bytes(1e9, "torch_amp", "adamw")
    assert amp["bytes_per_param"] == 16 and amp["transient"] == 2e9
    assert mem.training_bytes(1e9, "bf16", "adam")["bytes_per_param"] == 8
    assert mem.training_bytes(1e9, "fp32", "sgd")["bytes_per_param"] == 8
    with pytest.raises(ValueError, match="unknown scheme"):
        mem.training_bytes(1, "fp8")


def test_inference_and_gpu_counts():
    assert mem.inference_bytes(175e9, "fp32") == 700e9  # the seed's "FP32" column
    assert mem.inference_bytes(70e9, "int8") == 70e9
    assert mem.gpus_needed(16 * 175e9, 80) == 35
    assert mem.gpus_needed(280e9, 80) == 4
    assert mem.gpus_needed(140e9, 141) == 1 and mem.gpus_needed(141.5e9, 141) == 2
    assert mem.gpus_needed(1, 80) == 1


def test_parameter_counts():
    assert mem.transformer_params(96, 12288, 50257, positions=2048) == pytest.approx(174.6e9, rel=2e-3)
    assert mem.PRESETS["llama2_70b"][1] == pytest.approx(68.98e9, rel=2e-3)
    assert mem.PRESETS["llama2_7b"][1] == pytest.approx(6.74e9, rel=2e-3)
    assert mem.count_parameters("gpt3_175b") == 175e9
    assert mem.count_parameters("alexnet") == 61_100_840
    assert mem.count_parameters("resnet50") == 25_557_032  # torchvision, built on meta
    with pytest.raises(ValueError, match="unknown model"):
        mem.count_parameters("no_such_net")


def test_activation_bytes_of_a_model_counted_by_hand():
    # Saved for backward per sample: ReLU output (20 fp32, also linear2's input: one storage),
    # log_softmax output (5 fp32), the int64 target; the input and the parameters are left out.
    # Fixed: nll_loss's 0-d total_weight.
    model = nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))
    assert mem.activation_bytes(model, (10,)) == (20 * 4 + 5 * 4 + 8, 4)
    # bf16 autocast: x copy (10), ReLU output (20) in bf16; the bf16 copy of linear2's weight
    # (backward needs it for linear2's input gradient; linear1's copy is not kept) is fixed.
    assert mem.activation_bytes(model, (10,), torch.bfloat16) == (10 * 2 + 20 * 2 + 5 * 4 + 8,
                                                                 100 * 2 + 4)


def test_predicted_training_memory_parts():
    model = AlexNetCifar()
    params = sum(p.numel() for p in model.parameters())
    fp32 = mem.predict_training_memory(model, 8, 32, "fp32")
    assert (fp32["weights"], fp32["grads"], fp32["optimizer"]) == (4 * params,) * 3
    assert fp32["autocast_copies"] < 1e3 and fp32["input"] == 8 * (3 * 32 * 32 * 4 + 8)
    assert fp32["activations"] == 8 * fp32["activations_per_sample"] > 0
    bf16 = mem.predict_training_memory(model, 8, 32, "bf16")
    assert bf16["autocast_copies"] == pytest.approx(2 * params, rel=0.01)  # conv1's copy not kept
    assert bf16["activations"] < fp32["activations"]
    assert fp32["total"] == sum(fp32[k] for k in ("weights", "grads", "optimizer", "autocast_copies",
                                                 "input", "activations"))
