"""Data sets and the per-rank batch streams the training loop reads.

Every data set is indexed: sample i is a pure function of (i, seed, epoch), whichever rank loads
it. `shard_indices` (DistributedSampler's indices, as a tensor) decides which indices a rank gets;
because it deals one global permutation out round-robin, the union of all ranks' batch k is the
same set of samples as batch k of a single process with world_size times the per-rank batch. That
is what lets a 2-rank run be checked against a 1-rank run.

In-memory sets (digits, synthetic, CIFAR-10) live on the training device and are batched by
indexing, so the loader never starves a GPU: normalised once in the compute dtype where that fits
in PREPARE_MAX_BYTES, else as uint8 normalised per batch (synthetic: a pool of images in the
compute dtype). A set to augment is normalised once with a border of black around each image, so
a random crop and flip is one gather. Batches are fetched many at once, up to FETCH_MAX_BYTES
(a whole CIFAR-size epoch; several epochs of a set as small as digits), and cut as views.
ImageFolder goes through a DataLoader with worker processes.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from ddp_lab.config import ConfigError
from ddp_lab.precision import AUTOCAST_DTYPES

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# In-memory sets up to this size each (normalised, at the model's resolution) are prepared once:
# digits' training set fits even at 224 px, CIFAR-10's at 32 px; CIFAR-10 upsampled to 224 px
# does not, and is normalised per batch.
PREPARE_MAX_BYTES = 2 * 2**30
# A stream fetches as many whole batches at once as fit in this size (a whole epoch of CIFAR-10
# or of 32 px synthetic data; at 224 px a handful of batches), GATHER_CHUNK samples at a
# time, and cuts them as views. When the next fetch is made, the batch in use may still hold the
# previous one: up to twice this, per stream.
FETCH_MAX_BYTES = 512 * 2**20
GATHER_CHUNK = 16384
AUGMENT_PAD = 4  # CIFAR-style augmentation: a random 32 px crop of the image padded by 4, a flip

log = logging.getLogger(__name__)


def sample_hash(*keys) -> torch.Tensor:
    """A cheap deterministic integer hash in [0, 2**31), vectorised over tensor keys, equal on CPU
    and CUDA. Augmentation draws its randomness from hash(seed, epoch, index, salt), so a sample
    is augmented the same way whichever rank (or how many ranks) load it."""
    h = 0
    for k in keys:
        h = ((h ^ (k & 0x7FFFFFFF)) * 0x5BD1E995 + 0x9E3779B9) & 0x7FFFFFFF
        h = h ^ (h >> 15)
    return h


class TensorImages:
    """Images as uint8 NCHW plus int64 labels, normalised (and resized) per batch on fetch, or
    once for all (`prepare`; with a border, for augmentation)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, num_classes: int, mean, std,
                 image_size: int):
        assert images.dtype == torch.uint8 and images.ndim == 4
        self.images, self.labels, self.num_classes = images, labels, num_classes
        self.mean = torch.tensor(mean).view(1, -1, 1, 1)
        self.std = torch.tensor(std).view(1, -1, 1, 1)
        self.image_size = image_size
        self.prepared = False
        self.pad = 0  # prepared with a border of this many black pixels: batches are crops
        self.dtype = torch.float32  # of the batches fetch returns

    def __len__(self) -> int:
        return len(self.labels)

    def to(self, device) -> "TensorImages":
        self.images, self.labels = self.images.to(device), self.labels.to(device)
        self.mean, self.std = self.mean.to(device), self.std.to(device)
        return self

    def to_channels_last(self) -> None:
        self.images = self.images.contiguous(memory_format=torch.channels_last)

    def sample_bytes(self) -> int:
        """Bytes of one fetched sample: as stored once prepared (cropped if padded), else
        normalised fp32."""
        return self.images.shape[1] * self.image_size**2 * self.dtype.itemsize

    def _stored_dtype(self, dtype: torch.dtype, pad: int) -> torch.dtype:
        # A padded set smaller than the model's input is kept in fp32 and resized per crop (then
        # cast): resizing rounded values would not be bitwise the per-batch path.
        return dtype if not pad or self.images.shape[-1] == self.image_size else torch.float32

    def prepared_bytes(self, dtype: torch.dtype, pad: int = 0) -> int:
        side = self.image_size if not pad else self.images.shape[-1] + 2 * pad
        return len(self) * self.images.shape[1] * side**2 * self._stored_dtype(dtype, pad).itemsize

    def prepare(self, dtype: torch.dtype, memory_format=torch.contiguous_format, pad: int = 0,
                chunk: int = 1024) -> None:
        """Normalise (and resize) every image once, kept in `dtype`: a batch is then a single
        indexing op instead of five or more, which matters where the host bounds the step (a small
        model). In the compute dtype under autocast these are bitwise the values the per-batch path
        hands the first convolution (which casts them to that dtype; every model here starts with
        one). `memory_format`: the layout batches should come in (no second full-size copy later).

        `pad` > 0, for augmentation (`fetch` with draws): each image is kept at its stored size
        inside a border of `pad` black pixels, normalised like the rest, so a random crop and flip
        of a batch is one gather of normalised values (and a resize where the model's input is
        larger). Black is 0 before normalising, as torchvision's RandomCrop(padding=4) pads it."""
        if self.prepared:
            raise RuntimeError("TensorImages.prepare: already prepared (it would normalise twice)")
        n, c, h, w = self.images.shape
        size = (h + 2 * pad, w + 2 * pad) if pad else (self.image_size, self.image_size)
        out = torch.empty(n, c, *size, dtype=self._stored_dtype(dtype, pad),
                          device=self.images.device, memory_format=memory_format)
        for i in range(0, n, chunk):  # bounded fp32 temporaries
            x = self.images[i:i + chunk]
            out[i:i + chunk] = (self._normalize(F.pad(x, (pad,) * 4), resize=False) if pad
                                else self._normalize(x))
        self.images, self.prepared, self.pad, self.dtype = out, True, pad, dtype

    def _normalize(self, x: torch.Tensor, resize: bool = True) -> torch.Tensor:
        x = (x.float().div_(255) - self.mean) / self.std
        return self._resize(x) if resize else x

    def _resize(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] == self.image_size:
            return x
        return F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear",
                             align_corners=False)

    def fetch(self, idx: torch.Tensor, draws: torch.Tensor | None = None):
        """The samples `idx` (and their labels); `draws` (from `crop_flip_draws`, on idx's device):
        augmented, which needs a set prepared with a border."""
        if (draws is not None) != bool(self.pad):
            raise RuntimeError("TensorImages.fetch: augmentation (draws) needs a set prepared "
                               "with pad > 0, and such a set yields crops only")
        if draws is not None:
            x = self._resize(crop_flip(self.images, idx, draws, self.pad)).to(self.dtype)
            return x, self.labels[idx]
        if self.prepared:
            return self.images[idx], self.labels[idx]
        return self._normalize(self.images[idx]), self.labels[idx]


class SyntheticImages:
    """Random images made on the device: a pool of `pool_size` distinct images, sample i is pool
    image i % pool_size with label hash(i) % num_classes. Any length, any resolution, no I/O: the
    benchmark source.

    The pool is drawn in `dtype`, the loop's compute dtype under autocast: random images have no
    truer fp32 values, the first convolution would cast them to that dtype anyway, and a batch
    then costs half the bytes to index and no cast. Labels are computed once, so a batch is
    three indexing ops: a small model's step is bounded by how fast the host issues ops."""

    def __init__(self, length: int, image_size: int, num_classes: int, pool_size: int, seed: int,
                 device, dtype: torch.dtype = torch.float32):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.pool = torch.randn(pool_size, 3, image_size, image_size, generator=gen,
                                device=device).to(dtype)
        self.labels = sample_hash(torch.arange(length, device=device), seed) % num_classes
        self.length, self.num_classes, self.seed = length, num_classes, seed

    def __len__(self) -> int:
        return self.length

    def to_channels_last(self) -> None:
        self.pool = self.pool.contiguous(memory_format=torch.channels_last)

    def sample_bytes(self) -> int:
        return self.pool[0].numel() * self.pool.element_size()

    def fetch(self, idx: torch.Tensor, draws: torch.Tensor | None = None):
        return self.pool[idx % len(self.pool)], self.labels[idx]


def crop_flip_draws(idx: torch.Tensor, keys: tuple, pad: int = AUGMENT_PAD) -> torch.Tensor:
    """[3, n] int64 on idx's device: each sample's crop offsets (rows, columns; 0..2*pad) and flip
    (0/1), hashed from (keys..., sample index): the same on any device, whatever batch or rank the
    sample comes in. The three draws (salts 1, 2, 3) are hashed together, broadcast to [3, n]."""
    draws = sample_hash(*keys, idx, torch.arange(1, 4, device=idx.device)[:, None])
    return torch.stack([draws[0] % (2 * pad + 1), draws[1] % (2 * pad + 1), draws[2] & 1])


def crop_flip(padded: torch.Tensor, idx: torch.Tensor, draws: torch.Tensor,
              pad: int) -> torch.Tensor:
    """CIFAR-style augmentation as one gather: sample idx[i] of `padded` (images with a `pad`-pixel
    border), cropped at offsets draws[:2, i] to the unpadded size and mirrored if draws[2, i]."""
    h, w = padded.shape[-2] - 2 * pad, padded.shape[-1] - 2 * pad
    dy, dx, flip = draws
    rows = dy[:, None] + torch.arange(h, device=padded.device)  # [b, h]
    cols = dx[:, None] + torch.arange(w, device=padded.device)  # [b, w]
    cols = torch.where(flip.bool()[:, None], cols.flip(1), cols)
    out = padded[idx[:, None, None], :, rows[:, :, None], cols[:, None, :]]
    return out.permute(0, 3, 1, 2)  # [b,h,w,c] -> NCHW view, channels_last in memory


# ---- data sets -------------------------------------------------------------------------------

def load_digits(image_size: int) -> tuple[TensorImages, TensorImages]:
    """scikit-learn's bundled handwritten digits (1,797 8x8 images): 32 px, 3 channels, fixed
    stratified 80/20 split. Real data with nothing to download."""
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    digits = sk_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # [N,1,8,8]
    images = F.interpolate(images, size=(32, 32), mode="bilinear", align_corners=False)
    images = (images.clamp(0, 1) * 255).round().to(torch.uint8).expand(-1, 3, -1, -1).contiguous()
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, val_idx = train_test_split(range(len(labels)), test_size=0.2, random_state=0,
                                          stratify=digits.target)
    train_idx, val_idx = torch.tensor(train_idx), torch.tensor(val_idx)
    mean = (images[train_idx].float() / 255).mean().item()
    std = (images[train_idx].float() / 255).std().item()
    make = lambda i: TensorImages(images[i], labels[i], 10, (mean,) * 3, (std,) * 3, image_size)
    return make(train_idx), make(val_idx)


def load_cifar10(root: str, download: bool, image_size: int) -> tuple[TensorImages, TensorImages]:
    from torchvision.datasets import CIFAR10

    if not download and not os.path.isdir(os.path.join(root, "cifar-10-batches-py")):
        raise ConfigError(f"data=cifar10: no CIFAR-10 under data.root={os.path.abspath(root)!r} "
                          "(expected cifar-10-batches-py/ there); set data.download=true to fetch it")
    try:
        splits = [CIFAR10(root, train=train, download=download) for train in (True, False)]
    except RuntimeError as e:  # torchvision: "Dataset not found or corrupted"
        raise ConfigError(f"data=cifar10 at {os.path.abspath(root)!r}: {e}") from None
    return tuple(TensorImages(torch.from_numpy(s.data).permute(0, 3, 1, 2).contiguous(),
                              torch.tensor(s.targets), 10, CIFAR_MEAN, CIFAR_STD, image_size)
                 for s in splits)


class SeededImageFolder(Dataset):
    """torchvision ImageFolder whose random transforms are seeded per (seed, epoch, index)."""

    def __init__(self, root: str, image_size: int, train: bool, augment: bool, seed: int):
        from torchvision import datasets, transforms as T

        if train and augment:
            tf = [T.RandomResizedCrop(image_size), T.RandomHorizontalFlip()]
        else:
            tf = [T.Resize(round(image_size * 256 / 224)), T.CenterCrop(image_size)]
        tf += [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
        self.folder = datasets.ImageFolder(root, transform=T.Compose(tf))
        self.num_classes = len(self.folder.classes)
        self.seed, self.epoch = seed, 0

    def __len__(self) -> int:
        return len(self.folder)

    def __getitem__(self, i: int):
        torch.manual_seed(sample_hash(self.seed, self.epoch, i))
        return self.folder[i]


def load_imagefolder(root: str, image_size: int, augment: bool, seed: int):
    splits = []
    for split in ("train", "val"):
        path = os.path.join(root, split)
        if not os.path.isdir(path):
            raise ConfigError(f"data=imagefolder: missing {os.path.abspath(path)!r} "
                              "(expected data.root/train/<class>/*.jpg and data.root/val/<class>/*.jpg)")
        if not os.access(path, os.R_OK | os.X_OK):
            raise ConfigError(f"data=imagefolder: {os.path.abspath(path)!r} is not readable")
        try:
            splits.append(SeededImageFolder(path, image_size, split == "train", augment, seed))
        except (FileNotFoundError, OSError) as e:  # e.g. "Found no valid file for the classes"
            raise ConfigError(f"data=imagefolder at {os.path.abspath(path)!r}: {e}") from None
    return tuple(splits)


# ---- per-rank batch streams ------------------------------------------------------------------

class BatchStream:
    """One rank's batches of a data set, epoch by epoch; `epoch(e, start_batch)` resumes mid-epoch."""

    def __init__(self, dataset, indices_for_epoch, batch_size: int, device, drop_last: bool):
        self.dataset, self.indices_for_epoch = dataset, indices_for_epoch
        self.last_epoch: int | None = None  # the last the run reads (the trainer sets it)
        self.batch_size, self.device, self.drop_last = batch_size, device, drop_last

    def num_batches(self, epoch: int = 0) -> int:
        return self._batches_of(len(self.indices_for_epoch(epoch)))

    def _batches_of(self, n: int) -> int:
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)


class DeviceBatches(BatchStream):
    """Batches of an in-memory data set, made by indexing: no copies, no worker processes.

    `epochs_ahead`: an epoch that fits in FETCH_MAX_BYTES several times over is fetched together
    with the epochs after it, up to `last_epoch` (the last the run reads, set by the trainer), and
    those wait here for their turn. Each epoch's start costs a dozen
    host calls (the permutation, the draws, the index copy, the fetch), and a small model's step
    is bounded by how fast the host issues them: on digits at batch 512 an epoch is 2 steps, so
    without this that work came every other step and showed in the throughput."""

    def __init__(self, *args, augment_seed: int | None = None, epochs_ahead: bool = False):
        super().__init__(*args)
        self.augment_seed, self.epochs_ahead = augment_seed, epochs_ahead
        self._ahead: dict[int, list] = {}  # epoch -> its batches, fetched with an earlier one

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if epoch not in self._ahead:
            self._ahead.clear()  # a jump (a resume, a calibration pass): what waits is stale
            epochs = range(epoch, epoch + self._epochs_per_fetch(epoch))
            if len(epochs) > 1:
                self._ahead = dict(zip(epochs, self._fetch_epochs(epochs)))
        if epoch in self._ahead:
            yield from map(self._placed, self._ahead.pop(epoch)[start_batch:])
            return
        idx, draws = self._to_device(self._samples(epoch, start_batch))
        # Fetch many batches at once (in batch order, chunked) and cut them as views, in one call:
        # a small model's step is bounded by how fast the host issues ops, and a batch fetched
        # alone takes several of them (more augmented). Samples are fetched alike whatever the batch they
        # come in (augmentation is per sample), so the batches are the same.
        batch_bytes = self.batch_size * self.dataset.sample_bytes()
        window = max(1, FETCH_MAX_BYTES // batch_bytes) * self.batch_size  # samples per fetch
        for w in range(0, len(idx), window):
            part = slice(w, w + window)
            yield from map(self._placed, self._batches(idx[part],
                                                       None if draws is None else draws[:, part]))

    @functools.cached_property
    def _epoch_bytes(self) -> int:  # every epoch's: counted once (each count draws a permutation)
        return self.num_batches() * self.batch_size * self.dataset.sample_bytes()

    def _epochs_per_fetch(self, epoch: int) -> int:
        if not self.epochs_ahead or self._epoch_bytes == 0:
            return 1
        ahead = FETCH_MAX_BYTES // self._epoch_bytes
        if self.last_epoch is not None:  # (a short run: fetching past its end is wasted work)
            ahead = min(ahead, self.last_epoch + 1 - epoch)
        return max(1, ahead)

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

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.dataset.epoch = epoch  # read by the workers, which start after this
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


@dataclass
class Data:
    train: BatchStream
    val: BatchStream
    num_classes: int
    train_samples: int
    val_samples: int


def load_sets(cfg, device, compute_dtype: torch.dtype):
    """The (train, val) data sets named by `cfg.data`."""
    d = cfg.data
    if d.name == "digits":
        return load_digits(d.image_size)
    if d.name == "cifar10":
        return load_cifar10(d.root, d.download, d.image_size)
    if d.name == "synthetic":
        return (SyntheticImages(d.num_samples, d.image_size, d.num_classes, d.pool_size,
                                cfg.seed, device, compute_dtype),
                SyntheticImages(d.val_samples, d.image_size, d.num_classes, d.pool_size,
                                cfg.seed + 1, device, compute_dtype))
    return load_imagefolder(d.root, d.image_size, d.augment, cfg.seed)


def prepare_in_memory(ds, cfg, device, compute_dtype: torch.dtype, augmented: bool) -> None:
    """An in-memory set made ready for indexing: on the device (data.on_device), normalised once
    where that fits in PREPARE_MAX_BYTES (with a border if `augmented`), in the batches' layout."""
    d = cfg.data
    layout = torch.channels_last if cfg.train.channels_last else torch.contiguous_format
    if isinstance(ds, TensorImages) and d.on_device:
        ds.to(device)
    if isinstance(ds, TensorImages):
        pad = AUGMENT_PAD if augmented else 0
        size = ds.prepared_bytes(compute_dtype, pad)
        if size <= PREPARE_MAX_BYTES:
            ds.prepare(compute_dtype, layout, pad)
        elif augmented:  # digits and CIFAR-10 fit: only a new, larger set could get here
            raise ConfigError(f"data={d.name} with data.augment=true: {len(ds)} images "
                              f"would take {size / 1e9:.1f} GB prepared for augmentation "
                              f"(at most {PREPARE_MAX_BYTES / 1e9:.1f}); set "
                              "data.augment=false")
        else:
            log.info("data=%s: %d images at %d px would take %.1f GB normalised; "
                     "normalising per batch instead", d.name, len(ds), d.image_size,
                     size / 1e9)
    if cfg.train.channels_last:
        # Indexing keeps the layout, so batches come out channels_last with no extra copy.
        ds.to_channels_last()


def build_data(cfg, rank: int, world_size: int, device) -> Data:
    """The data set named by `cfg.data`, split into this rank's train and val batch streams."""
    d = cfg.data
    compute_dtype = AUTOCAST_DTYPES[cfg.precision.autocast_dtype] or torch.float32
    train_set, val_set = load_sets(cfg, device, compute_dtype)

    per_step = world_size * cfg.train.batch_size * cfg.train.accum_steps
    if len(train_set) < per_step:
        raise ConfigError(
            f"data={d.name} has {len(train_set)} training samples, fewer than one step needs: "
            f"world size {world_size} x train.batch_size {cfg.train.batch_size} x "
            f"train.accum_steps {cfg.train.accum_steps} = {per_step}. Use a smaller batch or fewer ranks.")

    train_indices = lambda epoch: shard_indices(len(train_set), rank, world_size, cfg.seed, epoch)

    # Validation: a plain round-robin shard with no padding, so (sum, count) is exact.
    val_shard = list(range(rank, len(val_set), world_size))
    val_indices = lambda epoch: val_shard

    # Training drops the last partial batch (every step has the same global batch); evaluation
    # sees every sample once.
    if d.name == "imagefolder":
        make = lambda ds, idx, drop: LoaderBatches(ds, idx, cfg.train.batch_size, device, drop,
                                                   num_workers=d.num_workers)
        train, val = make(train_set, train_indices, True), make(val_set, val_indices, False)
    else:
        augment_seed = cfg.seed if d.augment and d.name != "synthetic" else None
        prepare_in_memory(train_set, cfg, device, compute_dtype, augment_seed is not None)
        prepare_in_memory(val_set, cfg, device, compute_dtype, False)
        train = DeviceBatches(train_set, train_indices, cfg.train.batch_size, device, True,
                              augment_seed=augment_seed, epochs_ahead=True)
        val = DeviceBatches(val_set, val_indices, cfg.train.batch_size, device, False)
    return Data(train, val, train_set.num_classes, len(train_set), len(val_set))
