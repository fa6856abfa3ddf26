"""Bad input beyond test_cli_errors.py: each fails with one clear line and a non-zero exit, and
nothing already on disk is overwritten or lost. (Covered there: an unknown group option or key,
batch size 0, a missing data root, NCCL without GPUs, world size larger than the data, --multirun
inside torchrun.) Refusals that main() makes run forked (launchers.ranks, nproc=0), as there; a
fresh interpreter where the test needs its own working directory or permissions."""

import os
import sys

import pytest
import torch
from hydra.errors import ConfigCompositionException

from ddp_lab import checkpoint
from ddp_lab.config import ConfigError, validate
from background import background
from helpers import compose_config
from launchers import python_module, ranks, run_cmd


def assert_clean_failure(proc, needle: str, code: int = 2):
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, out[-3000:]
    assert needle in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def snapshot(run_dir) -> dict:
    """Every file under run_dir: (bytes' hash, mtime)."""
    import hashlib

    files = {}
    for root, _, names in os.walk(run_dir):
        for n in names:
            p = os.path.join(root, n)
            with open(p, "rb") as f:
                files[os.path.relpath(p, run_dir)] = (hashlib.sha256(f.read()).hexdigest(),
                                                      os.stat(p).st_mtime_ns)
    return files


# ---- launches that need nothing but a directory: background fixtures (tests/README.md)

@background(cost=10)
def misspelled_value(tmp_path):
    return ranks(["train.resume=atuo", f"hydra.run.dir={tmp_path}"], nproc=0, timeout=120)


@background(cost=10)
def corrupted_data_root(tmp_path):
    root = tmp_path / "cifar"
    (root / "cifar-10-batches-py").mkdir(parents=True)
    for name in ["data_batch_1", "test_batch", "batches.meta"]:
        (root / "cifar-10-batches-py" / name).write_bytes(b"not a pickle")
    return ranks(["data=cifar10", f"data.root={root}", f"hydra.run.dir={tmp_path / 'run'}"],
                 nproc=0, timeout=120)


@background(cost=8, keys=["file", "outputs"])
def run_dir_under_a_regular_file(file, tmp_path):
    """(the failed launch, tmp_path) for a run dir through the regular file tmp_path/`file`: "file":
    hydra.run.dir=file/run; "outputs": no hydra.run.dir, so the default, outputs/train/<overrides>,
    from tmp_path (resolved from ${hydra:...})."""
    (tmp_path / file).write_text("keep me")
    if file == "file":
        return ranks([f"hydra.run.dir={tmp_path / 'file' / 'run'}"], nproc=0, timeout=120), tmp_path
    return run_cmd([sys.executable, "-m", "ddp_lab.train", "train.max_steps=1"], timeout=120,
                   cwd=str(tmp_path)), tmp_path


# ---- misspelled options and values ------------------------------------------------------------

def test_misspelled_value_fails_clearly(misspelled_value):
    assert_clean_failure(misspelled_value, "train.resume='atuo' is not auto, never or an existing checkpoint")


@pytest.mark.parametrize("override, needle", [
    ("precision=fp61", "Could not find 'precision/fp61'"),  # Hydra lists the options
    ("fault.kill_rnk=1", "kill_rnk"),
    ("train.nonfinite=skp", None),  # a str field: composes, then validate() refuses it
])
def test_misspelled_options_are_refused_at_composition_or_validation(override, needle):
    if needle is None:
        with pytest.raises(ConfigError, match="train.nonfinite='skp' is not one of skip, stop"):
            validate(compose_config([override]))
        return
    with pytest.raises(ConfigCompositionException) as e:
        compose_config([override])
    assert needle in str(e.value) + str(e.value.__cause__)


def test_fault_options_are_checked():
    with pytest.raises(ConfigError, match="need fault.at_step"):
        validate(compose_config(["fault.kill_rank=1"]))
    from ddp_lab.fault import Faults
    with pytest.raises(ConfigError, match="fault.hang_rank=2: world size is 2"):
        Faults(compose_config(["fault.hang_rank=2", "fault.at_step=1"]).fault, 0, 2,
               torch.nn.Linear(1, 1))


# ---- not divisible where it must be -----------------------------------------------------------

def test_keep_every_not_a_multiple_of_checkpoint_every_fails_clearly():
    """The per-rank batch has no divisibility rule (global batch = world x batch x accum); the
    kept-checkpoint interval does: checkpoint_step<N>.pt are the regular saves at those steps.
    (The epoch-interval case, checked once the data is built: test_resume.py.)"""
    with pytest.raises(ConfigError, match="train.keep_every=6 must be a multiple of "
                                          "train.checkpoint_every=4"):
        checkpoint.check_keep_every(6, 4, steps_per_epoch=10)


# ---- data that cannot be read -----------------------------------------------------------------

def test_corrupted_data_root_fails_clearly(corrupted_data_root):
    assert_clean_failure(corrupted_data_root, "Dataset not found or corrupted")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a chmod 000 directory anyway; "
                    "test_corrupted_data_root_fails_clearly covers unreadable data as root")
def test_unreadable_data_root_fails_clearly(tmp_path):
    root = tmp_path / "images"
    for split in ("train", "val"):
        (root / split / "cat").mkdir(parents=True)
    os.chmod(root / "train", 0)
    try:
        proc = python_module(["data=imagefolder", f"data.root={root}",
                              f"hydra.run.dir={tmp_path / 'run'}"], timeout=120)
    finally:
        os.chmod(root / "train", 0o755)
    assert_clean_failure(proc, "is not readable")


# ---- a GradScaler that would silently switch itself off ---------------------------------------

def test_fp16_scaler_that_would_disable_itself_is_refused(monkeypatch):
    """GradScaler('cuda') without CUDA only warns and turns itself off, which would train fp16
    without loss scaling. (On CPU torch 2.14 has a working GradScaler('cpu'): see test_faults.)"""
    from ddp_lab.precision import setup_precision
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pcfg = compose_config(["precision=fp16"]).precision
    with pytest.warns(UserWarning), pytest.raises(ConfigError, match="would disable itself"):
        setup_precision(pcfg, torch.device("cuda"))
    assert setup_precision(pcfg, torch.device("cpu")).scaler.is_enabled()


def test_compile_where_it_cannot_work_is_refused_up_front(monkeypatch):
    """Refused by train.compile's name before the first step, not with Inductor's traceback from
    inside it: no Dynamo on this platform, or no C++ compiler for the CPU kernels."""
    import shutil

    import torch._dynamo

    from ddp_lab.step import compile_model
    model, cpu = torch.nn.Linear(2, 2), torch.device("cpu")
    with monkeypatch.context() as m:
        m.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
        with pytest.raises(ConfigError, match="torch.compile is not supported on this Python"):
            compile_model(model, cpu, "default")
    with monkeypatch.context() as m:
        m.setattr(shutil, "which", lambda name: None)
        with pytest.raises(ConfigError, match=r"on CPU needs a C\+\+ compiler"):
            compile_model(model, cpu, "default")
    assert compile_model(model, cpu, "default") is not model  # both there: compiled


# ---- run dirs ---------------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_resuming_into_a_run_dir_of_an_incompatible_config_touches_nothing(uninterrupted):
    """A 2-rank run's dir, started again as one process with another learning rate."""
    run = uninterrupted["ddp"]
    before = snapshot(run)
    lr = compose_config([]).optim.lr
    proc = ranks([f"hydra.run.dir={run}", "data=synthetic", f"optim.lr={lr * 2}"], nproc=0,
                 timeout=120)
    assert_clean_failure(proc, "was written by a different config")
    assert "world_size: 2 -> 1" in proc.stderr and f"optim.lr: {lr} -> {lr * 2}" in proc.stderr
    assert "nothing was loaded or written" in proc.stderr
    assert snapshot(run) == before  # bytes and mtimes of every file, .hydra/ included


@pytest.mark.parametrize("file", ["file", "outputs"])
def test_a_run_dir_under_a_regular_file_fails_clearly(run_dir_under_a_regular_file, file):
    """Works as root too (chmod does not stop root's writes; a path through a file stops anyone)."""
    proc, tmp_path = run_dir_under_a_regular_file[file]
    assert_clean_failure(proc, "is not writable: Not a directory")
    assert "Warning" not in proc.stderr, proc.stderr  # the check ran, not skipped with a warning
    assert (tmp_path / file).read_text() == "keep me"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory anyway; "
                    "test_a_run_dir_under_a_regular_file_fails_clearly covers it as root")
def test_a_read_only_run_dir_fails_clearly(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o555)
    try:
        proc = python_module([f"hydra.run.dir={run}"], timeout=120)
    finally:
        os.chmod(run, 0o755)
    assert_clean_failure(proc, "is not writable: Permission denied")


def test_unwritable_reports_the_os_reason(tmp_path, monkeypatch):
    """The message path of a permission failure, simulated (tests may run as root)."""
    from ddp_lab import cli

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied", str(tmp_path))
    monkeypatch.setattr("tempfile.mkstemp", refuse)
    assert cli.unwritable(str(tmp_path)) == f"Permission denied ({tmp_path})"
