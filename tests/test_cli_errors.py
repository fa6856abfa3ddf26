"""Bad input: one clear message, a non-zero exit, no traceback from inside our code or torch."""

import pytest

from helpers import python_module, torchrun


def assert_clean_failure(proc, needle: str, code: int = 2):
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out[-3000:]
    assert needle in out, out[-3000:]


@pytest.mark.parametrize("args, needle, code", [
    (["model=resnet"], "Available options in 'model'", 1),  # Hydra's own message lists choices
    (["train.batchsize=3"], "batchsize", 1),
    (["train.batch_size=0"], "train.batch_size=0 must be > 0", 2),
    (["data=cifar10", "data.root=/nonexistent/cifar"], "/nonexistent/cifar", 2),
    (["data=imagefolder", "data.root=/nonexistent/imagenet"], "/nonexistent/imagenet", 2),
    (["train.cuda_graph=true"], "train.cuda_graph=true: CUDA graphs need a CUDA device", 2),
])
def test_bad_config_fails_clearly(args, needle, code, tmp_path):
    proc = python_module(args + [f"hydra.run.dir={tmp_path}"], timeout=120)
    assert_clean_failure(proc, needle, code)
    assert "Traceback" not in proc.stderr


def test_nccl_without_gpus_suggests_gloo(tmp_path):
    proc = python_module(["dist.backend=nccl", f"hydra.run.dir={tmp_path}"], timeout=120,
                         extra_env={"CUDA_VISIBLE_DEVICES": ""})
    assert_clean_failure(proc, "dist.backend=gloo")
    assert "Traceback" not in proc.stderr


def test_world_size_larger_than_the_data(tmp_path):
    proc = torchrun(["data=synthetic", "data.num_samples=12", "train.batch_size=8",
                     f"hydra.run.dir={tmp_path}"], nproc=2, timeout=120)
    assert proc.returncode != 0
    assert "fewer than one step needs" in proc.stderr
    assert 'ddp_lab/' not in proc.stderr.split("error:")[0]  # no traceback through our code


def test_multirun_inside_torchrun_is_refused(tmp_path):
    proc = torchrun(["--multirun", "seed=0,1", f"hydra.sweep.dir={tmp_path}"], nproc=1, timeout=120)
    assert proc.returncode != 0
    assert "--multirun inside torchrun" in proc.stderr
