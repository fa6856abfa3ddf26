"""Data determinism: sample i is the same whichever rank loads it, and the ranks' batches of a step
together are the single-process batch of that step."""

import pytest
import torch

from ddp_lab.config import ConfigError
from ddp_lab.data import build_data, load_digits, random_crop_flip
from helpers import compose_config


def step_samples(stream, epoch, step):
    for k, (x, y) in enumerate(stream.epoch(epoch)):
        if k == step:
            return x, y


def as_rows(x, y):
    return sorted(zip(map(tuple, x.flatten(1).tolist()), y.tolist()))


@pytest.mark.parametrize("data", ["digits", "synthetic"])
def test_two_ranks_see_the_samples_of_one_rank_at_twice_the_batch(data):
    over = [f"data={data}", "data.num_samples=300", "data.augment=true"]
    one = build_data(compose_config(over + ["train.batch_size=32"]), 0, 1, torch.device("cpu"))
    two = [build_data(compose_config(over + ["train.batch_size=16"]), r, 2, torch.device("cpu"))
           for r in range(2)]
    for epoch, step in [(0, 0), (0, 3), (2, 5)]:
        x1, y1 = step_samples(one.train, epoch, step)
        parts = [step_samples(d.train, epoch, step) for d in two]
        x2, y2 = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        assert as_rows(x1, y1) == as_rows(x2, y2)


def test_epochs_reshuffle_and_seed_changes_order():
    d = build_data(compose_config(["train.batch_size=32"]), 0, 1, torch.device("cpu"))
    d_seed = build_data(compose_config(["train.batch_size=32", "seed=1"]), 0, 1, torch.device("cpu"))
    a, b, c = (step_samples(s, e, 0)[1] for s, e in [(d.train, 0), (d.train, 1), (d_seed.train, 0)])
    assert not torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a, step_samples(d.train, 0, 0)[1])  # and is reproducible


def test_resume_mid_epoch_yields_the_remaining_batches():
    d = build_data(compose_config(["train.batch_size=32"]), 0, 1, torch.device("cpu"))
    full = list(d.train.epoch(1))
    tail = list(d.train.epoch(1, start_batch=4))
    assert len(tail) == len(full) - 4
    assert all(torch.equal(a[0], b[0]) for a, b in zip(full[4:], tail))


def test_augmentation_is_a_function_of_sample_seed_and_epoch():
    train, _ = load_digits(32)
    idx = torch.arange(8)
    a = random_crop_flip(train.images[idx], idx, (0, 0))
    assert torch.equal(a, random_crop_flip(train.images[idx], idx, (0, 0)))
    # sample 3 alone is augmented exactly as within the batch
    assert torch.equal(a[3:4], random_crop_flip(train.images[idx[3:4]], idx[3:4], (0, 0)))
    assert not torch.equal(a, random_crop_flip(train.images[idx], idx, (0, 1)))  # new epoch


def test_digits_split_is_fixed_and_sized():
    d = build_data(compose_config(), 0, 1, torch.device("cpu"))
    assert (d.train_samples, d.val_samples, d.num_classes) == (1437, 360, 10)
    x, y = next(d.train.epoch(0))
    assert x.shape == (64, 3, 32, 32) and x.dtype == torch.float32


def test_validation_covers_every_sample_once_across_ranks():
    seen = []
    for r in range(3):
        d = build_data(compose_config(["train.batch_size=50"]), r, 3, torch.device("cpu"))
        seen += [y for _, y in d.val.epoch(0)]
    assert sum(len(y) for y in seen) == 360


def test_data_too_small_for_world_size_is_rejected():
    cfg = compose_config(["data=synthetic", "data.num_samples=100", "train.batch_size=64"])
    with pytest.raises(ConfigError, match="fewer than one step needs"):
        build_data(cfg, 0, 2, torch.device("cpu"))


def test_missing_cifar_root_names_the_path(tmp_path):
    cfg = compose_config(["data=cifar10", f"data.root={tmp_path}/nothing"])
    with pytest.raises(ConfigError, match="nothing"):
        build_data(cfg, 0, 1, torch.device("cpu"))


def test_missing_imagefolder_root_names_the_path(tmp_path):
    cfg = compose_config(["data=imagefolder", f"data.root={tmp_path}"])
    with pytest.raises(ConfigError, match="train"):
        build_data(cfg, 0, 1, torch.device("cpu"))


def test_imagefolder_reads_class_folders(tmp_path):
    from PIL import Image
    for split in ("train", "val"):
        for cls in ("cat", "dog"):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (40, 30), (i * 40, 0, 0)).save(tmp_path / split / cls / f"{i}.png")
    cfg = compose_config(["data=imagefolder", f"data.root={tmp_path}", "data.num_workers=0",
                          "train.batch_size=4", "model.image_size=32"])
    d = build_data(cfg, 0, 1, torch.device("cpu"))
    assert d.num_classes == 2
    x, y = next(d.train.epoch(0))
    assert x.shape == (4, 3, 32, 32)
    assert torch.equal(x, next(d.train.epoch(0))[0])  # seeded augmentation: same per epoch


@pytest.mark.parametrize("precision,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                             ("fp16", torch.float16)])
def test_synthetic_images_come_in_the_compute_dtype_with_hashed_labels(precision, dtype):
    from ddp_lab.data import sample_hash

    cfg = compose_config(["data=synthetic", "data.num_samples=300", f"precision={precision}",
                          "train.batch_size=16"])
    d = build_data(cfg, 0, 1, torch.device("cpu"))
    ref = build_data(compose_config(["data=synthetic", "data.num_samples=300",
                                     "train.batch_size=16"]), 0, 1, torch.device("cpu"))
    (x, y), (x32, y32) = next(d.train.epoch(0)), next(ref.train.epoch(0))
    assert x.dtype == dtype and x32.dtype == torch.float32
    # the same images, drawn in fp32 and rounded once, as autocast would round them
    assert torch.equal(x, x32.to(dtype))
    idx = torch.as_tensor(list(ref.train.indices_for_epoch(0))[:16])
    assert torch.equal(y, y32) and torch.equal(y, sample_hash(idx, cfg.seed) % d.num_classes)


@pytest.mark.parametrize("image_size", [32, 8, 21])  # digits are stored at 32 px: as is, down, odd
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepared_images_are_bitwise_the_per_batch_normalised_ones(image_size, dtype):
    per_batch, _ = load_digits(image_size)
    prepared, _ = load_digits(image_size)
    prepared.prepare(dtype, torch.channels_last, chunk=100)  # chunks that do not divide the set
    assert prepared.images.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(RuntimeError, match="already prepared"):
        prepared.prepare(dtype)
    idx = torch.tensor([0, 5, 99, 100, 1436, 7])
    (x, y), (xp, yp) = per_batch.fetch(idx), prepared.fetch(idx)
    assert xp.dtype == dtype and xp.shape == x.shape == (6, 3, image_size, image_size)
    # what autocast would hand the first convolution: the fp32 batch rounded once to `dtype`
    assert torch.equal(xp, x.to(dtype)) and torch.equal(yp, y)


@pytest.mark.parametrize("augment", [False, True])
def test_digits_are_prepared_in_the_compute_dtype_unless_augmented(augment):
    cfg = compose_config([f"data.augment={str(augment).lower()}", "precision=bf16",
                          "train.batch_size=16"])
    d = build_data(cfg, 0, 1, torch.device("cpu"))
    assert d.train.dataset.prepared is not augment and d.val.dataset.prepared
    assert next(d.train.epoch(0))[0].dtype == (torch.float32 if augment else torch.bfloat16)
    assert next(d.val.epoch(0))[0].dtype == torch.bfloat16


def test_sets_too_large_to_prepare_are_normalised_per_batch(monkeypatch):
    import ddp_lab.data

    ref = build_data(compose_config(["train.batch_size=16"]), 0, 1, torch.device("cpu"))
    monkeypatch.setattr(ddp_lab.data, "PREPARE_MAX_BYTES", 1437 * 3 * 32 * 32 * 4 - 1)
    d = build_data(compose_config(["train.batch_size=16"]), 0, 1, torch.device("cpu"))
    assert ref.train.dataset.prepared and ref.val.dataset.prepared
    assert not d.train.dataset.prepared and d.val.dataset.prepared  # val: 360 images, fits
    assert torch.equal(next(d.train.epoch(1))[0], next(ref.train.epoch(1))[0])


@pytest.mark.parametrize("data, dtype", [("digits", torch.bfloat16),
                                         ("digits data.augment=true", torch.float32),
                                         ("digits data.augment=true train.channels_last=true",
                                          torch.float32),
                                         ("synthetic", torch.bfloat16)])
@pytest.mark.parametrize("start_batch", [0, 3])
def test_an_epoch_fetched_at_once_yields_the_per_batch_fetches(monkeypatch, data, dtype,
                                                               start_batch):
    """Batches cut as views of one fetch of the epoch (in chunks) equal per-batch fetches, bit
    for bit (augmented too), for training (last partial batch dropped), mid-epoch resume, and
    validation (kept)."""
    import ddp_lab.data as data_mod

    monkeypatch.setattr(data_mod, "GATHER_CHUNK", 100)
    cfg = compose_config([f"data={data.split()[0]}", *data.split()[1:], "data.num_samples=300",
                          "data.val_samples=70", "train.batch_size=32", "precision=bf16"])
    d = build_data(cfg, 0, 1, torch.device("cpu"))
    runs = {}
    for limit in (data_mod.EPOCH_GATHER_MAX_BYTES, 0):
        monkeypatch.setattr(data_mod, "EPOCH_GATHER_MAX_BYTES", limit)
        runs[limit] = [list(d.train.epoch(1, start_batch)), list(d.val.epoch(0))]
    whole, per_batch = runs.values()
    assert [len(r) for r in whole] == [len(r) for r in per_batch]
    assert len(whole[0]) == d.train.num_batches() - start_batch and len(whole[1][-1][1]) < 32
    for (xa, ya), (xb, yb) in zip(whole[0] + whole[1], per_batch[0] + per_batch[1]):
        assert xa._base is not None  # a view of the epoch's fetch
        assert xa.dtype == xb.dtype and torch.equal(xa, xb) and torch.equal(ya, yb)
        assert xa.stride() == xb.stride()  # the same layout (channels_last or not)
    assert whole[0][0][0].dtype == dtype


def test_a_rank_with_an_empty_validation_shard_yields_no_batches():
    """2 ranks, 1 validation sample: rank 1's shard is empty, its stream just ends."""
    cfg = compose_config(["data=synthetic", "data.num_samples=300", "data.val_samples=1",
                          "train.batch_size=32"])
    assert list(build_data(cfg, 1, 2, torch.device("cpu")).val.epoch(0)) == []
    assert len(list(build_data(cfg, 0, 2, torch.device("cpu")).val.epoch(0))) == 1
