import os
import sys
from functools import partial

import pytest

sys.path.insert(0, os.path.dirname(__file__))


# Fixtures that launch real runs (torchrun jobs, benchmark and sweep processes) or wait on them:
# a test that uses one, directly or through another fixture, is slow. Tests that launch in their
# own body carry @pytest.mark.slow themselves.
LAUNCHING_FIXTURES = {"together", "small_references", "runs", "sweep", "launched"}


def pytest_collection_modifyitems(config, items):
    """The fast tier (`-m "not slow"`) leaves out every test that waits on a launched run."""
    for item in items:
        if LAUNCHING_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def base_temp_dir_first(tmp_path_factory):
    """pytest's base temporary directory, made before any test. Fixtures make run dirs from
    launcher threads (helpers.run_together), and TempPathFactory is not thread-safe: two threads
    making the base at once made two, and one thread's mktemp then failed ("not a normalized and
    relative path")."""
    tmp_path_factory.getbasetemp()


@pytest.fixture(scope="session")
def small_references(tmp_path_factory):
    """The two named references of test_train.py and test_sync_train.py, made once per session
    (side by side) instead of once per module: one process on the whole batch (sync=none, batch
    32) and torch DDP on 2 ranks x 16 (sync=ddp), both helpers.SMALL. Name -> run dir."""
    from helpers import SMALL, SMALL_BUCKETS, check, run_together, torchrun

    runs = {"single": (["sync=none", "train.batch_size=32"], 1),
            "ddp": (["sync=ddp", "train.batch_size=16", *SMALL_BUCKETS], 2)}
    dirs = {name: tmp_path_factory.mktemp(f"small_{name}") for name in runs}
    done = run_together({
        name: partial(torchrun, SMALL + overrides + [f"hydra.run.dir={dirs[name]}"],
                      nproc=nproc, timeout=240)
        for name, (overrides, nproc) in runs.items()})
    for future in done.values():
        check(future.result())
    return dirs


@pytest.fixture(scope="session")
def together(request, tmp_path_factory):
    """Every launch of helpers.TOGETHER used by a module with selected tests, run the first time
    a test asks for one, all together, two at a time, the longest first (each keeps its own
    timeout). Name -> Future of (its result, its directory): `.result()` raises what the launch
    raised, failing only the tests that read it."""
    from helpers import TOGETHER, run_together

    modules = {getattr(item.module, "__name__", None) for item in request.session.items
               if getattr(item, "module", None) is not None
               and "together" in getattr(item, "fixturenames", ())}
    chosen = sorted(((name, cost, fn) for name, (used_by, cost, fn) in TOGETHER.items()
                     if modules.intersection(used_by)), key=lambda c: -c[1])

    def run(name, fn):
        directory = tmp_path_factory.mktemp(name)
        return fn(directory), directory
    return run_together({name: partial(run, name, fn) for name, _, fn in chosen})
