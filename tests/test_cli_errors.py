"""Bad input: one clear message, a non-zero exit, no traceback from inside our code or torch.

Every launch here needs nothing but a directory: each is a background fixture (tests/README.md),
and each test reads its own. The refused configs run forked (launchers.ranks, nproc=0: main() as
`python -m` runs it), as what they check comes from main(), not start-up; a fresh interpreter's
whole stderr, start-up included, is test_config_audit.py's one line."""

import pytest

from background import background
from launchers import ranks, torchrun

BAD_CONFIGS = [  # (args, needle, exit code)
    (["model=resnet"], "Available options in 'model'", 1),  # Hydra's own message lists choices
    (["train.batchsize=3"], "batchsize", 1),
    (["train.batch_size=0"], "train.batch_size=0 must be > 0", 2),
    (["data=cifar10", "data.root=/nonexistent/cifar"], "/nonexistent/cifar", 2),
    (["data=imagefolder", "data.root=/nonexistent/imagenet"], "/nonexistent/imagenet", 2),
    (["train.cuda_graph=true"], "train.cuda_graph=true: CUDA graphs need a CUDA device", 2),
]


@background(cost=5, keys=range(len(BAD_CONFIGS)))
def bad_config(i, run_dir):
    """BAD_CONFIGS[i], launched."""
    return ranks(BAD_CONFIGS[i][0] + [f"hydra.run.dir={run_dir}"], nproc=0, timeout=120)


@background(cost=5)
def nccl_without_gpus(run_dir):
    return ranks(["dist.backend=nccl", f"hydra.run.dir={run_dir}"], nproc=0, timeout=120,
                 extra_env={"CUDA_VISIBLE_DEVICES": ""})


@background(cost=10)
def world_size_larger_than_the_data(run_dir):
    return torchrun(["data=synthetic", "data.num_samples=12", "train.batch_size=8",
                     f"hydra.run.dir={run_dir}"], nproc=2, timeout=120)


@background(cost=9)
def multirun_inside_torchrun(run_dir):
    return torchrun(["--multirun", "seed=0,1", f"hydra.sweep.dir={run_dir}"], nproc=1, timeout=120)


def assert_clean_failure(proc, needle: str, code: int = 2):
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out[-3000:]
    assert needle in out, out[-3000:]


@pytest.mark.parametrize("args, needle, code", BAD_CONFIGS)
def test_bad_config_fails_clearly(args, needle, code, bad_config):
    proc = bad_config[BAD_CONFIGS.index((args, needle, code))]
    assert_clean_failure(proc, needle, code)
    assert "Traceback" not in proc.stderr


def test_nccl_without_gpus_suggests_gloo(nccl_without_gpus):
    proc = nccl_without_gpus
    assert_clean_failure(proc, "dist.backend=gloo")
    assert "Traceback" not in proc.stderr


def test_world_size_larger_than_the_data(world_size_larger_than_the_data):
    proc = world_size_larger_than_the_data
    assert proc.returncode != 0
    assert "fewer than one step needs" in proc.stderr
    assert 'ddp_lab/' not in proc.stderr.split("error:")[0]  # no traceback through our code


def test_multirun_inside_torchrun_is_refused(multirun_inside_torchrun):
    proc = multirun_inside_torchrun
    assert proc.returncode != 0
    assert "--multirun inside torchrun" in proc.stderr
