"""helpers.ranks (spawn_helpers.run_module), which starts the ranks of most end-to-end tests: a
failed rank ends the job at once, and a job past its timeout is killed and fails the test. (That
its ranks compute what torchrun's do: test_train.py's two-node test, bitwise.)"""

import signal

import pytest

from helpers import SMALL, ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(200)]
# Long enough that only run_module can end these jobs in time.
NEVER = ["dist.timeout_s=900", "train.max_steps=3"]


def test_a_killed_rank_ends_the_job_as_torchrun_would():
    """Rank 1 dies at step 2; rank 0 would wait for it in the next collective until
    dist.timeout_s: it is terminated instead, and the job returns the dead rank's code."""
    proc = ranks(SMALL + NEVER + ["sync=ddp", "fault.kill_rank=1", "fault.at_step=2"], timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert "fault: killing rank 1 (SIGKILL) at step 2" in proc.stderr


def test_a_job_past_its_timeout_is_killed_and_fails():
    with pytest.raises(AssertionError, match="timed out after 20 s") as failed:
        ranks(SMALL + NEVER + ["sync=ddp", "fault.hang_rank=1", "fault.at_step=2"], timeout=20)
    assert "fault: rank 1 hangs at step 2" in str(failed.value)
