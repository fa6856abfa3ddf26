"""The CUDA/NCCL path of ddp_lab.comm and the bucketed sync (skipped without CUDA).

    python -m pytest -q tests/test_sync_cuda.py        # on a GPU machine; 2+ GPUs also test NCCL p2p

One process per GPU (up to 2), NCCL. References: dist.all_reduce (bitwise on integer data) and
each rank's own gradients averaged with it. The races the design must prevent are provoked with
torch.cuda._sleep (a GPU spin): gradients produced late on the default stream (the side stream
must wait for them before packing), and communication finishing late on the side stream (the
default stream must wait for it in finish() before anyone reads the grads)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from launchers import spawn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SPIN = 50_000_000  # GPU cycles, tens of milliseconds


def world_size() -> int:
    return min(2, torch.cuda.device_count())


def _comm_cases(rank, n):
    from ddp_lab import comm

    dev = torch.device("cuda", rank)
    for algo in ("naive", "ring", "tree"):
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            for numel in (0, 1, max(n - 1, 1), 7, 1031, 1 << 20):
                g = torch.Generator(device=dev).manual_seed(numel * 7 + rank)
                x = torch.randint(-8, 9, (numel,), device=dev, generator=g).to(dtype)
                ref = x.clone()
                dist.all_reduce(ref)
                got = comm.all_reduce(x.clone(), algo)
                assert torch.equal(got, ref), (algo, dtype, numel)
        with pytest.raises(ValueError, match="NCCL"):
            comm.all_reduce(torch.zeros(4), algo)  # a CPU tensor on an NCCL group
    return True


@pytest.mark.timeout(300)
def test_comm_on_nccl_matches_dist_all_reduce():
    assert all(spawn(_comm_cases, world_size(), backend="nccl", timeout=280))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 12 * 12, 256), nn.ReLU(),
                                  nn.Linear(256, 10))

    def forward(self, x):
        return self.head(self.conv(x))


def _sync_cases(rank, n):
    from ddp_lab.sync.config import SyncConfig

    from ddp_lab.sync import bucketed

    dev = torch.device("cuda", rank)
    real_all_reduce = bucketed.comm.all_reduce

    def late_all_reduce(tensor, algo, group=None):  # communication ends late on its stream
        torch.cuda._sleep(SPIN)
        return real_all_reduce(tensor, algo, group)

    bucketed.comm.all_reduce = late_all_reduce
    out = {}
    for overlap in (True, False):
        for comm_dtype, tol in (("fp32", 1e-5), ("bf16", 2e-2)):
            torch.manual_seed(rank)
            model = Net().to(dev, memory_format=torch.channels_last)  # strided conv grads
            cfg = SyncConfig(name="ring", overlap=overlap, comm_dtype=comm_dtype, bucket_mb=0.05)
            sync = bucketed.BucketedSync(cfg, dev, n)
            sync.prepare(model)
            torch.manual_seed(0)
            ref_model = Net().to(dev, memory_format=torch.channels_last)
            for p, q in zip(model.parameters(), ref_model.parameters()):
                assert torch.equal(p, q)
            for step in range(3):
                g = torch.Generator(device=dev).manual_seed(100 * rank + step)
                x = torch.randn(16, 3, 16, 16, device=dev, generator=g).contiguous(
                    memory_format=torch.channels_last)
                y = torch.randint(0, 10, (16,), device=dev, generator=g)
                for m in (model, ref_model):
                    m.zero_grad(set_to_none=True)
                    logits = m(x)
                    # Gradients come late on the default stream: spin before backward's kernels.
                    logits.register_hook(lambda grad: (torch.cuda._sleep(SPIN), grad)[1])
                    nn.functional.cross_entropy(logits, y).backward()
                sync.finish()
                for p, q in zip(model.parameters(), ref_model.parameters()):
                    want = q.grad.clone()
                    dist.all_reduce(want)
                    want /= n
                    err = (p.grad - want).abs().max().item()
                    scale = want.abs().max().item()
                    assert err <= tol * scale + 1e-12, (overlap, comm_dtype, step, err, scale)
                with torch.no_grad():  # the same SGD step on both, so they stay comparable
                    for p, q in zip(model.parameters(), ref_model.parameters()):
                        p -= 0.1 * p.grad
                        q.copy_(p)
            stats = sync.comm_stats()
            assert stats["comm_busy_ms"] > 0 and (n == 1 or stats["bytes_per_step"] > 0), stats
            if overlap:
                assert stats["buckets_launched_in_backward"] >= 1, stats
            out[(overlap, comm_dtype)] = stats
            sync.close()
    bucketed.comm.all_reduce = real_all_reduce
    return out


@pytest.mark.timeout(300)
def test_bucketed_sync_on_cuda_waits_for_grads_and_for_communication():
    spawn(_sync_cases, world_size(), backend="nccl", timeout=280)
