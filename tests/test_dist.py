"""ddp_lab.dist: the process group's whole life, in a fresh process (forkserver children have
imported torch._dynamo already, which hides what this checks)."""

import sys

import pytest

from helpers import check, run_cmd

# A lone process (world size 1, gloo) wraps a model in DDP, takes one step and cleans up; then it
# prints the names of the threads still alive.
_LIFE = """
import os, torch
from ddp_lab import dist as ddp_dist
ddp_dist.init("gloo")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
model(torch.ones(2, 4)).sum().backward()
del model
ddp_dist.cleanup()
print(sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_cleanup_joins_the_gloo_threads_even_after_ddp():
    """A group left alive by cleanup() keeps gloo's worker threads running into interpreter
    shutdown, where one that frees a finished collective's tensors takes the GIL and aborts the
    process (SIGABRT after a successful run: a CI failure seen on test_faults)."""
    proc = run_cmd([sys.executable, "-c", _LIFE], timeout=120)
    check(proc)
    threads = proc.stdout.strip().splitlines()[-1]
    assert "gloo" not in threads, threads


# The same after a run that fails (NaN loss at step 2, train.nonfinite=stop) with DDP wrapped
# around the model, the exception still held, as a caller's post-mortem would hold it.
_FAILED = """
import os, sys
sys.path.insert(0, "tests")
from helpers import compose_config
from ddp_lab.guard import NonFiniteError
from ddp_lab.train import train
cfg = compose_config(["data=synthetic", "data.num_samples=32", "data.val_samples=8",
                      "train.batch_size=8", "train.max_steps=3", "train.progress=false",
                      "train.resume=never", "sync=ddp", "train.nonfinite=stop", "train.log_every=1",
                      "fault.nan_at_step=2", "fault.nan_rank=0"])
try:
    train(cfg, sys.argv[1])
except NonFiniteError as e:
    held = e
    print(held)
print(sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_a_failed_run_leaves_no_gloo_thread_behind_either(tmp_path):
    proc = run_cmd([sys.executable, "-c", _FAILED, str(tmp_path)], timeout=120)
    check(proc)
    assert "stopping (train.nonfinite=stop)" in proc.stdout, proc.stderr[-3000:]
    threads = proc.stdout.strip().splitlines()[-1]
    assert "gloo" not in threads, threads
