"""launchers.py's forked ranks (`ranks`, `spawn`), which start most distributed tests: they see
what torchrun's ranks see (its variables and the thread count asked for), a failed rank ends the
job at once, and a job past its timeout is killed and fails the test. (That their ranks compute
what torchrun's do: test_train.py's two-node test, bitwise.)"""

import json
import os
import signal

import pytest
import torch

import rank_env
from background import background
from helpers import SMALL
from launchers import ranks, spawn, torchrun

# Long enough that only the launcher can end these jobs in time.
NEVER = SMALL + ["sync=ddp", "dist.timeout_s=900"]
# Not the forkserver's 1 (conftest.py): a rank shows 2 only if its own setting took effect.
TWO_THREADS = {"OMP_NUM_THREADS": "2", "PYTHONPATH": os.pathsep.join(
    [os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}  # (rank_env for torchrun)
# Variables whose value names one agent's instance, not what a rank is: its run id, its store's
# port, a file in its temporary directory. Compared by name only.
OF_THE_AGENT = {"TORCHELASTIC_RUN_ID", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE"}
# Set by pytest to the test running when a launch began.
MOVING = {"PYTEST_CURRENT_TEST"}


@background(cost=5)
def killed(run_dir):
    return ranks(NEVER + ["fault.kill_rank=1", "fault.at_step=2", f"hydra.run.dir={run_dir}"],
                 timeout=120)


@background(cost=30)
def past_timeout(run_dir):
    """The AssertionError the launch raised. (Its timeout leaves room for start-up and two steps
    beside the other launches on 2 busy cores.)"""
    with pytest.raises(AssertionError) as failed:
        ranks(NEVER + ["fault.hang_rank=1", "fault.at_step=2", f"hydra.run.dir={run_dir}"],
              timeout=30)
    return failed.value


def _seen_by(launcher, out) -> list[dict]:
    """What each of 2 ranks of `launcher` saw (rank_env), started with TWO_THREADS."""
    out.mkdir(exist_ok=True)
    proc = launcher([str(out)], nproc=2, module="rank_env", extra_env=TWO_THREADS, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]


@background(cost=10)
def seen_under_torchrun(out):
    return _seen_by(torchrun, out)


@background(cost=2)
def seen_forked(out):
    return _seen_by(ranks, out)


def _differ(got: dict, want: dict) -> set[str]:
    """The variables whose values differ, or that one side lacks."""
    return {k for k in got.keys() | want.keys() if got.get(k) != want.get(k)}


@pytest.mark.timeout(200)
def test_forked_ranks_get_torchruns_variables_and_thread_count(seen_under_torchrun, seen_forked):
    for rank, (want, got) in enumerate(zip(seen_under_torchrun, seen_forked)):
        assert got["env"]["RANK"] == want["env"]["RANK"] == str(rank)
        assert _differ(got["env"], want["env"]) <= OF_THE_AGENT | MOVING
        assert OF_THE_AGENT <= got["env"].keys() & want["env"].keys()
        for threads in ("threads", "threads_later", "interop_threads"):
            assert got[threads] == want[threads], (threads, got, want)
        assert got["threads"] == got["threads_later"] == 2


def _seen(rank, world_size):
    return rank_env.seen()


@pytest.mark.timeout(200)
def test_spawned_ranks_get_the_same_variables_and_one_thread(seen_under_torchrun):
    """spawn's ranks (the unit tests') run in the launch environment with torchrun's variables
    added, one intra-op thread as conftest.py claims for every process, the test process too."""
    for rank, got in enumerate(spawn(_seen, 2, timeout=60)):
        want = seen_under_torchrun[rank]["env"]
        assert got["env"]["RANK"] == str(rank)
        assert _differ(got["env"], want) <= OF_THE_AGENT | MOVING | TWO_THREADS.keys()
        assert got["threads"] == got["threads_later"] == 1
    assert torch.get_num_threads() == 1


@pytest.mark.timeout(200)
def test_a_killed_rank_ends_the_job_as_torchrun_would(killed):
    """Rank 1 dies at step 2; rank 0 would wait for it in the next collective until
    dist.timeout_s: it is terminated instead, and the job returns the dead rank's code."""
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "fault: killing rank 1 (SIGKILL) at step 2" in killed.stderr


@pytest.mark.timeout(200)
def test_a_job_past_its_timeout_is_killed_and_fails(past_timeout):
    assert isinstance(past_timeout, AssertionError)
    assert "timed out after 30 s" in str(past_timeout)
    assert "fault: rank 1 hangs at step 2" in str(past_timeout)
