"""The interference probe: how much backward and the gradient all-reduces slow each other, and how
much the other ranks' compute slows this rank's, measured at one world size on its own (not fitted
to the sweep it helps predict):

    torchrun --standalone --nproc_per_node=N -m ddp_lab.scale.interfere OUT.json \
        --algos native,ring [--rounds 5] -- model=alexnet_cifar data=synthetic train.batch_size=8

The training overrides after `--` compose the point's config (conf/config.yaml), so the probe
builds the model, batch, precision, optimizer, non-finite check and buckets the points train with.
Each round runs these conditions in turn, interleaved, so a load that drifts over the run (other
users of a shared machine) falls on all of them alike:

  solo      rank 0 runs one step's compute (forward, backward, the non-finite check, optimizer)
            while the other ranks wait: the N=1 condition, measured next to the others
  all       every rank runs the same at once, nothing sent: contention for what ranks share
            (cores and memory bandwidth on a CPU; ~1 on separate GPUs)
  and for each algorithm (`native` is DDP's: the backend's own all-reduce):
  comm      every rank runs the sync's bucket all-reduces at the training's bucket sizes (ours:
            pack, all-reduce, unpack; DDP's hook: divide, all-reduce), one after the other,
            nothing computed
  bwd+comm  forward + backward while those all-reduces run back to back on a second thread (until
            no rank is computing): compute slowed by communication
  comm+bwd  the bucket all-reduces once while forward + backward run back to back: communication
            slowed by compute

Derived from rank 0's medians (the training loop reports rank 0's): contention[phase] = all /
solo; compute_slowdown = backward in bwd+comm / in all; comm_slowdown = all-reduces in comm+bwd /
in comm; bucket_ms = each bucket's [pack, all-reduce, unpack] in comm (the model's price of that
bucket at this N); each gradient's readiness (the fraction of backward done when it was produced,
from post-accumulate-grad hooks in `all`; CPU only: on CUDA a hook fires when the kernel is
queued).
OUT.json holds every rank's samples next to what was derived.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from ddp_lab.buckets import sync_rule
from ddp_lab.dtypes import element_size
from ddp_lab.perf.probe import derive
from ddp_lab.perf.step import bucket_layout
from ddp_lab.step import TrainStep, build_parts
from ddp_lab.sync.comm_thread import comm_thread_init


def point_config(overrides: list[str]):
    """The point's training config, as the dataclasses the training loop reads."""
    from omegaconf import OmegaConf

    from ddp_lab.cli import compose
    from ddp_lab.config import validate

    cfg = compose(overrides)
    validate(cfg)
    return OmegaConf.to_object(cfg)


@dataclasses.dataclass
class Bench:
    """What one rank computes with: the point's step (model, batch, precision, optimizer,
    non-finite check: ddp_lab.step), without its sync, whose communication the probe runs apart."""
    step: TrainStep
    x: torch.Tensor
    y: torch.Tensor
    ready: dict = dataclasses.field(default_factory=dict)  # param index -> host time (recording)
    recording: bool = False

    @property
    def model(self) -> torch.nn.Module:
        return self.step.parts.model

    @property
    def device(self) -> torch.device:
        return self.x.device


def build_bench(cfg, info) -> Bench:
    from ddp_lab.data import build_data
    from ddp_lab.guard import Guard
    from ddp_lab.sync import NoSync

    data = build_data(cfg, info.rank, info.world_size, info.device)
    # The loop's own step, as at world size 1: the collective part of its check is priced by the
    # fit, and its gradient sync is what the probe's conditions run beside it.
    alone = dataclasses.replace(info, rank=0, world_size=1, local_world_size=1)
    parts = build_parts(cfg, alone, data.num_classes, sync=NoSync())
    guard = Guard(cfg.train, alone, parts.model, parts.precision.scaler, 10 ** 9)
    x, y = next(data.train.epoch(0))
    bench = Bench(TrainStep(parts, guard, 1, cfg.optim.grad_clip),
                  x.contiguous(memory_format=parts.memory_format), y)
    for i, p in enumerate(parts.model.parameters()):
        p.register_post_accumulate_grad_hook(lambda _p, i=i: _stamp(bench, i))
    return bench


def _stamp(bench: Bench, index: int) -> None:
    if bench.recording:
        bench.ready[index] = time.perf_counter()


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute(b: Bench, optimizer: bool = True) -> dict[str, float]:
    """One step's compute, timed per phase (ms); with `optimizer`, the check and the update too."""
    out, t = {}, time.perf_counter()

    def mark(phase):
        nonlocal t
        _sync(b.device)
        now = time.perf_counter()
        out[phase], t = (now - t) * 1e3, now

    loss = b.step.forward_backward([(b.x, b.y)], mark)
    if optimizer:
        b.step.update(1, loss, mark)
        mark("optim")
        b.step.guard._pending.clear()  # noqa: SLF001 - verdicts are never read here
    else:
        b.model.zero_grad(set_to_none=True)
    return out


class BucketComm:
    """The sync's all-reduces of one step, at the training's bucket sizes, on stand-in buffers."""

    def __init__(self, sizes: list[int], algo: str, world_size: int, dtype, device):
        self.algo, self.n, self.sizes = algo, world_size, sizes
        elem = torch.empty((), dtype=dtype).element_size()
        numel = [max(1, s // elem) for s in sizes]
        self.src = [torch.randn(k, device=device).to(dtype) for k in numel]  # "the gradients"
        self.buf = [torch.zeros(k, dtype=dtype, device=device) for k in numel]
        self._thread = ThreadPoolExecutor(1, initializer=comm_thread_init, initargs=(device,))

    def run(self) -> list[list[float]]:
        """[pack, all-reduce, unpack] ms per bucket, as the sync does them (see the module): ours
        on a thread set up as the sync's communication thread."""
        if self.algo == "native":  # (DDP's hook divides on backward's thread)
            return self._run()
        return self._thread.submit(self._run).result()

    def _run(self) -> list[list[float]]:
        from ddp_lab import comm

        out = []
        for src, buf in zip(self.src, self.buf):
            t0 = time.perf_counter()
            if self.algo == "native":
                buf.div_(self.n)  # DDP's allreduce_hook divides the bucket, then all-reduces it
            else:
                buf.copy_(src)  # our syncs pack the gradients into the bucket
            _sync(buf.device)
            t1 = time.perf_counter()
            comm.all_reduce(buf, self.algo)
            _sync(buf.device)
            t2 = time.perf_counter()
            if self.algo != "native":
                torch.div(buf, self.n, out=src)  # and unpack it, divided, into the gradients
                _sync(buf.device)
            t3 = time.perf_counter()
            out.append([(t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3])
        return out


def bucket_sizes(model: torch.nn.Module, algo: str, scfg) -> list[int]:
    """Bytes of each bucket the sync makes of `model`'s gradients (ddp_lab.perf.step's rules)."""
    elem = element_size(scfg.comm_dtype)
    numels = [p.numel() for p in model.parameters() if p.requires_grad][::-1]
    return bucket_layout(numels, elem, scfg.bucket_mb, *sync_rule(algo == "native"))


def compute_under_comm(b: Bench, bc: BucketComm) -> dict[str, float]:
    """forward + backward while the all-reduces run back to back on a second thread; the thread
    stops once no rank is computing any more (a vote after each pass, so all ranks stop alike)."""
    computing = threading.Event()
    computing.set()

    def loop():
        vote = torch.zeros(1, device=b.device)
        while True:
            bc.run()
            vote.fill_(1.0 if computing.is_set() else 0.0)
            dist.all_reduce(vote)
            if vote.item() == 0:
                return

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    times = compute(b, optimizer=False)
    computing.clear()
    thread.join()
    return times


def comm_under_compute(b: Bench, bc: BucketComm) -> list[list[float]]:
    """The all-reduces once while forward + backward run back to back on this thread."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(bc.run()), daemon=True)
    thread.start()
    while thread.is_alive():
        compute(b, optimizer=False)
    thread.join()
    return result[0]


def one_round(b: Bench, comms: dict[str, BucketComm], info) -> dict:
    """Every condition once, in a fixed order; this rank's samples."""
    s: dict = {}
    dist.barrier()
    s["solo"] = compute(b) if info.rank == 0 else {}
    dist.barrier()
    b.ready, b.recording = {}, True
    t0 = time.perf_counter()
    s["all"] = compute(b)
    b.recording = False
    s["all"]["store"] = _store_round_trip(info)
    bwd = s["all"]["backward"] / 1e3
    start = t0 + s["all"]["forward"] / 1e3
    s["ready"] = [(b.ready[i] - start) / bwd if i in b.ready else float("nan")
                  for i in range(len(list(b.model.parameters())))]
    for algo, bc in comms.items():
        dist.barrier()
        s[f"{algo}/comm"] = bc.run()
        dist.barrier()
        s[f"{algo}/bwd+comm"] = compute_under_comm(b, bc)
        dist.barrier()
        s[f"{algo}/comm+bwd"] = comm_under_compute(b, bc)
    return s


def _store_round_trip(info) -> float:
    """ms of one c10d store write: what the loop's heartbeat costs each step at N > 1."""
    if info.world_size < 2:
        return 0.0
    store = dist.distributed_c10d._get_default_store()  # private, as ddp_lab.dist uses it
    t0 = time.perf_counter()
    store.set(f"ddp_lab/probe/{info.rank}", "1")
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    from ddp_lab.dist import destroy_group, init_group
    from ddp_lab.sync.bucketed import comm_dtype

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--algos", default="native")
    p.add_argument("--rounds", type=int, default=5)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # training overrides after `--`
    a = p.parse_args(argv[:cut])
    cfg = point_config(argv[cut + 1:])
    info = init_group(cfg.dist.backend, cfg.dist.timeout_s)
    try:
        b = build_bench(cfg, info)
        params = [q for q in b.model.parameters()]
        dtype = comm_dtype(cfg.sync.comm_dtype) or params[0].dtype
        algos = [x for x in a.algos.split(",") if x] if info.world_size > 1 else []
        comms = {algo: BucketComm(bucket_sizes(b.model, algo, cfg.sync), algo, info.world_size,
                                  dtype, info.device) for algo in algos}
        one_round(b, comms, info)  # warm-up: allocator, connections, caches
        load = Load(info.device)
        rounds = [one_round(b, comms, info) for _ in range(a.rounds)]
        others = load.others()
        every = [None] * info.world_size
        dist.all_gather_object(every, rounds)
        if info.is_main:
            write(a.out, cfg, info, rounds, every, comms, [q.numel() for q in params], others)
    finally:
        destroy_group()


class Load:
    """Cores busy with anything but the probe's ranks while it ran (collective; Linux): the
    machine's busy time from /proc/stat less every rank's own CPU time, over the wall time."""

    def __init__(self, device):
        from ddp_lab.scale.launch import cpu_seconds

        self.device = device
        dist.barrier()
        self.busy, self.cpu, self.t = cpu_seconds()[0], time.process_time(), time.perf_counter()

    def others(self) -> float:
        from ddp_lab.scale.launch import cpu_seconds

        mine = torch.tensor([time.process_time() - self.cpu], dtype=torch.float64,
                            device=self.device)
        dist.all_reduce(mine)
        wall = time.perf_counter() - self.t
        return max(0.0, cpu_seconds()[0] - self.busy - mine.item()) / wall


def write(path: str, cfg, info, rounds, every, comms, numels: list[int],
          other_cores: float) -> None:
    result = {"world_size": info.world_size, "backend": info.backend, "device": str(info.device),
              "threads": torch.get_num_threads(), "rounds": len(rounds),
              "model": cfg.model.name, "per_rank_batch": cfg.train.batch_size,
              "bucket_mb": cfg.sync.bucket_mb, "comm_dtype": cfg.sync.comm_dtype,
              "load_avg": list(os.getloadavg()), "other_cores": other_cores,
              "param_numels": numels,  # registration order, as grad_ready
              "derived": derive(every, {a: bc.sizes for a, bc in comms.items()}, len(numels)),
              "samples": every}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
