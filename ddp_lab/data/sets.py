"""The data sets `data=` names, each a loader registered in DATASETS (ddp_lab/data/config.py)
beside its code, with the data.* keys it reads. A loader takes (cfg, device, compute dtype) and
returns the (train, val) sets: in-memory `TensorImages` / `SyntheticImages`, or a torch Dataset
that DataLoader workers decode (imagefolder)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from ddp_lab.data.config import DATASETS
from ddp_lab.data.images import SyntheticImages, TensorImages, sample_hash
from ddp_lab.errors import ConfigError

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@DATASETS.register("digits", reads=("augment", "on_device"))
def load_digits(cfg, device, compute_dtype) -> tuple[TensorImages, TensorImages]:
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
    size = cfg.data.image_size
    make = lambda i: TensorImages(images[i], labels[i], 10, (mean,) * 3, (std,) * 3, size)
    return make(train_idx), make(val_idx)


@DATASETS.register("synthetic", reads=("num_classes", "num_samples", "val_samples", "pool_size"))
def make_synthetic(cfg, device, compute_dtype) -> tuple[SyntheticImages, SyntheticImages]:
    """Random images made on the device in the compute dtype; validation from the next seed."""
    d = cfg.data
    make = lambda length, seed: SyntheticImages(length, d.image_size, d.num_classes, d.pool_size,
                                                seed, device, compute_dtype)
    return make(d.num_samples, cfg.seed), make(d.val_samples, cfg.seed + 1)


@DATASETS.register("cifar10", reads=("root", "download", "augment", "on_device"))
def load_cifar10(cfg, device, compute_dtype) -> tuple[TensorImages, TensorImages]:
    from torchvision.datasets import CIFAR10

    root, download = cfg.data.root, cfg.data.download
    if not download and not os.path.isdir(os.path.join(root, "cifar-10-batches-py")):
        raise ConfigError(f"data=cifar10: no CIFAR-10 under data.root={os.path.abspath(root)!r} "
                          "(expected cifar-10-batches-py/ there); set data.download=true to fetch it")
    try:
        splits = [CIFAR10(root, train=train, download=download) for train in (True, False)]
    except RuntimeError as e:  # torchvision: "Dataset not found or corrupted"
        raise ConfigError(f"data=cifar10 at {os.path.abspath(root)!r}: {e}") from None
    return tuple(TensorImages(torch.from_numpy(s.data).permute(0, 3, 1, 2).contiguous(),
                              torch.tensor(s.targets), 10, CIFAR_MEAN, CIFAR_STD,
                              cfg.data.image_size)
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


# on_device: decoded on the host, where data.on_device=false leaves it too, so either is true
@DATASETS.register("imagefolder", reads=("root", "augment", "on_device", "num_workers"))
def load_imagefolder(cfg, device, compute_dtype):
    d, splits = cfg.data, []
    for split in ("train", "val"):
        path = os.path.join(d.root, split)
        if not os.path.isdir(path):
            raise ConfigError(f"data=imagefolder: missing {os.path.abspath(path)!r} "
                              "(expected data.root/train/<class>/*.jpg and data.root/val/<class>/*.jpg)")
        if not os.access(path, os.R_OK | os.X_OK):
            raise ConfigError(f"data=imagefolder: {os.path.abspath(path)!r} is not readable")
        try:
            splits.append(SeededImageFolder(path, d.image_size, split == "train", d.augment,
                                            cfg.seed))
        except (FileNotFoundError, OSError) as e:  # e.g. "Found no valid file for the classes"
            raise ConfigError(f"data=imagefolder at {os.path.abspath(path)!r}: {e}") from None
    return tuple(splits)
