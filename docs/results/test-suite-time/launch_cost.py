"""What one 2-rank test job costs, started by torchrun and by tests/launchers.ranks, side by side.

    python docs/results/test-suite-time/launch_cost.py [rounds]   (from the repo root, machine idle)

Each round runs the DDP reference job of the tests (helpers.SMALL, sync=ddp, 2 ranks x 16) once
under torchrun and once with ranks forked from the forkserver, and counts the machine's busy CPU
seconds (/proc/stat: the forkserver's children are not this process's) and the wall time of
each. The forkserver starts (and imports) before the first round, outside the counts. Prints one
CSV row per job, and checks the two launchers' final parameters are bitwise equal."""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from helpers import SMALL, SMALL_BUCKETS, check, final_params  # noqa: E402
from launchers import ranks, torchrun  # noqa: E402

ARGS = SMALL + SMALL_BUCKETS + ["sync=ddp", "train.batch_size=16"]


def busy_cpu_s() -> float:
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def timed(launcher, run_dir):
    cpu, t0 = busy_cpu_s(), time.monotonic()
    check(launcher(ARGS + [f"hydra.run.dir={run_dir}"]))
    return time.monotonic() - t0, busy_cpu_s() - cpu


def main(rounds: int, out: str = "/tmp/launch_cost") -> None:
    ranks(ARGS + [f"hydra.run.dir={out}/warm"])  # the forkserver's start and imports
    print("launcher,round,wall_s,cpu_s")
    for r in range(rounds):
        for name, launcher in (("torchrun", torchrun), ("ranks", ranks)):
            wall, cpu = timed(launcher, f"{out}/{name}{r}")
            print(f"{name},{r},{wall:.2f},{cpu:.2f}", flush=True)
    a, b = final_params(f"{out}/torchrun0"), final_params(f"{out}/ranks0")
    assert all(torch.equal(a[k], b[k]) for k in a), "the launchers' runs differ"


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
