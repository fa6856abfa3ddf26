"""The data group: `data.*`'s keys and their checks, and DATASETS, the names `data=` chooses from.

Each data set registers its loader beside its code (ddp_lab/data/sets.py) with the keys of the
group it reads: `@DATASETS.register("cifar10", reads=("root", ...))`; the loader takes
(cfg, device, compute dtype) and returns (train set, val set).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import II, MISSING

from ddp_lab.errors import ConfigError
from ddp_lab.keys import is_set, key
from ddp_lab.registry import Registry

DATASETS = Registry("data set", "data")


@dataclass
class DataConfig:
    name: str = key(MISSING, choices=DATASETS)  # digits | synthetic | cifar10 | imagefolder
    # A data set's own parameters (root, download, num_workers; num_samples, val_samples,
    # pool_size) are ignored by the others, like a path: a benchmark switching data sets
    # (bench.train_throughput's ddp_overrides) keeps them. augment, on_device and num_classes are
    # refused where they would be ignored.
    root: str = ""  # cifar10 / imagefolder: where the data lives (needed by every set reading it)
    download: bool = False  # cifar10: fetch into root if it is missing
    # another size must be one the model takes
    image_size: int = key(II("model.image_size"), positive=True)
    # synthetic only; others know their own
    num_classes: int = key(II("model.default_classes"), positive=True)
    num_samples: int = key(50_000, positive=True)  # synthetic: length of the (virtual) training set
    val_samples: int = key(1_024, positive=True)  # synthetic: length of the validation set
    # synthetic: distinct random images kept on the device (at most num_samples of them are read)
    pool_size: int = key(256, positive=True)
    # random crop + flip, seeded per sample and epoch; not for synthetic
    augment: bool = key(False, read_by=DATASETS)
    # digits / cifar10: keep the set on the training device (synthetic is always made there,
    # imagefolder is decoded on the host; on CPU both places are one)
    on_device: bool = key(True, read_by=DATASETS)
    num_workers: int = key(4, at_least=0)  # imagefolder: decoding processes per rank


def check_data(cfg) -> None:
    """Labels of its own or data.num_classes (>= 2), and a root for the sets that read one."""
    d = cfg.data
    reads = DATASETS.details(d.name).get("reads", ())
    if "num_classes" in reads and d.num_classes < 2:
        source = "data.num_classes" if is_set(cfg, "data.num_classes") else "model.default_classes"
        raise ConfigError(f"{source}={d.num_classes}: a classifier needs at least 2 classes")
    if "num_classes" not in reads and is_set(cfg, "data.num_classes"):
        readers = "|".join(DATASETS.readers("num_classes"))
        raise ConfigError(f"data.num_classes={d.num_classes} has no effect with data={d.name}, "
                          f"which has labels of its own, only with data={readers}; leave it out")
    if "root" in reads and not d.root:
        raise ConfigError(f"data={d.name} needs data.root=<directory>")
