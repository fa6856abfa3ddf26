"""Memory-fit estimator: the seed's table reproduced (and corrected), GPU counts per GPU size, a
raw parameter count, a torchvision name, predicted memory without a GPU, clear errors."""

import json

import pytest

from ddp_lab.bench.memory_fit import fit_rows
from helpers import bench_rows, check, launch_together, python_module


def memory_fit(args: list[str], run_dir, timeout: float):
    return python_module(args + [f"hydra.run.dir={run_dir}"], module="ddp_lab.bench.memory_fit",
                         timeout=timeout)


@launch_together("memory_fit_seed_table", cost=4)
def _seed_table(run_dir):
    return memory_fit(["params=[1e9]", "plot=true"], run_dir, timeout=120)


@launch_together("memory_fit_measured", cost=9)
def _measured(run_dir):
    return memory_fit(["models=[resnet50]", "measure=true", "device=cpu",
                       "measure_model=alexnet_cifar", "measure_batch=4", "measure_steps=1",
                       "measure_precisions=[fp32]"], run_dir, timeout=180)


@launch_together("memory_fit_unknown", cost=5)
def _unknown(run_dir):
    return memory_fit(["models=[no_such_net]"], run_dir, timeout=60)


def load(path):
    return [json.loads(line) for line in open(path)]


def test_seed_table_and_a_raw_count(together):
    proc, run_dir = together["memory_fit_seed_table"].result()
    bench_rows(proc, run_dir, "memory_fit")
    bench_rows(proc, run_dir, "seed_table", plot=False)
    seed = {r["model"]: r for r in load(run_dir / "seed_table.jsonl")}
    g, l = seed["gpt3_175b"], seed["llama2_70b"]
    assert g["fp32_weights_gb"] == g["seed_fp32_gb"] == 700  # the seed's FP32 = weights only
    assert l["fp32_weights_gb"] == l["seed_fp32_gb"] == 280
    assert g["seed_b_per_param"] == pytest.approx(1.6) == l["seed_b_per_param"]  # no such format
    assert (g["fp16_weights_gb"], g["mixed_adam_train_gb"]) == (350, 2800)
    assert (g["gpus_seed_mixed"], g["gpus_fp16_infer"], g["gpus_train"]) == (4, 5, 35)  # A100 80GB
    assert (l["gpus_fp16_infer"], l["gpus_train"], l["h200s_train"]) == (2, 14, 8)
    rows = {(r["model"], r["scheme"]): r for r in load(run_dir / "memory_fit.jsonl")}
    one = rows[("1e+09 params", "fp32_train")]
    assert one["total_gb"] == 16 and one["bytes_per_param"] == 16 and one["gpus"] == 1
    assert rows[("1e+09 params", "mixed_train")]["master_gb"] == 4


def test_gpu_count_depends_on_gpu_size():
    h200 = {r["scheme"]: r for r in fit_rows("llama2_70b", 70e9, "adam", 141)}
    a100 = {r["scheme"]: r for r in fit_rows("llama2_70b", 70e9, "adam", 80)}
    assert (h200["mixed_train"]["gpus"], a100["mixed_train"]["gpus"]) == (8, 14)
    assert (h200["bf16_infer"]["gpus"], a100["bf16_infer"]["gpus"]) == (1, 2)
    assert h200["bf16_infer"]["headroom_gb"] == pytest.approx(1.0)  # fits, but barely
    sgd = {r["scheme"]: r for r in fit_rows("x", 1e9, "sgd_momentum", 80)}
    assert sgd["fp32_train"]["total_gb"] == 12


def test_torchvision_model_and_predicted_memory_on_cpu(together):
    proc, run_dir = together["memory_fit_measured"].result()
    check(proc)
    rows = load(run_dir / "memory_fit.jsonl")
    assert rows[0]["params_b"] == pytest.approx(25_557_032 / 1e9)
    assert not (run_dir / "seed_table.jsonl").exists()  # no seed model asked for
    m = load(run_dir / "memory_measured.jsonl")[0]
    assert m["pred_weights_gb"] == pytest.approx(23_272_266 * 4 / 1e9, rel=1e-3)
    assert m["measured_peak_gb"] != m["measured_peak_gb"]  # nan: no CUDA allocator here


def test_unknown_model_is_one_clear_line(together):
    proc, _ = together["memory_fit_unknown"].result()
    assert proc.returncode == 2 and "unknown model 'no_such_net'" in proc.stderr
