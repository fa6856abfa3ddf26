"""torch's PowerSGDState (sync=ddp sync.compress=powersgd, ddp_lab/sync/ddp.py) by parameter: in
checkpoints, and across DDP's bucket layouts.

torch's powerSGD_hook keys what it keeps by DDP's bucket index: error_dict[i] is bucket i's
residual, its parameters one after the other in the bucket's order; p_memory_dict[i] and
q_memory_dict[i] are the P and Q of its compressed matrices, flat, grouped by matrix shape (the
order the hook lays them out in). An index names different parameters from one DDP to the next:
a new DDP's first step puts every parameter in one bucket (in parameter order, unless it looks
for unused parameters), and after it DDP cuts buckets of sync.bucket_mb in the order the
gradients became ready. Loaded as torch keeps it, a resumed run's first step would add one
bucket's error to another bucket's gradients. So the state goes into a checkpoint by
parameter name, and back into torch's dicts under whichever bucket holds those parameters when
the hook next sees it (`TorchPowerSGD.rekeyed`): wherever DDP lays a parameter out, its error,
P and Q follow it, bitwise.

The rest of what the hook reads goes in too: its step count (`iter`: compression starts at
start_powerSGD_iter), the RandomState the first Q of a bucket is seeded from, the statistics.
Each rank's error buffer is its own: a checkpoint of N ranks resumes at N ranks only (the
checkpoint's config digest holds the world size: ddp_lab/checkpoint.py).
"""

from __future__ import annotations

import torch
from torch import nn

from ddp_lab.compress.powersgd import as_matrix, numpy_rng_state, set_numpy_rng_state

# the per-bucket dicts of torch's PowerSGDState, by the name they have in a checkpoint
PARTS = {"error": "error_dict", "p": "p_memory_dict", "q": "q_memory_dict"}


class TorchPowerSGD:
    """A PowerSGDState, the bucket layout its dicts were made under, and (after a load) the state
    no bucket has taken up yet."""

    def __init__(self, state, model: nn.Module):
        self.state = state
        self.names = {p: name for name, p in model.named_parameters()}
        self.shapes = {name: p.shape for name, p in model.named_parameters()}
        self.layout: dict[int, tuple[str, ...]] = {}  # bucket index -> its parameters, in order
        self.loose = {part: {} for part in PARTS}  # part -> parameter name -> its piece

    def rekeyed(self, hook):
        """`hook`, each bucket's state first put where torch's hook looks for it: under the
        bucket's index, laid out for the parameters the bucket holds now."""

        def rekeying(state, bucket):
            i = bucket.index()
            names = tuple(self.names[p] for p in bucket.parameters())
            if self.layout.get(i) != names:
                # DDP launches a step's buckets in index order: those below i have run this step
                # (unchanged, or taken up already) and may still be in flight; from i on, not yet
                self._loosen(since=i)
                self._take_up(i, names)
            return hook(state, bucket)

        return rekeying

    def _pieces(self, part: str, names: tuple[str, ...]) -> list[tuple[str, int]]:
        """(name, elements) of each parameter's piece of a bucket's flat `part`, in its order:
        the error, parameter after parameter; P and Q, matrix after matrix grouped by shape as
        powerSGD_hook lays them out, and an empty piece for every parameter sent whole."""
        if part == "error":
            return [(n, self.shapes[n].numel()) for n in names]
        s, by_shape, size = self.state, {}, {}
        for n in names:
            rows, cols, r, compress = as_matrix(self.shapes[n], s.matrix_approximation_rank,
                                                s.min_compression_rate)
            if compress:
                by_shape.setdefault((rows, cols), []).append(n)
                size[n] = (rows if part == "p" else cols) * r
        matrices = [n for group in by_shape.values() for n in group]
        return [(n, size[n]) for n in matrices] + [(n, 0) for n in names if n not in size]

    def _split(self, part: str, i: int) -> dict[str, torch.Tensor]:
        """Bucket i's `part` by parameter (views); {} where the hook has made none."""
        flat = getattr(self.state, PARTS[part]).get(i)
        if flat is None:
            return {}
        pieces = self._pieces(part, self.layout[i])
        return dict(zip([n for n, _ in pieces], flat.split([k for _, k in pieces])))

    def _loosen(self, since: int) -> None:
        for i in [i for i in self.layout if i >= since]:
            for part, attr in PARTS.items():
                self.loose[part].update(self._split(part, i))
                getattr(self.state, attr).pop(i, None)  # (in place: the hooks hold these dicts)
            del self.layout[i]

    def _take_up(self, i: int, names: tuple[str, ...]) -> None:
        self.layout[i] = names
        for part, attr in PARTS.items():
            pieces = [self.loose[part].pop(n, None) for n, _ in self._pieces(part, names)]
            # all or nothing: only a bucket whose first compressed step was non-finite has none
            # (ddp_lab/sync/ddp.py: state_kept_when_nonfinite), and it starts afresh
            if pieces and all(p is not None for p in pieces):
                getattr(self.state, attr)[i] = torch.cat(pieces)

    def state_dict(self) -> dict:
        """This rank's state by parameter name, on the CPU, as plain tensors and numbers."""
        parts = {part: dict(loose) for part, loose in self.loose.items()}
        for i in self.layout:
            for part in PARTS:
                parts[part].update(self._split(part, i))
        s = self.state
        return {"iter": s.iter,
                "next_stats_report": s.next_stats_report, "rng": numpy_rng_state(s.rng),
                "numel": torch.tensor([s.total_numel_before_compression,
                                       s.total_numel_after_compression]),
                **{part: {n: t.to("cpu", copy=True) for n, t in pieces.items()}
                   for part, pieces in parts.items()}}

    def load_state_dict(self, saved: dict, device: torch.device) -> None:
        s = self.state
        for attr in PARTS.values():
            getattr(s, attr).clear()
        self.layout.clear()
        self.loose = {part: {n: t.to(device) for n, t in saved[part].items()} for part in PARTS}
        s.iter, s.next_stats_report = saved["iter"], saved["next_stats_report"]
        set_numpy_rng_state(s.rng, saved["rng"])
        s.total_numel_before_compression, s.total_numel_after_compression = (
            int(v) for v in saved["numel"])
