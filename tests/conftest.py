"""The suite's two tiers, the order its tests run in, its background launches, and the runs that
several test modules read (tests/README.md)."""

import os
import sys

# One torch thread in the test process, as in every launched rank (launchers.env): the launches
# run beside the in-process tests, and a second OpenMP thread waiting at a barrier for a
# descheduled first one burns the cores they share. Before torch is imported, and through torch in
# case something imported it first.
os.environ["OMP_NUM_THREADS"] = "1"
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import torch  # noqa: E402

from background import Launches, background, launches_read_by  # noqa: E402
from helpers import SCALE_SWEPT, SCALE_TINY, SMALL, SMALL_REFERENCES, check, scale  # noqa: E402
from launchers import ranks  # noqa: E402
from reliab_helpers import RESUME, SYNC_NAMES  # noqa: E402

torch.set_num_threads(1)

def _group(item) -> int:
    """0: reads no launch (runs while the background launches run); 1: reads one."""
    return 1 if launches_read_by(item) else 0


def pytest_collection_modifyitems(config, items):
    """Mark what the fast tier (`-m "not slow"`) leaves out: a test that waits on launched runs
    (a background fixture; a test that launches in its own body carries @pytest.mark.slow
    itself). Run those after all others (stable order within each group): the
    launches run in the background meanwhile, so the cores the in-process tests leave idle are
    used."""
    groups = {item: _group(item) for item in items}
    for item in items:
        if groups[item]:
            item.add_marker(pytest.mark.slow)
    items.sort(key=groups.get)


@pytest.fixture(scope="session", autouse=True)
def launches(request, tmp_path_factory):
    """Every background fixture a selected test reads, started before the first test
    (background.py). At the end of the session, launches not yet started are cancelled."""
    started = Launches(request.session.items, tmp_path_factory)
    yield started
    started.close()


@background(cost=80)
def scale_sweep(run_dir):
    """`python -m ddp_lab.scale` over world sizes 1 and 2 with DDP and ring: test_scale.py reads
    its outputs, test_interference.py the interference probes it ran at N=2 (n2-ddp.json: DDP's
    buckets, n2-ring.json: ours). No test reads its timings as a figure (performance lives in
    benchmarks), so it runs beside the other launches. Returns (its directory, the process)."""
    proc = scale(SCALE_TINY + ["nproc=[1,2]", f"syncs=[{','.join(SCALE_SWEPT)}]", "simulate=false",
                               "predict.sizes_kb=[4,64,1024,4096]", "predict.probe_rounds=2",
                               f"hydra.run.dir={run_dir}"], timeout=900)
    check(proc)
    return run_dir, proc


# ---- named references that several modules read -----------------------------------------------


@background(cost=10, keys=SMALL_REFERENCES)
def small_references(name, run_dir):
    """helpers.SMALL_REFERENCES: name ("single": one process on the whole batch, "ddp": DDP on 2
    ranks) -> its run dir. Read by test_train, test_sync_train, test_zero_train, test_trace."""
    overrides, nproc = SMALL_REFERENCES[name]
    check(ranks(SMALL + overrides + [f"hydra.run.dir={run_dir}"], nproc=nproc))
    return run_dir


@background(cost=8, keys=SYNC_NAMES)
def uninterrupted(sync, run_dir):
    """sync -> the run dir of the uninterrupted run (reliab_helpers.RESUME, 2 ranks) that every
    resumed or restarted run of that sync must equal. Read by test_resume, test_faults,
    test_bad_input."""
    check(ranks(RESUME + [f"sync={sync}", "train.checkpoint_every=6", f"hydra.run.dir={run_dir}"]))
    return run_dir
