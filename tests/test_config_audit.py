"""Every key of the config schema against values the code cannot honour, alone or together: each
is refused by `validate` before anything runs, with one line naming the key. Before the audit
these trained to NaN, failed with a traceback from inside torch, or ran with the setting ignored
(the refusal says which key has no effect and where)."""

import pytest
import torch

from ddp_lab.config import check_steps_reachable, validate
from ddp_lab.errors import ConfigError
from ddp_lab.models import MODELS, STEMS, build_model
from background import background
from helpers import compose_config
from launchers import python_module

REFUSED = [  # (overrides, what the message says)
    # non-finite floats: `> 0` refused nan only because nan fails every comparison; inf passed
    (["optim.lr=inf"], "optim.lr=inf must be finite"),
    (["optim.lr=nan"], "optim.lr=nan must be finite"),
    (["dist.timeout_s=inf"], "dist.timeout_s=inf must be finite"),
    # 1 ms: every rank but the first failed connecting to the store, with a traceback from torch
    (["dist.timeout_s=0.001"], "dist.timeout_s=0.001 is too short for ranks to meet"),
    (["fault.hang_rank=0", "fault.at_step=1", "fault.hang_s=nan"],
     "fault.hang_s=nan must be finite"),
    (["optim=adamw", "optim.betas=[0.9,inf]"], "optim.betas=[0.9,inf] must be finite"),
    # optimizer values torch refuses with a traceback at its construction or first step
    (["optim=adamw", "optim.betas=[0.9]"], "optim.betas=[0.9] must be two numbers in [0, 1)"),
    (["optim=adamw", "optim.betas=[1.5,0.999]"], "optim.betas=[1.5,0.999] must be two numbers"),
    (["optim=adamw", "optim.betas=[0.9,-0.1]"], "optim.betas=[0.9,-0.1] must be two numbers"),
    (["optim=adamw", "optim.eps=0"], "optim.eps=0.0 must be > 0"),
    (["optim=adamw", "optim.eps=-1"], "optim.eps=-1.0 must be > 0"),
    (["optim.momentum=-0.5"], "optim.momentum=-0.5 must be in [0, 1)"),
    (["optim.momentum=1"], "optim.momentum=1.0 must be in [0, 1)"),
    (["optim.nesterov=true", "optim.momentum=0"], "optim.nesterov=true needs optim.momentum > 0"),
    # silently trained otherwise: a floor below zero or above the peak
    (["optim.min_lr_ratio=-0.5"], "optim.min_lr_ratio=-0.5 must be in [0, 1]"),
    (["optim.min_lr_ratio=2"], "optim.min_lr_ratio=2.0 must be in [0, 1]"),
    # input sizes the architecture cannot take: a shape error deep in the first forward
    (["model.image_size=16"], "model.image_size=16: model=alexnet_cifar takes inputs of 31..46 px"),
    (["model.image_size=64"], "model.image_size=64: model=alexnet_cifar takes inputs of 31..46"),
    (["data.image_size=64"], "data.image_size=64: model=alexnet_cifar takes inputs of 31..46"),
    (["model=alexnet", "model.image_size=32"], "model=alexnet takes inputs of at least 63 px"),
    (["model=alexnet", "data.image_size=0"], "data.image_size=0 must be > 0"),
    (["model.fc_width=0"], "model.fc_width=0 must be > 0"),
    # a one-class classifier: accuracy 1.0 from the first step
    (["data=synthetic", "model.default_classes=1"], "model.default_classes=1: a classifier needs"),
    (["data=synthetic", "data.num_classes=1"], "data.num_classes=1: a classifier needs"),
    # keys nothing reads in that combination (the run would record a setting it did not have)
    (["data.num_classes=5"], "data.num_classes=5 has no effect with data=digits"),
    (["data=synthetic", "data.augment=true"],
     "data.augment=true has no effect with data=synthetic"),
    (["data=synthetic", "data.on_device=false"], "data.on_device=false has no effect with "
                                                 "data=synthetic"),
    (["sync.overlap=false"], "sync.overlap=false has no effect with sync=ddp, only with "
                             "sync=naive|ring|tree|hring; leave it at true"),
    (["sync=none", "sync.comm_dtype=bf16"], "sync.comm_dtype=bf16 has no effect with sync=none"),
    (["sync=none", "sync.bucket_mb=4"], "sync.bucket_mb=4.0 has no effect with sync=none"),
    (["sync=ring", "sync.gradient_as_bucket_view=true"],
     "sync.gradient_as_bucket_view=true has no effect with sync=ring, only with sync=ddp"),
    (["sync=tree", "sync.static_graph=true"],
     "sync.static_graph=true has no effect with sync=tree"),
    # ZeRO: a stage that does not exist, nothing to shard over, or a stage torch's does not have
    (["sync=ring", "sync.zero=4"], "sync.zero=4 is not one of 0, 1, 2, 3"),
    (["sync=ring", "sync.zero=-1"], "sync.zero=-1 is not one of 0, 1, 2, 3"),
    (["sync=none", "sync.zero=1"], "sync.zero=1 has no effect with sync=none, only with "
                                   "sync=ddp|naive|ring|tree|hring; leave it at 0"),
    (["sync=ddp", "sync.zero=2"], "sync.zero=2 with sync=ddp: torch's ZeroRedundancyOptimizer"),
    (["sync=ddp", "sync.zero=3"], "sync.zero=3 with sync=ddp: torch's fully sharded data "
                                  "parallelism is sync=fsdp"),
    (["sync=ring", "sync.zero=2", "sync.reshard_after_forward=false"],
     "sync.reshard_after_forward=false has no effect at sync.zero=2, only at sync.zero=3"),
    (["sync=ddp", "sync.reshard_after_forward=false"],
     "sync.reshard_after_forward=false has no effect with sync=ddp"),
    (["sync=ring", "sync.zero=3", "train.compile=true"],
     "train.compile=true with sync.zero=3"),
    (["precision=fp32", "precision.init_scale=1024"],
     "precision.init_scale=1024.0 has no effect with precision.grad_scaler=false"),
    (["optim=adamw", "optim.nesterov=true"], "optim.nesterov=true has no effect with optim=adamw"),
    (["optim=sgd", "optim.betas=[0.8,0.9]"], "optim.betas=[0.8,0.9] has no effect with optim=sgd"),
    (["optim.schedule=constant", "optim.min_lr_ratio=0.1"],
     "optim.min_lr_ratio=0.1 has no effect with optim.schedule=constant"),
    (["train.compile_mode=max-autotune"],
     "train.compile_mode=max-autotune has no effect with train.compile=false"),
    # a precision whose keys contradict its name (the run would be recorded as the name)
    (["precision=fp32", "precision.autocast_dtype=float16"],
     "precision.autocast_dtype=float16 contradicts precision=fp32"),
    (["precision=bf16", "precision.autocast_dtype=float16"],
     "precision.autocast_dtype=float16 contradicts precision=bf16"),
    (["precision=fp32", "precision.tf32=true"], "contradicts precision=fp32; use precision=tf32"),
    (["precision=tf32", "precision.tf32=false"], "contradicts precision=tf32; use precision=fp32"),
    (["precision=fp32", "precision.grad_scaler=true"], "precision.grad_scaler=true: loss scaling"),
    (["precision=fp16", "precision.init_scale=0"], "precision.init_scale=0.0 must be > 0"),
    (["precision=fp16", "precision.growth_interval=0"], "precision.growth_interval=0 must be > 0"),
    # steps a run of train.max_steps never reaches
    (["train.max_steps=2", "train.stop_at_step=5"],
     "train.stop_at_step=5 is past the run's last step (train.max_steps: 2)"),
    (["train.max_steps=2", "fault.kill_rank=0", "fault.at_step=3"], "fault.at_step=3 is past"),
    (["train.max_steps=2", "fault.nan_at_step=3"], "fault.nan_at_step=3 is past"),
    # fault injection that would silently do nothing
    (["fault.nan_at_step=1", "fault.nan_rank=-1"], "fault.nan_rank=-1 must be a rank (>= 0)"),
    (["fault.kill_rank=-2", "fault.at_step=1"], "fault.kill_rank=-2 must be a rank"),
    (["fault.at_step=3"], "fault.at_step=3 has no effect without fault.kill_rank"),
    (["fault.hang_s=5"], "fault.hang_s=5.0 has no effect without fault.hang_rank"),
    (["fault.nan_rank=1"], "fault.nan_rank=1 has no effect without fault.nan_at_step"),
    (["fault.nan_value=inf"], "fault.nan_value=inf has no effect without fault.nan_at_step"),
]


@pytest.mark.parametrize("overrides, needle", REFUSED, ids=[" ".join(o) for o, _ in REFUSED])
def test_refused_before_anything_runs(overrides, needle):
    with pytest.raises(ConfigError) as e:
        validate(compose_config(overrides))
    assert needle in str(e.value) and "\n" not in str(e.value)


ACCEPTED = [  # every group option with the others' defaults, and the combinations that are fine
    ["model=alexnet"], ["model=alexnet", "model.image_size=128"], ["model.image_size=40"],
    ["model.stem=space_to_depth"], ["model.fc_width=64"], ["model=alexnet", "model.fc_width=64"],
    ["data=synthetic"], ["data=cifar10"],
    ["data=imagefolder", "data.root=/x"],
    ["data=imagefolder", "data.root=/x", "data.on_device=false"],
    ["data.augment=true"], ["data.download=true"], ["data.root=/x"], ["data.num_workers=0"],
    ["data.num_samples=100", "data.val_samples=10"],  # synthetic's own: ignored by other sets
    *[[f"sync={s}"] for s in ("none", "naive", "ring", "tree")],
    ["sync=ring", "sync.overlap=false", "sync.comm_dtype=bf16", "sync.bucket_mb=0"],
    ["sync.comm_dtype=fp16", "sync.static_graph=true", "sync.gradient_as_bucket_view=true"],
    *[[f"precision={p}"] for p in ("tf32", "fp16", "bf16")],
    ["precision=bf16", "precision.tf32=false"], ["precision=bf16", "precision.grad_scaler=true"],
    ["precision=fp16", "precision.grad_scaler=false"],  # shows why loss scaling exists
    ["precision=fp16", "precision.init_scale=1024", "precision.growth_interval=1"],
    ["optim=adamw"], ["optim=adamw", "optim.betas=[0,0.5]", "optim.eps=1e-6"],
    ["optim.nesterov=true"], ["optim.min_lr_ratio=1"], ["optim.schedule=constant"],
    ["train.max_steps=2"],  # sgd's 20 warm-up steps outlast it: the run ends still warming up
    ["train.compile=true", "train.compile_mode=max-autotune"],
    ["train.max_steps=2", "train.stop_at_step=2", "train.log_every=1000"],
    ["train.stop_at_step=500"],  # a run in epochs: its length is known only from the data
    ["fault.kill_rank=1", "fault.at_step=3"], ["fault.hang_rank=0", "fault.at_step=1",
                                               "fault.hang_s=2"],
    ["fault.nan_at_step=2", "fault.nan_rank=1", "fault.nan_value=inf"],
    ["sync=ring", "sync.zero=2", "sync.comm_dtype=bf16"], ["sync=tree", "sync.zero=1"],
    ["sync=ddp", "sync.zero=1"], ["sync=naive", "sync.zero=3", "sync.reshard_after_forward=false"],
]


def test_steps_past_a_run_counted_in_epochs_are_refused_once_its_length_is_known():
    cfg = compose_config(["train.epochs=2", "fault.kill_rank=0", "fault.at_step=50"])
    validate(cfg)  # the length is not known yet
    check_steps_reachable(cfg, 50, "2 epochs")
    with pytest.raises(ConfigError, match="fault.at_step=50 is past the run's last step "
                                          r"\(2 epochs: 44\)"):
        check_steps_reachable(cfg, 44, "2 epochs")


@pytest.mark.parametrize("overrides", ACCEPTED, ids=[" ".join(o) for o in ACCEPTED])
def test_accepted(overrides):
    validate(compose_config(overrides))


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("stem", STEMS)
def test_image_sizes_are_what_the_models_take(name, stem):
    """Each model's registered image_sizes, which validate() reads, against the model itself on the meta device (shapes
    are checked, nothing is computed): both ends work, one pixel past either fails."""
    with torch.device("meta"):
        model = build_model(name, 10, 0.0, stem)

    def takes(size: int) -> bool:
        try:
            model(torch.empty(1, 3, size, size, device="meta"))
            return True
        except RuntimeError:
            return False

    low, high = MODELS.details(name)["image_sizes"]
    assert takes(low) and not takes(low - 1)
    assert (takes(high) and not takes(high + 1)) if high else takes(4 * low)


# ---- end to end: one line, exit code 2, no traceback (these two were tracebacks from torch)

LAUNCHED = {"audit_image_size": ["model.image_size=16"],
            "audit_betas": ["optim=adamw", "optim.betas=[0.9]"]}


@background(cost=5, keys=LAUNCHED)
def refused(name, run_dir):
    return python_module(LAUNCHED[name] + [f"hydra.run.dir={run_dir}"], timeout=120), run_dir


@pytest.mark.parametrize("name, key", [("audit_image_size", "model.image_size=16"),
                                       ("audit_betas", "optim.betas=[0.9]")])
def test_refused_from_the_command_line_in_one_line(refused, name, key):
    proc, run_dir = refused[name]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: {key}"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (run_dir / "train.log").exists()  # refused before training began
