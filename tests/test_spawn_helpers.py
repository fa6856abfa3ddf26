"""helpers.ranks (spawn_helpers.run_module), which starts the ranks of most end-to-end tests: a
failed rank ends the job at once, and a job past its timeout is killed and fails the test. (That
its ranks compute what torchrun's do: test_train.py's two-node test, bitwise.)"""

import signal

import pytest

from helpers import SMALL, launch_together, ranks

# Long enough that only run_module can end these jobs in time.
NEVER = SMALL + ["sync=ddp", "dist.timeout_s=900"]


@launch_together("ranks_killed", cost=5)
def _killed(run_dir):
    return ranks(NEVER + ["fault.kill_rank=1", "fault.at_step=2", f"hydra.run.dir={run_dir}"],
                 timeout=120)


@launch_together("ranks_past_timeout", cost=20)
def _past_timeout(run_dir):
    return ranks(NEVER + ["fault.hang_rank=1", "fault.at_step=2", f"hydra.run.dir={run_dir}"],
                 timeout=20)


@pytest.mark.timeout(200)
def test_a_killed_rank_ends_the_job_as_torchrun_would(together):
    """Rank 1 dies at step 2; rank 0 would wait for it in the next collective until
    dist.timeout_s: it is terminated instead, and the job returns the dead rank's code."""
    proc, _ = together["ranks_killed"].result()
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert "fault: killing rank 1 (SIGKILL) at step 2" in proc.stderr


@pytest.mark.timeout(200)
def test_a_job_past_its_timeout_is_killed_and_fails(together):
    with pytest.raises(AssertionError, match="timed out after 20 s") as failed:
        together["ranks_past_timeout"].result()
    assert "fault: rank 1 hangs at step 2" in str(failed.value)
