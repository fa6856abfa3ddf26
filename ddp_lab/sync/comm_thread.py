"""The communication thread of our syncs (ddp_lab/sync/bucketed.py, zero.py, zero3.py): it runs
their collectives in the order they are handed over, beside backward and forward.

    worker = CommThread(device)
    done = worker.submit(fn, *args)     # queued; every rank queues the same jobs in the same order
    worker.wait(done)                   # that job has run; raises what failed on the thread
    worker.flush()                      # every job queued so far has run

CPU (gloo): gloo ops block the calling thread, hence a thread: the training thread only waits.
CUDA (NCCL): the same thread, issuing on a side stream of its own (`stream`); `done_event`, made
by flush(), is recorded after the work of every job before it.
"""

from __future__ import annotations

import contextlib
import queue
import threading

import torch


class CommThread:
    """Runs jobs (a bucket's reduction; with ZeRO-3 a unit's all-gather too) in submission order,
    off the training thread (and, on CUDA, on a stream of its own). One thread for the whole run;
    a job that fails makes the jobs after it be skipped until its exception is raised, by the next
    wait() or flush()."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.done_event = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="ddp_lab-comm", daemon=True)
        self._thread.start()

    def submit(self, fn, *args) -> threading.Event:
        """Queue `fn(*args)`; the event returned is set once it has run (or been skipped)."""
        done = threading.Event()
        self._jobs.put((fn, args, done))
        return done

    def wait(self, done: threading.Event) -> None:
        """Block until the job of `done` has run; raise what failed on the thread."""
        while not done.wait(1.0):
            self.check()
        self.check()

    def check(self) -> None:
        """Raise what failed on the thread (once), or that the thread died."""
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        if not self._thread.is_alive():
            raise RuntimeError("the communication thread died")

    def flush(self) -> None:
        """Wait for every job queued so far; on CUDA `done_event` then follows all their work."""
        self.wait(self.submit(self._record_done))

    def _record_done(self) -> None:
        if self.stream is not None:
            self.done_event = torch.cuda.Event()
            self.done_event.record(self.stream)

    def close(self) -> None:
        self._jobs.put((None, (), None))
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        comm_thread_init(self.device)
        ctx = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with ctx:
            while True:
                fn, args, done = self._jobs.get()
                if fn is None:
                    return
                try:
                    if self._error is None:
                        fn(*args)
                except BaseException as e:  # noqa: BLE001 - re-raised by wait()
                    self._error = e
                finally:
                    done.set()


def comm_thread_init(device: torch.device) -> None:
    """Set up the calling thread to run the all-reduces beside backward. CUDA: its device. CPU:
    one intra-op thread, for the copies and adds run here would start a second OpenMP team on the
    cores backward's team already uses, and each team's threads then wait on the other's
    descheduled ones (torch.set_num_threads: this thread's team; threads started later default to
    it too, and the training loop starts none)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
