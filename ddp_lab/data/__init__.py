"""Data sets and the per-rank batch streams the training loop reads.

Every data set is indexed: sample i is a pure function of (i, seed, epoch), whichever rank loads
it, and the ranks' batches together are a single process's (streams.py: why a 2-rank run can be
checked against a 1-rank run). In-memory sets (digits, synthetic, CIFAR-10) live on the training
device and are batched by indexing, so the loader never starves a GPU; ImageFolder goes through a
DataLoader with worker processes. In reading order:

    config.py   data.*'s keys, DATASETS (the names data= chooses from) and their checks
    sets.py     the data sets, each a loader registered in DATASETS
    images.py   the in-memory sets: normalised once, augmented by one gather
    streams.py  a rank's batches, epoch by epoch: which samples, fetched many at once
    build.py    `build_data`: the named set, made ready and dealt into train and val streams
"""

from ddp_lab.data.config import DATASETS, DataConfig
from ddp_lab.data.images import SyntheticImages, TensorImages, crop_flip_draws, sample_hash
from ddp_lab.data.sets import CIFAR_MEAN, CIFAR_STD, load_digits
from ddp_lab.data.streams import DeviceBatches, LoaderBatches, shard_indices
from ddp_lab.data.build import Data, build_data

__all__ = ["CIFAR_MEAN", "CIFAR_STD", "DATASETS", "Data", "DataConfig", "DeviceBatches",
           "LoaderBatches", "SyntheticImages", "TensorImages", "build_data", "crop_flip_draws",
           "load_digits", "sample_hash", "shard_indices"]
