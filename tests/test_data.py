"""Data determinism: sample i is the same whichever rank loads it, and the ranks' batches of a step
together are the single-process batch of that step."""

import math

import pytest
import torch

from ddp_lab.data import build_data, crop_flip_draws, load_digits
from ddp_lab.errors import ConfigError
from helpers import compose_config


def digits(image_size: int):
    """The digits' (train, val) sets at `image_size` px, as data=digits loads them."""
    return load_digits(compose_config([f"data.image_size={image_size}"]), "cpu", torch.float32)


def epoch_alone(stream, epoch, start_batch=0):
    """The stream's batches of `epoch`, fetched as by a run that ends with it. Fetching ahead (a
    small epoch with the dozens after it, in one 512 MB fetch: seconds on 2 cores) is
    test_epochs_fetched_ahead_equal_epochs_fetched_alone's subject: the same batches, bitwise."""
    return stream.epoch(epoch, start_batch, last_epoch=epoch)


def step_samples(stream, epoch, step):
    for k, (x, y) in enumerate(epoch_alone(stream, epoch)):
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
    full = list(epoch_alone(d.train, 1))
    tail = list(epoch_alone(d.train, 1, start_batch=4))
    assert len(tail) == len(full) - 4
    assert all(torch.equal(a[0], b[0]) for a, b in zip(full[4:], tail))


def test_augmentation_is_a_function_of_sample_seed_and_epoch():
    train, _ = digits(32)
    train.prepare(torch.float32, pad=4)
    idx = torch.arange(8)
    draws = crop_flip_draws(idx, (0, 0))
    assert draws.shape == (3, 8) and 0 <= draws[:2].min() and draws[:2].max() <= 8
    assert set(draws[2].tolist()) == {0, 1}  # some flipped, some not
    a, _ = train.fetch(idx, draws)
    assert torch.equal(a, train.fetch(idx, crop_flip_draws(idx, (0, 0)))[0])
    # sample 3 alone is augmented exactly as within the batch
    assert torch.equal(a[3:4], train.fetch(idx[3:4], crop_flip_draws(idx[3:4], (0, 0)))[0])
    assert not torch.equal(a, train.fetch(idx, crop_flip_draws(idx, (0, 1)))[0])  # new epoch
    assert not torch.equal(a, train.fetch(idx, crop_flip_draws(idx, (1, 0)))[0])  # new seed
    with pytest.raises(RuntimeError, match="pad > 0"):
        train.fetch(idx)  # a set prepared for augmentation yields crops only


@pytest.mark.parametrize("image_size, dtype", [(32, torch.bfloat16), (32, torch.float32),
                                               (48, torch.bfloat16)])  # 48: resized per crop
def test_augmented_crops_are_bitwise_those_of_the_uint8_images(image_size, dtype):
    """The one-gather crop of the prepared, padded set equals the textbook order, sample by
    sample: pad the uint8 image with black, crop, mirror, normalise in fp32, resize, round once
    to the compute dtype (what autocast hands the first convolution)."""
    plain, _ = digits(image_size)
    prepared, _ = digits(image_size)
    prepared.prepare(dtype, torch.channels_last, pad=4, chunk=100)
    idx = torch.tensor([0, 5, 99, 100, 1436, 7, 7, 300, 1000, 12, 13, 14])
    draws = crop_flip_draws(idx, (3, 2))
    x, y = prepared.fetch(idx, draws)
    assert x.dtype == dtype and x.shape == (12, 3, image_size, image_size)
    assert torch.equal(y, plain.labels[idx])
    for i, (dy, dx, flip) in zip(idx.tolist(), draws.t().tolist()):
        img = torch.nn.functional.pad(plain.images[i], (4, 4, 4, 4))[:, dy:dy + 32, dx:dx + 32]
        img = img.flip(-1) if flip else img
        ref = plain._normalize(img[None]).to(dtype)
        assert torch.equal(x[idx.tolist().index(i)][None], ref), (i, dy, dx, flip)
    assert draws[0].unique().numel() > 2 and draws[2].unique().numel() == 2  # offsets vary


def test_digits_split_is_fixed_and_sized():
    d = build_data(compose_config(), 0, 1, torch.device("cpu"))
    assert (d.train_samples, d.val_samples, d.num_classes) == (1437, 360, 10)
    x, y = next(epoch_alone(d.train, 0))
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
    (x, y), (x32, y32) = next(epoch_alone(d.train, 0)), next(epoch_alone(ref.train, 0))
    assert x.dtype == dtype and x32.dtype == torch.float32
    # the same images, drawn in fp32 and rounded once, as autocast would round them
    assert torch.equal(x, x32.to(dtype))
    idx = torch.as_tensor(list(ref.train.indices_for_epoch(0))[:16])
    assert torch.equal(y, y32) and torch.equal(y, sample_hash(idx, cfg.seed) % d.num_classes)


@pytest.mark.parametrize("image_size", [32, 8, 21])  # digits are stored at 32 px: as is, down, odd
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepared_images_are_bitwise_the_per_batch_normalised_ones(image_size, dtype):
    per_batch, _ = digits(image_size)
    prepared, _ = digits(image_size)
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
def test_digits_are_prepared_in_the_compute_dtype_augmented_or_not(augment):
    cfg = compose_config([f"data.augment={str(augment).lower()}", "precision=bf16",
                          "train.batch_size=16"])
    d = build_data(cfg, 0, 1, torch.device("cpu"))
    assert d.train.dataset.prepared and d.val.dataset.prepared
    assert d.train.dataset.pad == (4 if augment else 0) and d.val.dataset.pad == 0
    assert next(epoch_alone(d.train, 0))[0].shape == (16, 3, 32, 32)
    assert next(epoch_alone(d.train, 0))[0].dtype == next(d.val.epoch(0))[0].dtype == torch.bfloat16


def test_sets_too_large_to_prepare_are_normalised_per_batch(monkeypatch):
    import ddp_lab.data.build

    ref = build_data(compose_config(["train.batch_size=16"]), 0, 1, torch.device("cpu"))
    monkeypatch.setattr(ddp_lab.data.build, "PREPARE_MAX_BYTES", 1437 * 3 * 32 * 32 * 4 - 1)
    d = build_data(compose_config(["train.batch_size=16"]), 0, 1, torch.device("cpu"))
    assert ref.train.dataset.prepared and ref.val.dataset.prepared
    assert not d.train.dataset.prepared and d.val.dataset.prepared  # val: 360 images, fits
    assert torch.equal(next(epoch_alone(d.train, 1))[0], next(epoch_alone(ref.train, 1))[0])
    with pytest.raises(ConfigError, match="data.augment=false"):  # augmentation needs it prepared
        build_data(compose_config(["data.augment=true"]), 0, 1, torch.device("cpu"))


@pytest.mark.parametrize("data, dtype", [
    ("digits", torch.bfloat16),
    ("digits data.augment=true", torch.bfloat16),
    ("digits data.augment=true train.channels_last=true", torch.bfloat16),
    ("synthetic", torch.bfloat16)])
@pytest.mark.parametrize("start_batch", [0, 3])
def test_batches_fetched_many_at_once_equal_per_batch_fetches(monkeypatch, data, dtype,
                                                              start_batch):
    """Batches cut as views of one fetch of the epoch (in chunks), or of fetches of 3 batches at a
    time, equal per-batch fetches bit for bit (augmented too), for training (last partial batch
    dropped), mid-epoch resume, and validation (kept)."""
    import ddp_lab.data.streams as data_mod

    monkeypatch.setattr(data_mod, "GATHER_CHUNK", 100)
    cfg = compose_config([f"data={data.split()[0]}", *data.split()[1:], "data.num_samples=300",
                          "data.val_samples=70", "train.batch_size=32", "precision=bf16"])
    d = build_data(cfg, 0, 1, torch.device("cpu"))
    three_batches = 3 * 32 * d.train.dataset.sample_bytes()
    runs = {}
    for limit in (data_mod.FETCH_MAX_BYTES, three_batches, 0):
        monkeypatch.setattr(data_mod, "FETCH_MAX_BYTES", limit)
        runs[limit] = [list(epoch_alone(d.train, 1, start_batch)), list(d.val.epoch(0))]
    whole, threes, per_batch = runs.values()
    assert [len(r) for r in whole] == [len(r) for r in threes] == [len(r) for r in per_batch]
    assert len(whole[0]) == d.train.num_batches() - start_batch and len(whole[1][-1][1]) < 32
    for run in (whole, threes):
        for (xa, ya), (xb, yb) in zip(run[0] + run[1], per_batch[0] + per_batch[1]):
            assert xa._base is not None  # a view of a fetch of many
            assert xa.dtype == xb.dtype and torch.equal(xa, xb) and torch.equal(ya, yb)
            assert xa.stride() == xb.stride()  # the same layout (channels_last or not)
    bases = lambda batches: len({x._base.data_ptr() for x, _ in batches})
    assert bases(whole[0]) == 1 and bases(threes[0]) == math.ceil(len(threes[0]) / 3)
    assert whole[0][0][0].dtype == dtype
    # and each training batch is the data set's own fetch of that batch's indices (and draws)
    stream = d.train
    idx = torch.as_tensor(stream.indices_for_epoch(1), dtype=torch.int64)
    for b, (x, y) in enumerate(whole[0], start=start_batch):
        i = idx[b * 32:(b + 1) * 32]
        draws = (None if stream.augment_seed is None
                 else crop_flip_draws(i, (stream.augment_seed, 1)))
        xr, yr = stream.dataset.fetch(i, draws)
        assert torch.equal(x, xr) and torch.equal(y, yr)


@pytest.mark.parametrize("data", ["digits", "digits data.augment=true", "synthetic"])
def test_epochs_fetched_ahead_equal_epochs_fetched_alone(monkeypatch, data):
    """A small epoch is fetched with the epochs after it (one index copy, one fetch for several):
    each epoch's batches are bitwise those of the epoch fetched alone, in order, after a resume
    mid-epoch and after a jump back (a calibration pass, a restart)."""
    import ddp_lab.data.streams as data_mod

    cfg = compose_config([f"data={data.split()[0]}", *data.split()[1:], "data.num_samples=300",
                          "train.batch_size=32", "precision=bf16"])
    ahead = build_data(cfg, 0, 1, torch.device("cpu")).train
    alone = build_data(cfg, 0, 1, torch.device("cpu")).train
    alone.epochs_ahead = False
    epoch_bytes = ahead.num_batches() * 32 * ahead.dataset.sample_bytes()
    monkeypatch.setattr(data_mod, "FETCH_MAX_BYTES", 3 * epoch_bytes + 1)  # 3 epochs a fetch
    assert ahead.epochs_ahead and ahead._window(0) == (3, 3 * ahead.num_batches() * 32)

    def batches(stream, epoch, start_batch=0):
        return [(x.clone(), y.clone(), x._base) for x, y in stream.epoch(epoch, start_batch)]

    # a resume at epoch 1, batch 4; then epochs 2..6 in turn; then a jump back to epoch 0
    order = [(1, 4), (2, 0), (3, 0), (4, 0), (5, 0), (6, 0), (0, 0), (1, 0)]
    seen = [batches(ahead, e, b) for e, b in order]
    for (e, b), got in zip(order, seen):
        want = batches(alone, e, b)
        assert len(got) == len(want) == ahead.num_batches() - b
        for (x, y, _), (xr, yr, _) in zip(got, want):
            assert x.dtype == xr.dtype and torch.equal(x, xr) and torch.equal(y, yr)
    fetch = lambda k: seen[k][0][2].data_ptr()  # the buffer epoch order[k]'s batches are views of
    assert fetch(0) == fetch(1) == fetch(2) != fetch(3)  # epochs 1-3 fetched together, then 4-6
    assert fetch(3) == fetch(4) == fetch(5) and fetch(6) == fetch(7) != fetch(5)

    # A run that ends in epoch 4 (the trainer's last_epoch) fetches nothing past it.
    assert [ahead._window(e, last_epoch=4)[0] for e in (0, 2, 3, 4)] == [3, 3, 2, 1]
    last = [[(x.clone(), y.clone(), x._base) for x, y in ahead.epoch(e, last_epoch=4)]
            for e in (3, 4)]
    assert last[0][0][2].data_ptr() == last[1][0][2].data_ptr()  # epochs 3 and 4, together
    assert last[0][0][2].numel() == 2 * last[0][0][0].numel() * ahead.num_batches()
    for e, got in zip((3, 4), last):
        assert all(torch.equal(x, xr) for (x, _, _), (xr, _, _) in zip(got, batches(alone, e)))


def fetches_alive(batches) -> list[int]:
    """Bytes of each fetch the batches are views of, in order: the storages behind a batch's
    images and labels, which the batch keeps alive while it is in use. (All are kept until
    counted: a freed fetch's address could be reused by a later one.)"""
    sizes = {}
    for x, y in list(batches):
        sizes.setdefault((x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr()),
                         x.untyped_storage().nbytes() + y.untyped_storage().nbytes())
    return list(sizes.values())


def test_fetch_window_is_what_a_batch_keeps_alive(monkeypatch):
    """A batch is a view of its fetch, so while in use it keeps the whole fetch alive: as many
    whole batches as fit in FETCH_MAX_BYTES (at least one), at most the epoch's, or whole epochs
    where one fits several times (bounded by the run's last epoch), each sample in the set's
    stored dtype with its int64 label. `fetch_window` (what memory_fit's prediction counts) is
    held against the bytes counted from the storages, exactly."""
    import ddp_lab.data.streams as data_mod
    from ddp_lab.data.streams import fetch_window

    cfg = compose_config(["data=synthetic", "data.num_samples=300", "data.val_samples=70",
                          "train.batch_size=32", "precision=bf16", "train.channels_last=true"])
    d = build_data(cfg, 0, 1, torch.device("cpu"))
    sample = d.train.dataset.sample_bytes()
    assert sample == 3 * 32 * 32 * 2  # bf16: the stored dtype, not the fp32 the model sees
    per_sample = sample + 8  # and an int64 label
    epoch = 9 * 32  # 300 samples: 9 whole batches (the last partial one dropped)

    # a window of 4 batches: the epoch is 4 + 4 + 1 of them, the largest fetch 4 batches
    monkeypatch.setattr(data_mod, "FETCH_MAX_BYTES", 4 * 32 * sample + 100)
    assert fetch_window(32, sample, epoch) == (1, 4 * 32)
    assert fetches_alive(epoch_alone(d.train, 1)) == [s * per_sample for s in (128, 128, 32)]
    # the default 512 MiB: bounded by the epoch, and validation's (70 samples, kept whole)
    monkeypatch.setattr(data_mod, "FETCH_MAX_BYTES", 512 * 2**20)
    assert fetch_window(32, sample, epoch) == (1, epoch) and fetch_window(32, sample, 70) == (1, 70)
    assert fetches_alive(epoch_alone(d.train, 1)) == [epoch * per_sample]
    assert fetches_alive(d.val.epoch(0)) == [70 * per_sample]

    # epochs ahead: 3 epochs a fetch, or 2 where the run ends with the next epoch
    monkeypatch.setattr(data_mod, "FETCH_MAX_BYTES", 3 * epoch * sample + 1)
    assert fetch_window(32, sample, epoch, epochs_ahead=True) == (3, 3 * epoch)
    assert fetch_window(32, sample, epoch, epochs_ahead=True, epochs_left=2) == (2, 2 * epoch)
    assert fetch_window(32, sample, epoch) == (1, epoch)  # (without epochs_ahead: one at most)
    assert fetches_alive(d.train.epoch(0)) == [3 * epoch * per_sample]
    assert fetches_alive(d.train.epoch(3, last_epoch=4)) == [2 * epoch * per_sample]
    # Epochs fetched together are cut into whole batches: a stream that keeps a partial last
    # batch cannot fetch ahead (it would move samples across epochs); refused where it is built.
    with pytest.raises(ValueError, match="epochs_ahead needs drop_last"):
        type(d.train)(d.val.dataset, d.val.indices_for_epoch, 32, torch.device("cpu"), False,
                      epochs_ahead=True)


def test_a_rank_with_an_empty_validation_shard_yields_no_batches():
    """2 ranks, 1 validation sample: rank 1's shard is empty, its stream just ends."""
    cfg = compose_config(["data=synthetic", "data.num_samples=300", "data.val_samples=1",
                          "train.batch_size=32"])
    assert list(build_data(cfg, 1, 2, torch.device("cpu")).val.epoch(0)) == []
    assert len(list(build_data(cfg, 0, 2, torch.device("cpu")).val.epoch(0))) == 1


@pytest.mark.parametrize("n, world_size", [(10, 1), (10, 3), (7, 4), (2, 5), (50, 8)])
def test_shard_indices_are_distributed_samplers(n, world_size):
    """Including the padding: 7 samples over 4 ranks wrap around by 1; 2 over 5, by 3 (twice)."""
    from torch.utils.data import DistributedSampler

    from ddp_lab.data import shard_indices

    for epoch in (0, 3):
        for rank in range(world_size):
            sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, seed=11)
            sampler.set_epoch(epoch)
            assert shard_indices(n, rank, world_size, 11, epoch).tolist() == list(sampler)


def _write_cifar10(root, per_batch: int = 20) -> tuple[torch.Tensor, torch.Tensor]:
    """Files in torchvision's CIFAR-10 layout (pickled uint8 rows, CHW flattened, plus labels),
    5 training batches and a test batch of `per_batch` images each, every pixel a known function
    of (image, channel, row, column). Returns the training images [N, 3, 32, 32] and labels."""
    import pickle

    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    n = 6 * per_batch
    i, c, h, w = torch.meshgrid(torch.arange(n), torch.arange(3), torch.arange(32),
                                torch.arange(32), indexing="ij")
    images = ((i * 11 + c * 85 + h * 7 + w) % 256).to(torch.uint8)  # rows/columns/channels differ
    labels = torch.arange(n) % 10
    names = [f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]
    for k, name in enumerate(names):
        part = slice(k * per_batch, (k + 1) * per_batch)
        with open(folder / name, "wb") as f:
            pickle.dump({"data": images[part].reshape(per_batch, -1).numpy(),
                         "labels": labels[part].tolist()}, f)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": [f"class{k}" for k in range(10)]}, f)
    return images[:5 * per_batch], labels[:5 * per_batch]


def test_cifar10_files_become_normalised_device_tensors_in_the_right_layout(tmp_path, monkeypatch):
    """data=cifar10 from files in torchvision's format (checksums waived: these are not the real
    ones): images come back CHW with rows, columns and channels in place, normalised with
    CIFAR-10's statistics, prepared once like the other in-memory sets, labels aligned."""
    import torchvision.datasets.cifar as tv_cifar

    from ddp_lab.data import CIFAR_MEAN, CIFAR_STD, TensorImages

    images, labels = _write_cifar10(tmp_path)
    monkeypatch.setattr(tv_cifar.CIFAR10, "_check_integrity", lambda self: True)
    monkeypatch.setattr(tv_cifar, "check_integrity", lambda *a, **k: True)
    cfg = compose_config(["data=cifar10", f"data.root={tmp_path}", "data.augment=false",
                          "train.batch_size=16"])
    d = build_data(cfg, 0, 1, torch.device("cpu"))
    assert isinstance(d.train.dataset, TensorImages) and d.train.dataset.prepared
    assert (d.train_samples, d.val_samples, d.num_classes) == (100, 20, 10)
    idx = torch.as_tensor(d.train.indices_for_epoch(0))[:16]
    x, y = next(epoch_alone(d.train, 0))
    mean, std = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1), torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
    expected = (images[idx].float() / 255 - mean) / std
    assert x.shape == (16, 3, 32, 32) and torch.allclose(x, expected, atol=1e-6)
    assert torch.equal(y, labels[idx])
