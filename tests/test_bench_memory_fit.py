"""Memory-fit estimator: the seed's table reproduced (and corrected), GPU counts per GPU size, a
raw parameter count, a torchvision name, predicted memory without a GPU, clear errors."""

import json
import re

import pytest
import torch

from ddp_lab.bench.memory_fit import fit_rows
from ddp_lab.config import ConfigError
from background import background
from helpers import bench_rows, check
from launchers import ranks


def memory_fit(args: list[str], run_dir, timeout: float):
    """(the finished process, run_dir)"""
    return ranks(args + [f"hydra.run.dir={run_dir}"], nproc=0, module="ddp_lab.bench.memory_fit",
                 timeout=timeout), run_dir


@background(cost=4)
def seed_table(run_dir):
    return memory_fit(["params=[1e9]", "plot=true"], run_dir, timeout=120)


@background(cost=25)
def measured(run_dir):
    return memory_fit(["models=[resnet50]", "measure=true", "device=cpu",
                       "measure_model=alexnet_cifar", "measure_batch=4", "measure_steps=1",
                       "measure_precisions=[fp32]", "measure_zero=[0,2,3]"], run_dir, timeout=240)


@background(cost=4)
def bad_zero_stage(run_dir):
    return memory_fit(["measure_zero=[4]"], run_dir, timeout=60)


@background(cost=5)
def unknown_model(run_dir):
    return memory_fit(["models=[no_such_net]"], run_dir, timeout=60)


def load(path):
    return [json.loads(line) for line in open(path)]


def test_seed_table_and_a_raw_count(seed_table):
    proc, run_dir = seed_table
    bench_rows(proc, run_dir, "memory_fit")
    bench_rows(proc, run_dir, "seed_table", plot=False)
    zero = {r["stage"]: r for r in bench_rows(proc, run_dir, "zero", plot=False)
            if r["model"] == "1e+09 params"}
    assert zero[2]["gb_per_gpu_at_8"] == pytest.approx(2 + 14 / 8) and zero[3]["gpus"] == 1
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


def test_torchvision_model_and_predicted_memory_on_cpu(measured):
    proc, run_dir = measured
    check(proc)
    rows = load(run_dir / "memory_fit.jsonl")
    assert rows[0]["params_b"] == pytest.approx(25_557_032 / 1e9)
    assert not (run_dir / "seed_table.jsonl").exists()  # no seed model asked for
    m = load(run_dir / "memory_measured.jsonl")[0]
    assert m["pred_weights_gb"] == pytest.approx(23_272_266 * 4 / 1e9, rel=1e-3)
    assert m["measured_peak_gb"] != m["measured_peak_gb"]  # nan: no CUDA allocator here
    zero = {r["stage"]: r for r in load(run_dir / "zero_measured.jsonl")}
    assert sorted(zero) == [0, 2, 3]
    held = ("params_gb", "grads_gb", "optimizer_state_gb", "comm_buffer_gb", "comm_scratch_gb")
    p, fc = zero[0]["params_gb"], 4096 * 4096 * 4 / 1e9  # the 4096x4096 layer: a bucket, a unit
    for stage, r in zero.items():  # at world size 1 the count is the design's (AdamW's step
        # counters aside: 4 B a tensor), every stage: ZeRO-2/3 free what they pack
        assert sum(r[k] for k in held) == pytest.approx(r["pred_held_gb"], rel=1e-6)
        assert r["optimizer_state_gb"] == pytest.approx(2 * p)  # AdamW
        # the activations, input and autocast copies come on top of the held bytes alike
        assert r["pred_peak_gb"] - r["pred_held_gb"] == pytest.approx(
            zero[0]["pred_peak_gb"] - zero[0]["pred_held_gb"])
    assert zero[0]["comm_buffer_gb"] == zero[0]["grads_gb"] == p  # a flat copy of every gradient
    # zero>=2: buffers as large as the two largest buckets (at 25 MB buckets the 4096x4096 weight
    # alone, and all below it: every bucket but the first, the last layer and that weight's
    # bias; at zero=3 units: that layer with its bias, and the 1024 -> 4096 one); in a step the
    # shards' gradients (the whole, at N=1) and the largest bucket's, made and not yet packed
    unit, fc1 = fc + 4096 * 4 / 1e9, (1024 + 1) * 4096 * 4 / 1e9
    assert zero[2]["comm_buffer_gb"] == pytest.approx(p - (4096 * 10 + 10 + 4096) * 4 / 1e9)
    assert zero[2]["grads_gb"] == pytest.approx(p + fc)
    assert zero[3]["comm_buffer_gb"] == pytest.approx(unit + fc1)
    assert zero[3]["grads_gb"] == pytest.approx(p + unit)
    # zero=3: the shards (the whole, at N=1) and two units gathered: that layer and the one
    # prefetched for the backward after it (1024 -> 4096 and its bias)
    assert zero[3]["params_gb"] == pytest.approx(p + unit + fc1)


def test_the_predicted_peak_counts_the_data_pipelines_device_bytes(monkeypatch):
    """The data source's device bytes in the predicted peak, held against a measure_zero run's
    data built on the CPU and counted from its storages: the training stream's fetch window (6
    bf16 or 3 fp32 batches here, as on the H100 page at 224 px, each image with its int64 label)
    and the two synthetic sets as stored (a pool of data.pool_size images and the labels each),
    where the prediction used to count one fp32 batch."""
    import ddp_lab.data.streams as streams
    from ddp_lab.bench.zero_peak import predicted_peak_parts, zero_train_config
    from ddp_lab.cli import compose
    from ddp_lab.data import build_data

    cpu, image = torch.device("cpu"), 3 * 32 * 32  # alexnet_cifar's 32 px images
    monkeypatch.setattr(streams, "FETCH_MAX_BYTES", 6 * 32 * image * 2 + 5)  # 6 bf16 batches
    cfg = compose(["measure_model=alexnet_cifar", "measure_batch=32", "measure_steps=1"],
                  "bench/memory_fit")
    for precision, itemsize, batches in (("bf16", 2, 6), ("fp32", 4, 3)):
        data = build_data(zero_train_config(cfg, 0, precision, cpu), 0, 1, cpu)
        x, y = next(data.train.epoch(0, last_epoch=0))  # the run's 3 steps: in epoch 0
        window = x.untyped_storage().nbytes() + y.untyped_storage().nbytes()
        assert window == batches * 32 * (image * itemsize + 8)
        sets = sum(t.untyped_storage().nbytes() for s in (data.train.dataset, data.val.dataset)
                   for t in (s.pool, s.labels))
        assert sets == 2 * 256 * image * itemsize + (50_000 + 32) * 8  # pools; labels: 50,000 + 32
        summary = {"device": "cpu", "memory": {"zero": 0, "predicted": {"params_bytes": [5]}}}
        parts = predicted_peak_parts(cfg, precision, summary)
        assert parts.keys() == {"params_bytes", "activations_bytes", "autocast_copies_bytes",
                                "data_window_bytes", "data_sets_bytes"}  # no one-batch input
        assert (parts["data_window_bytes"], parts["data_sets_bytes"]) == (window, sets)


def test_unknown_model_is_one_clear_line(unknown_model):
    proc, _ = unknown_model
    assert proc.returncode == 2 and "unknown model 'no_such_net'" in proc.stderr


def test_a_zero_stage_that_cannot_train_is_refused_up_front(bad_zero_stage):
    proc, run_dir = bad_zero_stage
    assert proc.returncode == 2 and "measure_zero=[4]: stages are 0, 1, 2, 3" in proc.stderr
    assert "Traceback" not in proc.stderr and not (run_dir / "memory_fit.jsonl").exists()


def test_zero_stages_per_gpu_and_gpus_needed():
    """The Playbook's arithmetic (mixed precision + Adam, P params): per GPU 16P, 4P + 12P/N,
    2P + 14P/N, 16P/N; the fewest GPUs of G GB at which stage s fits, or never."""
    from types import SimpleNamespace

    from ddp_lab.bench.memory_fit import zero_rows
    from ddp_lab.perf import memory as mem

    cfg = SimpleNamespace(zero_stages=[0, 1, 2, 3], zero_gpus=[1, 8, 64], zero_scheme="mixed",
                          optimizer="adam", gpu_gb=80.0)
    rows = {r["stage"]: r for r in zero_rows("llama2_70b", 70e9, cfg)}
    p = 70.0  # GB per byte-per-parameter
    for n in (1, 8, 64):
        assert rows[0][f"gb_per_gpu_at_{n}"] == pytest.approx(16 * p)
        assert rows[1][f"gb_per_gpu_at_{n}"] == pytest.approx(4 * p + 12 * p / n)
        assert rows[2][f"gb_per_gpu_at_{n}"] == pytest.approx(2 * p + 14 * p / n)
        assert rows[3][f"gb_per_gpu_at_{n}"] == pytest.approx(16 * p / n)
    # 70B: only ZeRO-3 fits 80 GB GPUs (2P = 140 GB of weights stay whole at stage 2): 1120/80
    assert [rows[s]["gpus"] for s in range(4)] == ["never", "never", "never", 14]
    # 7B: weights + grads (28 GB) stay whole at stage 1, so 84 GB of states over N: N = 2
    assert mem.gpus_for_zero(7e9, 1, 80.0) == 2 and mem.gpus_for_zero(7e9, 0, 80.0) is None
    assert mem.gpus_for_zero(7e9, 0, 141.0) == 1  # 112 GB fits one H200 unsharded
    assert mem.zero_bytes(1e9, 2, 4, "fp32", "sgd_momentum") == pytest.approx(
        {"weights": 4e9, "grads": 1e9, "optimizer": 1e9, "master": 0.0, "total": 6e9})
    with pytest.raises(ValueError, match="stage must be one of"):
        mem.zero_bytes(1e9, 4, 2)


def test_measure_overrides_reach_every_measured_run():
    """measure_overrides come last in each measure_zero run's config, so they win over the
    benchmark's own settings: cuDNN's autotuner off (on by default), fewer log lines."""
    from ddp_lab.bench.zero_peak import zero_train_config
    from ddp_lab.cli import compose

    cpu = torch.device("cpu")
    plain = compose(["measure_model=alexnet_cifar", "measure_batch=32"], "bench/memory_fit")
    assert zero_train_config(plain, 3, "fp32", cpu).train.cudnn_benchmark is True
    cfg = compose(["measure_model=alexnet_cifar", "measure_batch=32",
                   'measure_overrides=["train.cudnn_benchmark=false","train.log_every=1"]'],
                  "bench/memory_fit")
    run = zero_train_config(cfg, 3, "fp32", cpu)
    assert run.train.cudnn_benchmark is False and run.train.log_every == 1
    assert run.train.batch_size == 32 and run.sync.zero == 3 and run.sync.name == "ring"


@pytest.mark.parametrize("override", ["train.batch_size=8", "model.fc_width=512",
                                      "+sync.zero=1", "optim=sgd", "precision=fp16"])
def test_measure_overrides_cannot_change_what_the_prediction_reads(override):
    """The predicted peak is made from measure_batch, measure_model, ... (zero_peak.py): an
    override of those would train one run and predict another. One line, before any run."""
    from ddp_lab.bench.memory_fit import image_shape
    from ddp_lab.cli import compose

    cfg = compose([f'measure_overrides=["{override}"]'], "bench/memory_fit")
    with pytest.raises(ConfigError, match=f"measure_overrides: '{re.escape(override)}' sets"):
        image_shape(cfg)
