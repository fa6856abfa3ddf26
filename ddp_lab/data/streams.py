"""One rank's batches, epoch by epoch, and which samples they hold.

`shard_indices` (DistributedSampler's indices, as a tensor) decides which indices a rank gets;
because it deals one global permutation out round-robin, the union of all ranks' batch k is the
same set of samples as batch k of a single process with world_size times the per-rank batch. That
is what lets a 2-rank run be checked against a 1-rank run.

`DeviceBatches` cuts an in-memory set's batches by indexing, fetching many at once, up to
FETCH_MAX_BYTES (a whole CIFAR-size epoch; several epochs of a set as small as digits), as views.
`LoaderBatches` runs a torch Dataset (ImageFolder) through DataLoader worker processes.
"""

from __future__ import annotations

import functools
import math
from typing import Iterator

import torch
from torch.utils.data import DataLoader

from ddp_lab.data.images import TensorImages, crop_flip_draws

# A stream fetches as many whole batches at once as fit in this size (a whole epoch of CIFAR-10
# or of 32 px synthetic data; at 224 px a handful of batches), GATHER_CHUNK samples at a
# time, and cuts them as views. When the next fetch is made, the batch in use may still hold the
# previous one: up to twice this, per stream.
FETCH_MAX_BYTES = 512 * 2**20
GATHER_CHUNK = 16384


def fetch_window(batch_size: int, sample_bytes: int, epoch_samples: int,
                 epochs_ahead: bool = False, epochs_left: int | None = None) -> tuple[int, int]:
    """(epochs, samples) of a `DeviceBatches` fetch, the largest of an epoch of `epoch_samples`:
    with `epochs_ahead`, whole epochs where one fits in FETCH_MAX_BYTES several times (at most
    `epochs_left`, None: no end known); else as many whole batches as fit (at least one), at most
    the epoch's. The stream fetches by it, and memory_fit's predicted peak counts by it: a batch
    in use keeps its whole fetch alive."""
    epoch_bytes = epoch_samples * sample_bytes
    epochs = FETCH_MAX_BYTES // epoch_bytes if epochs_ahead and epoch_bytes else 1
    if epochs_left is not None:  # (a short run: fetching past its end is wasted work)
        epochs = min(epochs, epochs_left)
    if epochs > 1:
        return epochs, epochs * epoch_samples
    batches = max(1, FETCH_MAX_BYTES // (batch_size * sample_bytes))
    return 1, min(batches * batch_size, epoch_samples)


class BatchStream:
    """One rank's batches of a data set, epoch by epoch: `epoch(e, start_batch, last_epoch)`
    resumes mid-epoch; `last_epoch`, the last epoch the run reads (None: no end known), bounds
    what a stream may fetch ahead."""

    def __init__(self, dataset, indices_for_epoch, batch_size: int, device, drop_last: bool):
        self.dataset, self.indices_for_epoch = dataset, indices_for_epoch
        self.batch_size, self.device, self.drop_last = batch_size, device, drop_last

    def num_batches(self, epoch: int = 0) -> int:
        return self._batches_of(len(self.indices_for_epoch(epoch)))

    def _batches_of(self, n: int) -> int:
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)


class DeviceBatches(BatchStream):
    """Batches of an in-memory data set, made by indexing: no copies, no worker processes.

    `epochs_ahead`: an epoch that fits in FETCH_MAX_BYTES several times over is fetched together
    with the epochs after it, up to `last_epoch` (the last the run reads, as the caller says), and
    those wait here for their turn. Each epoch's start costs a dozen
    host calls (the permutation, the draws, the index copy, the fetch), and a small model's step
    is bounded by how fast the host issues them: on digits at batch 512 an epoch is 2 steps, so
    without this that work came every other step and showed in the throughput."""

    def __init__(self, *args, augment_seed: int | None = None, epochs_ahead: bool = False):
        super().__init__(*args)
        if epochs_ahead and not self.drop_last:  # (epochs fetched together are cut in whole batches)
            raise ValueError("DeviceBatches: epochs_ahead needs drop_last")
        self.augment_seed, self.epochs_ahead = augment_seed, epochs_ahead
        self._ahead: dict[int, list] = {}  # epoch -> its batches, fetched with an earlier one

    def epoch(self, epoch: int, start_batch: int = 0,
              last_epoch: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        epochs, window = self._window(epoch, last_epoch)
        if epoch not in self._ahead:
            self._ahead.clear()  # a jump (a resume, a calibration pass): what waits is stale
            if epochs > 1:
                ahead = range(epoch, epoch + epochs)
                self._ahead = dict(zip(ahead, self._fetch_epochs(ahead)))
        if epoch in self._ahead:
            yield from map(self._placed, self._ahead.pop(epoch)[start_batch:])
            return
        idx, draws = self._to_device(self._samples(epoch, start_batch))
        # Fetch many batches at once (in batch order, chunked) and cut them as views, in one call:
        # a small model's step is bounded by how fast the host issues ops, and a batch fetched
        # alone takes several of them (more augmented). Samples are fetched alike whatever the batch they
        # come in (augmentation is per sample), so the batches are the same.
        for w in range(0, len(idx), max(1, window)):  # (an empty shard's window is 0 samples)
            part = slice(w, w + window)
            yield from map(self._placed, self._batches(idx[part],
                                                       None if draws is None else draws[:, part]))

    @functools.cached_property
    def _epoch_samples(self) -> int:  # every epoch's: counted once (each count draws a permutation)
        n = len(self.indices_for_epoch(0))
        return min(n, self._batches_of(n) * self.batch_size)  # as `_samples` cuts them

    def _window(self, epoch: int, last_epoch: int | None = None) -> tuple[int, int]:
        """(epochs, samples) of a fetch from `epoch` on: `fetch_window`'s."""
        left = None if last_epoch is None else last_epoch + 1 - epoch
        return fetch_window(self.batch_size, self.dataset.sample_bytes(), self._epoch_samples,
                            self.epochs_ahead, left)

    def _fetch_epochs(self, epochs: range) -> list[list]:
        """The batches of each of `epochs`, from one index copy and one fetch."""
        samples = [self._samples(e) for e in epochs]
        batches = self._batches(*self._to_device(torch.cat(samples, dim=-1)))
        per_epoch = len(batches) // len(epochs)
        return [batches[i * per_epoch:(i + 1) * per_epoch] for i in range(len(epochs))]

    def _samples(self, epoch: int, start_batch: int = 0) -> torch.Tensor:
        """On the host: the epoch's indices from `start_batch` on ([n]), or, augmented, the
        indices and their crop-and-flip draws ([4, n])."""
        idx = torch.as_tensor(self.indices_for_epoch(epoch), dtype=torch.int64)  # once per epoch
        n, b0 = self._batches_of(len(idx)), start_batch * self.batch_size
        idx = idx[b0:min(len(idx), n * self.batch_size)]  # the samples this stream will yield
        if self.augment_seed is None:
            return idx
        # The augmentation's draws are hashed here, on the host, where the indices are: a dozen
        # small ops fewer on the device, which a small model's step would wait for.
        return torch.cat([idx[None], crop_flip_draws(idx, (self.augment_seed, epoch))])

    def _to_device(self, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_samples`' output where the data set is, as (indices, draws or None)."""
        where = self.dataset.labels.device if isinstance(self.dataset, TensorImages) else self.device
        if torch.device(where).type == "cuda":
            # From pinned memory the copy is queued like a kernel; from pageable memory it would
            # wait for every queued step to finish first, draining the GPU at each epoch start.
            samples = samples.pin_memory()
        samples = samples.to(where, non_blocking=True)
        return (samples, None) if self.augment_seed is None else (samples[0], samples[1:])

    def _batches(self, idx: torch.Tensor, draws) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`idx`'s samples fetched at once, cut into batches (views, where the data set is)."""
        xs, ys = self._fetch_all(idx, draws)
        return list(zip(xs.split(self.batch_size), ys.split(self.batch_size)))

    def _placed(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch on the training device, moved as it is yielded (data.on_device=false)."""
        x, y = batch
        if x.device == self.device:  # (on the device already: not even a no-op call)
            return x, y
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def _fetch_all(self, idx: torch.Tensor, draws) -> tuple[torch.Tensor, torch.Tensor]:
        """`idx`'s samples, GATHER_CHUNK at a time (bounded temporaries) into one buffer."""
        if len(idx) <= GATHER_CHUNK:
            return self.dataset.fetch(idx, draws)
        xs = ys = None
        for i in range(0, len(idx), GATHER_CHUNK):
            part = slice(i, i + GATHER_CHUNK)
            x, y = self.dataset.fetch(idx[part], None if draws is None else draws[:, part])
            if xs is None:
                layout = (torch.channels_last if x.dim() == 4 and not x.is_contiguous()
                          and x.is_contiguous(memory_format=torch.channels_last)
                          else torch.contiguous_format)
                xs = torch.empty((len(idx), *x.shape[1:]), dtype=x.dtype, device=x.device,
                                 memory_format=layout)
                ys = y.new_empty((len(idx), *y.shape[1:]))
            xs[i:i + len(x)], ys[i:i + len(y)] = x, y
        return xs, ys


class LoaderBatches(BatchStream):
    """Batches of a Dataset decoded by DataLoader worker processes, copied to the device."""

    def __init__(self, *args, num_workers: int):
        super().__init__(*args)
        self.num_workers = num_workers

    def epoch(self, epoch: int, start_batch: int = 0,
              last_epoch: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.dataset.epoch = epoch  # read by the workers, which start after this (nothing ahead)
        indices = self.indices_for_epoch(epoch)[start_batch * self.batch_size:].tolist()
        loader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=indices,
                            drop_last=self.drop_last, num_workers=self.num_workers,
                            pin_memory=self.device.type == "cuda")
        for x, y in loader:
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


def shard_indices(n: int, rank: int, world_size: int, seed: int, epoch: int) -> torch.Tensor:
    """This rank's sample indices for `epoch`: exactly DistributedSampler's (shuffle=True, padded
    by wrapping around to a multiple of the world size, every world_size-th from `rank`), made as a
    tensor (DistributedSampler's list of Python ints is slow enough to show in a small model's
    step time)."""
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    perm = torch.randperm(n, generator=g)
    total = math.ceil(n / world_size) * world_size
    return perm.repeat(math.ceil(total / n))[:total][rank::world_size]
