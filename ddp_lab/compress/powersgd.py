"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019), as torch's `powerSGD_hook` runs it, on
our collectives: for each matrix M of a bucket (a parameter's gradient, its first dimension the
rows, the rest flattened in memory order) and a rank r:

    P = M Q            all-reduced (a sum; P is orthogonalised next, so its scale does not matter)
    P = orth(P)        Gram-Schmidt (r <= 2) or QR: torch's own `_orthogonalize`
    Q = M^T P          all-reduced and divided by N: the average of every rank's M^T P
    M = P Q^T          the rank-r approximation of the average gradient, on every rank

One power-iteration step a step, warm-started: Q stays from the last step (the first one random,
from a seed drawn from one RandomState(seed) sequence, the same on every rank). It is linear in M:
the all-reduces of P and Q sum what an all-reduce of the M's would, so N ranks give the
single-process result on the mean gradient. A matrix whose (rows + cols) r elements times
`min_compression_rate` are not fewer than its rows x cols, and every vector (a bias: cols = 1),
goes uncompressed, all in one all-reduce, as torch's hook sends them. Error feedback over the
whole bucket, as torch's hook keeps it (ddp_lab/compress/feedback.py).

Elements on the wire per compressed matrix: (rows + cols) r, against rows x cols uncompressed;
`numel_before` / `numel_after` count them as torch's `compression_stats` does.

A step with an inf or NaN in any rank's bucket leaves the compressor as it was: an inf/NaN in M
reaches P = M Q, and through the all-reduces the average on every rank, so every rank sees the
same non-finite result (and the guard skips the step on every rank); neither the kept error nor
Q is replaced by it. Q is worked on as a copy and kept only after a finite step for that reason,
chosen on the device (torch.where): the check reads nothing back to the host.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

from ddp_lab.compress.base import COMPRESSORS, Compressor, Ops
from ddp_lab.compress.feedback import Feedback


def should_compress(rows: int, cols: int, rank: int, min_rate: float) -> bool:
    """torch's rule: compress when (rows + cols) r x min_rate < rows x cols."""
    return (rows + cols) * rank * min_rate < rows * cols


def as_matrix(shape, rank: int, min_rate: float) -> tuple[int, int, int, bool]:
    """(rows, cols, r, compress?) of a parameter of `shape`: its first dimension the rows, the
    rest flattened into the columns; r capped by both; torch's rule for whether."""
    numel = math.prod(shape)
    rows = shape[0] if len(shape) else 1
    cols = numel // max(rows, 1)
    r = min(rows, cols, rank)
    return rows, cols, r, should_compress(rows, cols, r, min_rate)


def nothing_compressed(shapes, rank: int, min_rate: float) -> str | None:
    """A warning where torch's rule compresses none of the matrices of `shapes` at `rank` (every
    bucket then goes whole, as without compression: a rank too high for this model), else None."""
    matrices = [s for s in shapes if len(s) > 1]
    if not matrices or any(as_matrix(s, rank, min_rate)[3] for s in matrices):
        return None
    return (f"sync.compress_rank={rank}: PowerSGD compresses none of the model's "
            f"{len(matrices)} matrices ((rows + cols) x rank x sync.min_compression_rate="
            f"{min_rate:g} is not below rows x cols for any): every gradient is sent whole, "
            "as without compression")


@COMPRESSORS.register("powersgd")
class PowerSGD(Compressor):
    def __init__(self, rank: int = 2, min_compression_rate: float = 2.0,
                 error_feedback: bool = True, seed: int = 0):
        self.rank, self.min_rate = rank, min_compression_rate
        self.feedback = Feedback(error_feedback)
        self.rng = np.random.RandomState(seed)  # Q's first seeds: the same draws on every rank
        self.qs: dict[int, torch.Tensor] = {}  # by bucket: every compressed matrix's Q, flat
        self.numel_before = self.numel_after = 0  # torch's compression_stats

    @classmethod
    def from_config(cls, scfg) -> "PowerSGD":
        return cls(scfg.compress_rank, scfg.min_compression_rate, scfg.error_feedback)

    def split(self, flat: torch.Tensor, shapes) -> tuple[list, list]:
        """([(M, r)] the matrices to compress, as views of `flat`; [the rest, flat slices])."""
        mats, rest, off = [], [], 0
        for shape in shapes:
            numel = math.prod(shape)
            rows, cols, r, compress = as_matrix(shape, self.rank, self.min_rate)
            piece = flat[off:off + numel]
            self.numel_before += numel
            self.numel_after += (rows + cols) * r if compress else numel
            (mats.append((piece.view(rows, cols), r)) if compress else rest.append(piece))
            off += numel
        return mats, rest

    def reduce(self, key: int, flat: torch.Tensor, shapes, ops: Ops) -> None:
        x = self.feedback.add(key, flat)
        mats, rest = self.split(flat, shapes)
        if rest:
            together = torch.cat(rest)
            ops.all_reduce(together)
            together.div_(ops.world_size)
            _unpack(together, rest)
        q_flat = self._power_step(key, mats, ops) if mats else None
        finite = torch.isfinite(flat).all()  # the same verdict on every rank: see the module
        self.feedback.keep(key, x, flat, finite)
        if q_flat is not None:
            self.qs[key] = torch.where(finite, q_flat, self.qs[key], out=q_flat)

    def _power_step(self, key: int, mats: list, ops: Ops) -> torch.Tensor:
        """M ~ P Q^T for every matrix, in place; returns the new Qs (flat) to keep."""
        ps, p_flat = _buffers(flat_like=mats[0][0], sizes=[(m.shape[0], r) for m, r in mats])
        qs, q_flat = self._warm_qs(key, mats)
        for (m, _), p, q in zip(mats, ps, qs):
            torch.mm(m, q, out=p)
        ops.all_reduce(p_flat)
        for p in ps:
            _orthogonalize(p.unsqueeze(0))
        for (m, _), p, q in zip(mats, ps, qs):
            torch.mm(m.t(), p, out=q)
        ops.all_reduce(q_flat)
        q_flat.div_(ops.world_size)
        for (m, _), p, q in zip(mats, ps, qs):
            torch.mm(p, q.t(), out=m)
        return q_flat

    def _warm_qs(self, key: int, mats: list) -> tuple[list, torch.Tensor]:
        """Every matrix's Q, views of a copy of the flat buffer kept per bucket: last step's,
        orthogonalised again, or (the first time) random from the next seed of the shared
        sequence, kept from then on."""
        sizes = [(m.shape[1], r) for m, r in mats]
        if key not in self.qs:
            first = torch.empty(sum(a * b for a, b in sizes), dtype=mats[0][0].dtype)
            # a generator of its own: torch.manual_seed would also seed every CUDA generator
            # alike on every rank, and dropout's masks would stop differing between ranks
            seeded = torch.Generator().manual_seed(self.rng.randint(1_000_000_000))
            for q in _views(first, sizes):
                q.copy_(torch.randn(*q.shape, dtype=q.dtype, generator=seeded))
            self.qs[key] = first.to(mats[0][0].device)
        q_flat = self.qs[key].clone()
        qs = _views(q_flat, sizes)
        for q in qs:
            _orthogonalize(q.unsqueeze(0))
        return qs, q_flat

    def kept(self) -> list[torch.Tensor]:
        return super().kept() + list(self.qs.values())

    def state_dict(self) -> dict:
        return {"feedback": self.feedback.state_dict(),
                "qs": {str(k): v for k, v in self.qs.items()},
                "rng": numpy_rng_state(self.rng),
                "numel": torch.tensor([self.numel_before, self.numel_after])}

    def load_state_dict(self, state: dict) -> None:
        self.feedback.load_state_dict(state["feedback"])
        self.qs = {int(k): v.clone() for k, v in state["qs"].items()}
        set_numpy_rng_state(self.rng, state["rng"])
        self.numel_before, self.numel_after = (int(v) for v in state["numel"])


def _views(flat: torch.Tensor, sizes: list[tuple[int, int]]) -> list[torch.Tensor]:
    out, off = [], 0
    for a, b in sizes:
        out.append(flat[off:off + a * b].view(a, b))
        off += a * b
    return out


def _buffers(flat_like: torch.Tensor, sizes: list[tuple[int, int]]):
    flat = torch.empty(sum(a * b for a, b in sizes), dtype=flat_like.dtype,
                       device=flat_like.device)
    return _views(flat, sizes), flat


def _unpack(together: torch.Tensor, pieces: list[torch.Tensor]) -> None:
    off = 0
    for piece in pieces:
        piece.copy_(together[off:off + piece.numel()])
        off += piece.numel()


def numpy_rng_state(rng: np.random.RandomState) -> dict:
    """A numpy RandomState as plain tensors and numbers (a weights_only checkpoint loads it)."""
    kind, keys, pos, has_gauss, gauss = rng.get_state()
    return {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "gauss": float(gauss)}


def set_numpy_rng_state(rng: np.random.RandomState, s: dict) -> None:
    rng.set_state(("MT19937", s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"],
                   s["gauss"]))
