"""Background launches: the suite's slow half, overlapped with its fast half.

A launch that tests read (a training run, a benchmark, a bad command) is a fixture:

    @background(cost=5)
    def bench_memory(run_dir):                  # a fresh directory of its own
        return ranks([..., f"hydra.run.dir={run_dir}"], nproc=0, module=...), run_dir

    def test_rows(bench_memory):                # what the function returned
        proc, run_dir = bench_memory

With keys=, one launch per key, and the fixture is a mapping key -> what `fn(key, run_dir)`
returned (`runs["ring"]`). Each fixture is session-scoped; define it in the test module that reads
it, or in conftest.py when several modules do.

Before the first test, conftest.py's `launches` starts every background fixture that a selected
test requests (directly or through other fixtures) in threads: two at a time while the tests that
need none run, three once the tests that read them begin (the test process then mostly waits).
A launch leaves cores idle much of its time (start-up, a rank at a barrier, a hung peer waiting
out its timeout), and the in-process tests fill them. Launches start in the order the tests will
read them: by test module, the costliest first within one (`cost`: about how many seconds it takes
alone on 2 cores). A launch that raises fails only the tests that read it; each launch bounds
itself with its launcher's timeout."""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable

import pytest


@dataclass(frozen=True, eq=False)
class Launch:
    name: str
    fn: Callable
    cost: float | Callable  # seconds, or key -> seconds
    keys: tuple | None  # None: one launch, fn(directory); else one per key, fn(key, directory)

    def parts(self) -> list[tuple[object, float]]:
        """(key, cost) of each launch it makes; key None for a launch without keys."""
        cost = self.cost if callable(self.cost) else lambda key: self.cost
        return [(key, cost(key)) for key in (self.keys if self.keys is not None else (None,))]


def background(cost: float | Callable, keys=None):
    """Decorator: `fn(directory)` (with keys: `fn(key, directory)`) becomes a session-scoped
    fixture named after it, launched in the background before the first test that reads it."""
    def declare(fn):
        launch = Launch(fn.__name__, fn, cost, None if keys is None else tuple(keys))

        def fixture(launches):
            return launches.result(launch) if launch.keys is None else Results(launches, launch)
        fixture.background = launch
        fixture.__name__ = fixture.__qualname__ = fn.__name__
        fixture.__doc__, fixture.__module__ = fn.__doc__, fn.__module__
        return pytest.fixture(scope="session", name=fn.__name__)(fixture)
    return declare


class Results(Mapping):
    """A keyed background fixture: key -> what its launch returned (waits for it; raises what it
    raised)."""

    def __init__(self, launches: Launches, launch: Launch):
        self._launches, self._launch = launches, launch

    def __getitem__(self, key):
        if key not in self._launch.keys:
            raise KeyError(f"{self._launch.name} has no launch {key!r}: {self._launch.keys}")
        return self._launches.result(self._launch, key)

    def __iter__(self):
        return iter(self._launch.keys)

    def __len__(self):
        return len(self._launch.keys)


def launches_read_by(item) -> set[Launch]:
    """The background launches a collected test reads, through any fixture it requests."""
    info = getattr(item, "_fixtureinfo", None)  # (a doctest item has none)
    found = (getattr(defs[-1].func, "background", None)
             for defs in (info.name2fixturedefs.values() if info else ()) if defs)
    return {launch for launch in found if launch is not None}


class Launches:
    """The background launches of one session, started in threads (see the module docstring)."""

    def __init__(self, items, tmp_path_factory):
        self._slots, self._widened = threading.Semaphore(2), threading.Event()
        self._tmp = tmp_path_factory
        self._pool = ThreadPoolExecutor(max_workers=3)
        self._futures = {}
        for part in _in_reading_order(items):
            self._submit(part)

    def _submit(self, part):
        # Directories made here, in the test process's main thread: TempPathFactory is not
        # thread-safe (two threads making pytest's base directory at once made two).
        launch, key = part
        name = launch.name if key is None else f"{launch.name}-{key}"
        directory = self._tmp.mktemp(re.sub(r"[^\w.-]", "_", name))
        args = (directory,) if key is None else (key, directory)
        self._futures[part] = future = self._pool.submit(self._run, launch.fn, args)
        return future

    def _run(self, fn, args):
        with self._slots:
            return fn(*args)

    def result(self, launch: Launch, key=None):
        """What launch (`key`) returned, once it has ended. The first test to ask opens a third
        slot: from then on the test process mostly waits on launches."""
        if not self._widened.is_set():
            self._widened.set()
            self._slots.release()
        future = self._futures.get((launch, key)) or self._submit((launch, key))
        return future.result()

    def wait_all(self) -> None:
        wait(self._futures.values())

    def close(self) -> None:
        """Cancel what has not started (a session cut short), wait for what has."""
        self._pool.shutdown(wait=True, cancel_futures=True)


def _in_reading_order(items) -> list[tuple[Launch, object]]:
    """(launch, key) for every launch a test that will run reads: by the test module that first
    reads it, then the costliest first."""
    module_start, order = {}, {}
    for i, item in enumerate(items):
        launches = launches_read_by(item)
        if not launches or _skipped(item):
            continue
        module = module_start.setdefault(item.nodeid.split("::")[0], i)
        for launch in launches:
            for n, (key, cost) in enumerate(launch.parts()):
                order.setdefault((launch, key), (module, -cost, launch.name, n))
    return sorted(order, key=order.get)


def _skipped(item) -> bool:
    """A test marked skip, or skipif on a condition already true (not a string to evaluate)."""
    return any(m.name == "skip" or (m.name == "skipif" and m.args and m.args[0] is True)
               for m in item.iter_markers())
