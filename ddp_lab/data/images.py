"""The in-memory image sets and how a batch is fetched from them: by indexing, on the device.

`TensorImages` (digits, CIFAR-10) holds uint8 images and normalises them once in the compute dtype
where that fits (`prepare`; ddp_lab/data/build.py decides), else per batch. A set to augment is
normalised once with a border of black around each image, so a random crop and flip is one
gather (`crop_flip`). `SyntheticImages` is a pool of random images made on the device in the
compute dtype. Randomness is hashed from (seed, epoch, sample index) (`sample_hash`), so a sample
is the same whichever rank loads it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

AUGMENT_PAD = 4  # CIFAR-style augmentation: a random 32 px crop of the image padded by 4, a flip


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
