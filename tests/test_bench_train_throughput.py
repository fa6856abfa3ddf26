"""train_throughput on the CPU: a tiny AlexNet-CIFAR case (batch 8, 3 steps) runs both loops and
writes one table row with both, plus the profiler pass; the tensor-core name heuristic."""

import json
import os

import pytest

from ddp_lab.bench.kernels import is_tensor_core_kernel
from ddp_lab.bench.train_throughput import paired_ratios
from background import background
from helpers import bench_rows
from launchers import ranks


@background(cost=21)
def tiny_cpu_case(run_dir):
    return ranks(["device=cpu", "cpu_net=alexnet_cifar", "cpu_batches=[8]", "cpu_steps=3",
                  "cpu_warmup=1", "cpu_precisions=[fp32]", "channels_last=[false]",
                  "profile=true", "profile_steps=1", "plot=true",
                  f"hydra.run.dir={run_dir}"], nproc=0, module="ddp_lab.bench.train_throughput",
                 timeout=240), run_dir


# GEMM peaks as ddp_lab.bench.gemm writes them: the CPU's best fp32 is 3.0 TFLOP/s
GEMM_ROWS = [{"device": "cpu", "dtype": "fp32", "n": 1024, "tflops": 2.0, "ok": True},
             {"device": "cpu", "dtype": "fp32", "n": 2048, "tflops": 3.0, "ok": True},
             {"device": "cpu", "dtype": "fp32", "n": 4096, "tflops": 9.0, "ok": False},
             {"device": "cuda", "dtype": "fp32", "n": 4096, "tflops": 50.0, "ok": True}]


@background(cost=25)
def digits_case(run_dir):
    # batch 256: an epoch of digits is 5 steps, so the 7 steps cross one; a classifier 512 wide
    # (helpers.SMALL's) in both loops, as this is not a measurement
    run_dir.mkdir(parents=True, exist_ok=True)
    gemm = run_dir / "gemm.jsonl"
    gemm.write_text("".join(json.dumps(r) + "\n" for r in GEMM_ROWS))
    return ranks(["device=cpu", "cpu_net=alexnet_cifar", "cpu_batches=[256]", "cpu_steps=6",
                  "cpu_warmup=1", "cpu_precisions=[fp32]", "channels_last=[false]",
                  "predict_memory=false",
                  "ddp_overrides=['data=digits','model.fc_width=512']",
                  f"gemm_results={gemm}", f"hydra.run.dir={run_dir}"],
                 nproc=0, module="ddp_lab.bench.train_throughput", timeout=240), run_dir


def test_real_data_rows_time_every_step_across_epochs(digits_case):
    """ddp_overrides=[data=digits]: the loop trains on digits (the bare loop stays on its own
    tensors) and every asked step is timed, across epoch ends: one checkpoint, at the end. MFU
    against the GEMM peak measured on this run's device (gemm_results=)."""
    proc, run_dir = digits_case
    [r] = bench_rows(proc, run_dir, "train_throughput", plot=False)
    assert r["ok"] and r["steps"] == 6
    assert r["mfu_gemm"] == pytest.approx(r["ddp_tflops"] / 3.0)
    ddp_run = run_dir / "ddp_lab" / "fp32_cl0_compile0_b256_r0"
    summary = json.load(open(ddp_run / "summary.json"))
    assert summary["data"] == "digits" and summary["timed_steps"] == 6
    assert summary["total_steps"] == 7 > 1437 // 256
    saves = [l for l in open(ddp_run / "train.log") if "checkpoint saved" in l]
    assert len(saves) == 1 and "step 7:" in saves[0], saves  # not one at the epoch's end (5)


def test_tiny_cpu_case_writes_both_loops(tiny_cpu_case):
    proc, run_dir = tiny_cpu_case
    rows = bench_rows(proc, run_dir, "train_throughput")
    assert len(rows) == 1
    r = rows[0]
    assert (r["model"], r["precision"], r["batch"], r["steps"]) == ("alexnet_cifar", "fp32", 8, 3)
    assert r["ok"] and r["ddp_img_s"] > 0 and r["bare_img_s"] > 0
    assert r["ratio"] == pytest.approx(r["ddp_img_s"] / r["bare_img_s"])
    assert r["ratio_med"] == pytest.approx(r["ddp_img_s_med"] / r["bare_img_s_med"])
    assert r["ratio_paired"] == r["ratio_lo"] == r["ratio_hi"] == pytest.approx(r["ratio"])
    assert r["ratio_med_paired"] == pytest.approx(r["ratio_med"])
    assert r["gflop_per_img"] == pytest.approx(0.3756, rel=1e-3)
    assert r["ddp_tflops"] == pytest.approx(r["gflop_per_img"] * r["ddp_img_s"] / 1e3)
    assert r["pred_mem_gb"] > 3 * 23_272_266 * 4 / 1e9  # weights + grads + momentum + more
    # The ddp_lab side really ran the training loop, in its own run dir, checkpoint removed.
    ddp_dir = run_dir / "ddp_lab" / "fp32_cl0_compile0_b8_r0"
    summary = json.load(open(ddp_dir / "summary.json"))
    assert summary["timed_steps"] == 3 and summary["sync"] == "none" and summary["data"] == "synthetic"
    assert summary["train_img_per_s"] == pytest.approx(r["ddp_img_s"])
    assert not any(f.endswith(".pt") for f in os.listdir(ddp_dir))
    # Profiler pass (CPU ops on a CPU).
    kernels = [json.loads(line) for line in open(run_dir / "kernels.jsonl")]
    assert kernels and all(k["precision"] == "fp32" for k in kernels)
    assert (run_dir / "profile_summary.csv").exists()


@pytest.mark.parametrize("name, tc", [
    ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_tilesize128x128x64", True),
    ("sm80_xmma_gemm_tf32f32_tf32f32_f32_tn_n_tilesize128x128x16_stage4", True),
    ("cutlass3x_sm90_tensorop_gemm_f16_f16_f32_f16_f16_128x256x64_1x2x1_0_tnn_align8", True),
    ("ampere_fp16_s16816gemm_fp16_128x128_ldg8_f2f_stages_64x3_nn", True),
    ("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT", True),
    ("sm90_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x8_stage3_warpsize2x2x1_ffma", False),
    ("ampere_sgemm_128x64_nn", False),
    ("implicit_convolve_sgemm<float, float, 1024, 5, 5, 3, 3, 3, 1, false, false, true>", False),
    ("void cutlass::Kernel<cutlass_80_simt_sgemm_128x128_8x4_nn_align1>", False),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<c10::BFloat16>>", False),
    ("void at::native::(anonymous namespace)::max_pool_forward_nhwc<float, float>", False),
])
def test_tensor_core_heuristic(name, tc):
    assert is_tensor_core_kernel(name) is tc


def test_paired_ratios_pair_each_repeats_loops_not_the_medians():
    """The host's speed changes between repeats, both loops' alike: each repeat's own ratio is
    what is reported, with its range."""
    bares = [{"img_s": v, "img_s_med": v} for v in (100.0, 200.0, 300.0)]
    ddps = [{"img_s": v, "img_s_med": m} for v, m in ((90.0, 95.0), (180.0, 150.0), (270.0, 270.0))]
    out = paired_ratios(ddps, bares)
    assert out["ratio_paired"] == pytest.approx(0.9) and out["ratios"] == pytest.approx([0.9] * 3)
    # median of 0.95, 0.75, 0.9 (the ratio of the medians would be 150 / 200)
    assert out["ratio_med_paired"] == pytest.approx(0.9)
    out = paired_ratios([{"img_s": v, "img_s_med": v} for v in (95.0, 150.0, 270.0)], bares)
    assert (out["ratio_lo"], out["ratio_paired"], out["ratio_hi"]) == pytest.approx((0.75, 0.9, 0.95))
    with pytest.raises(ValueError):  # a repeat without its pair is a bug, not a shorter median
        paired_ratios(ddps[:2], bares)
