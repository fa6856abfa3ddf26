"""The data a run reads: the set `data=` names, made ready and dealt into this rank's batch streams
(`build_data`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from ddp_lab.data.config import DATASETS
from ddp_lab.data.images import AUGMENT_PAD, TensorImages
from ddp_lab.data.streams import BatchStream, DeviceBatches, LoaderBatches, shard_indices
from ddp_lab.errors import ConfigError
from ddp_lab.precision import AUTOCAST_DTYPES

# In-memory sets up to this size each (normalised, at the model's resolution) are prepared once:
# digits' training set fits even at 224 px, CIFAR-10's at 32 px; CIFAR-10 upsampled to 224 px
# does not, and is normalised per batch.
PREPARE_MAX_BYTES = 2 * 2**30

log = logging.getLogger(__name__)


@dataclass
class Data:
    train: BatchStream
    val: BatchStream
    num_classes: int
    train_samples: int
    val_samples: int


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


def compute_dtype(cfg) -> torch.dtype:
    """The dtype in-memory sets are stored and batched in: autocast's, else fp32."""
    return AUTOCAST_DTYPES[cfg.precision.autocast_dtype] or torch.float32


def build_data(cfg, rank: int, world_size: int, device) -> Data:
    """The data set named by `cfg.data`, split into this rank's train and val batch streams."""
    d = cfg.data
    dtype = compute_dtype(cfg)
    train_set, val_set = DATASETS[d.name](cfg, device, dtype)

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
    if isinstance(train_set, Dataset):  # files, decoded by DataLoader workers
        make = lambda ds, idx, drop: LoaderBatches(ds, idx, cfg.train.batch_size, device, drop,
                                                   num_workers=d.num_workers)
        train, val = make(train_set, train_indices, True), make(val_set, val_indices, False)
    else:
        augments = d.augment and "augment" in DATASETS.details(d.name)["reads"]
        augment_seed = cfg.seed if augments else None
        prepare_in_memory(train_set, cfg, device, dtype, augment_seed is not None)
        prepare_in_memory(val_set, cfg, device, dtype, False)
        train = DeviceBatches(train_set, train_indices, cfg.train.batch_size, device, True,
                              augment_seed=augment_seed, epochs_ahead=True)
        val = DeviceBatches(val_set, val_indices, cfg.train.batch_size, device, False)
    return Data(train, val, train_set.num_classes, len(train_set), len(val_set))
