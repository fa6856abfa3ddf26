"""ddp_lab.dist: the process group's whole life, in a fresh process (forkserver children have
imported torch._dynamo already, which hides what this checks)."""

import sys

import pytest

from background import background
from helpers import check
from launchers import run_cmd

# A lone process (world size 1, gloo) trains a few steps through ddp_lab.train.train and prints
# the names of the threads still alive after it returned (or raised, the exception still held,
# as a caller's post-mortem would hold it).
_RUN = """
import os, sys
sys.path.insert(0, "tests")
from helpers import compose_config
from ddp_lab.guard import NonFiniteError
from ddp_lab.train import train
cfg = compose_config(["data=synthetic", "data.num_samples=32", "data.val_samples=8",
                      "train.batch_size=8", "train.max_steps=3", "train.progress=false",
                      "train.resume=never", "train.log_every=1", *sys.argv[2:]])
try:
    train(cfg, sys.argv[1])
except NonFiniteError as e:
    held = e
    print(held)
print(sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")))
"""


RUNS = {  # id: (overrides, whether the run fails)
    "ddp": (["sync=ddp"], False),
    "ring": (["sync=ring"], False),
    "ddp-failed": (["sync=ddp", "train.nonfinite=stop", "fault.nan_at_step=2",
                    "fault.nan_rank=0"], True),
}


@background(cost=7, keys=RUNS)
def lone_process(run, run_dir):
    """_RUN with RUNS[run]'s overrides, finished."""
    return run_cmd([sys.executable, "-c", _RUN, str(run_dir), *RUNS[run][0]], timeout=120)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
@pytest.mark.parametrize("run", list(RUNS))
def test_after_a_run_no_gloo_thread_is_left(lone_process, run):
    """A group left alive by cleanup() keeps gloo's worker threads running into interpreter
    shutdown, where one that frees a finished collective's tensors takes the GIL and aborts the
    process (SIGABRT after a successful run: a CI failure seen on test_faults). Held alive by
    torch._dynamo imported after the group (the first optimizer imports it), or by a failed run's
    traceback (DDP in its frames)."""
    proc = lone_process[run]
    check(proc)
    fails = RUNS[run][1]
    assert ("stopping (train.nonfinite=stop)" in proc.stdout) == fails, proc.stderr[-3000:]
    threads = proc.stdout.strip().splitlines()[-1]
    assert "gloo" not in threads, threads
