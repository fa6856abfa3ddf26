import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# One torch thread in the test process, as in every launched rank (helpers.env): the launches run
# beside the in-process tests, and a second OpenMP thread waiting at a barrier for a descheduled
# first one burns the cores they share.
os.environ.setdefault("OMP_NUM_THREADS", "1")


# A test that reads a launch of helpers.TOGETHER (through `together`, directly or through another
# fixture) or times one alone (`quiet_machine`) waits on real launched runs: it is slow. Tests that
# launch in their own body carry @pytest.mark.slow themselves.
LAUNCHING_FIXTURES = {"together", "quiet_machine", "scale_sweep"}


def _group(item) -> int:
    """0: needs no launch of TOGETHER (runs while they run); 1: reads one; 2: times a launch of
    its own and needs the machine to itself."""
    names = set(getattr(item, "fixturenames", ()))
    return 2 if names & {"quiet_machine", "scale_sweep"} else 1 if "together" in names else 0


def pytest_collection_modifyitems(config, items):
    """Mark what the fast tier (`-m "not slow"`) leaves out, and run the tests that read launched
    runs after all others (stable order within each group): the launches run in the background
    meanwhile (`launches`), so the cores the in-process tests leave idle are used."""
    for item in items:
        if LAUNCHING_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_group)


# Launches running at once: two while the tests that need none run, three once the tests that read
# launches begin and the test process mostly waits on them.
_slots = threading.Semaphore(2)
_widened = threading.Event()


def pytest_runtest_setup(item):
    if _group(item) and not _widened.is_set():
        _widened.set()
        _slots.release()


@pytest.fixture(scope="session", autouse=True)
def launches(request, tmp_path_factory):
    """Every launch of helpers.TOGETHER read by a selected test, started before the first test in
    background threads (two at a time, three once the tests that read them begin: `_slots`), in
    the order the tests will read them (by module, the longest first within one). Name -> Future of (its result, its directory): `.result()` raises
    what the launch raised, failing only the tests that read it. Each launch keeps its own
    timeout; at the end of the session, launches not yet started are cancelled."""
    from helpers import TOGETHER

    first_use = {}
    for i, item in enumerate(request.session.items):
        if _group(item) and getattr(item, "module", None) is not None:
            first_use.setdefault(item.module.__name__, i)
    chosen = sorted(((min(first_use[m] for m in used_by if m in first_use), -cost, name)
                     for name, (used_by, cost, _) in TOGETHER.items()
                     if first_use.keys() & set(used_by)))
    # Directories made here: TempPathFactory is not thread-safe (two threads making pytest's base
    # directory at once made two, and one thread's mktemp then failed).
    dirs = {name: tmp_path_factory.mktemp(name) for _, _, name in chosen}
    pool = ThreadPoolExecutor(max_workers=3)
    futures = {name: pool.submit(_run, TOGETHER[name][2], dirs[name]) for _, _, name in chosen}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def _run(fn, directory):
    with _slots:
        return fn(directory), directory


@pytest.fixture(scope="session")
def together(launches):
    """The launches of helpers.TOGETHER (see `launches`): name -> Future of (result, directory)."""
    return launches


@pytest.fixture(scope="session")
def quiet_machine(launches):
    """For a fixture that times its own launch: returns once every background launch has ended,
    so nothing else runs beside it (its tests run last)."""
    wait(launches.values())


@pytest.fixture(scope="session")
def scale_sweep(tmp_path_factory, quiet_machine):
    """`python -m ddp_lab.scale` over world sizes 1 and 2 with DDP and ring, nothing else running
    (its timings are checked): test_scale.py reads its outputs, test_interference.py the
    interference probes it ran at N=2 (n2-ddp.json: DDP's buckets, n2-ring.json: ours). Returns
    (its directory, the finished process)."""
    from helpers import SCALE_SWEPT, SCALE_TINY, check, scale

    out = tmp_path_factory.mktemp("sweep")
    proc = scale(SCALE_TINY + ["nproc=[1,2]", f"syncs=[{','.join(SCALE_SWEPT)}]", "simulate=false",
                               "predict.sizes_kb=[4,64,1024,4096]", "predict.probe_rounds=2",
                               f"hydra.run.dir={out}"], timeout=900)
    check(proc)
    return out, proc


@pytest.fixture(scope="session")
def small_references(together):
    """helpers.SMALL_REFERENCES, launched with the others: name ("single", "ddp") -> run dir."""
    from helpers import SMALL_REFERENCES

    return {name: together[f"small_{name}"].result()[0] for name in SMALL_REFERENCES}
