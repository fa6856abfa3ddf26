"""Checkpoints: atomic writes on rank 0, `weights_only` loads everywhere, exact resume.

A checkpoint holds everything the next step depends on: model, optimizer, LR schedule, GradScaler,
what the sync keeps between steps (every rank's: compression's error buffers, PowerSGD's Q), the
step counter (which fixes epoch and position in the epoch, since the sampler is a pure function of
seed and epoch: both are stored too, and checked against the step on resume), every rank's RNG
states and a digest of the config that must match.
Only tensors, numbers, strings, lists and dicts go in, so `torch.load(weights_only=True)` can read
it and no pickled code is ever executed.

Damage is detected, not trusted: the zip container catches truncation, but torch does not check
the bytes of tensor data, so each checkpoint also carries a sha256 of its own contents (`integrity`)
that `load` recomputes. A checkpoint that fails either check is refused and the previous good one
(`checkpoint_step<N>.pt`) is used instead.

This is the format where every rank holds everything (sync.zero=0). Where each holds a part (ZeRO,
FSDP) each rank writes its own (ddp_lab/sharded_checkpoint.py), which uses the config digest, the
RNG states, `atomic_save`/`load` (for its state.pt) and the ranks' agreement on resume from here.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import random
import re

import numpy as np
import torch
import torch.distributed as dist

from ddp_lab.config import is_neutral
from ddp_lab.errors import ConfigError

LATEST = "checkpoint.pt"
SHARDED_STATE = "state.pt"  # in each directory of a sharded checkpoint
TMP_SUFFIX = ".tmp"
FORMAT = 1  # bump when the layout changes incompatibly

def resume_config(cfg_dict: dict, world_size: int, reshardable: bool = False) -> dict:
    """The flattened config a resumed run must share with the run it continues: the same world
    size, or where the checkpoint is sharded (`reshardable`: it loads at any world size) the same
    global batch, train.batch_size x the world size."""
    flat = {}

    def walk(node, prefix=""):
        for k, v in node.items():
            key = f"{prefix}{k}"
            if is_neutral(key):
                continue
            if isinstance(v, dict):
                walk(v, key + ".")
            else:
                flat[key] = v

    walk(cfg_dict)
    if reshardable:
        flat["global_batch"] = flat.pop("train.batch_size") * world_size
    else:
        flat["world_size"] = world_size
    return flat


def config_digest(cfg_dict: dict, world_size: int, reshardable: bool = False) -> str:
    """sha256 over `resume_config`: the resolved config minus the neutral keys (config.NEUTRAL),
    plus the world size or the global batch."""
    flat = resume_config(cfg_dict, world_size, reshardable)
    return hashlib.sha256(json.dumps(flat, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---- RNG state as plain tensors ---------------------------------------------------------------

def rng_state(device: torch.device) -> dict:
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": {"version": py_version, "state": torch.tensor(py_state, dtype=torch.int64),
                   "gauss": py_gauss},
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def gather_rng_states(device: torch.device) -> list[dict]:
    """Every rank's RNG state, in rank order (a collective: all ranks call it)."""
    states = [None] * dist.get_world_size()
    dist.all_gather_object(states, rng_state(device))
    return states


def gather_sync_states(sync) -> list[dict]:
    """Every rank's `sync.state_dict()` (compression's error buffers differ between ranks), in
    rank order, on rank 0 (a collective: all ranks call it); [] on the others, and everywhere
    when the sync keeps nothing (then it is {} on every rank: no collective)."""
    mine = sync.state_dict()
    if not mine:
        return []
    every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, every, dst=0)
    return every or []


# ---- integrity --------------------------------------------------------------------------------

def content_digest(obj) -> str:
    """sha256 over a checkpoint's contents: every tensor's dtype, shape and bytes, every other
    leaf's repr, in a fixed order. Equal before `torch.save` and after `torch.load`."""
    h = hashlib.sha256()

    def walk(node):
        if isinstance(node, torch.Tensor):
            t = node.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy())
        elif isinstance(node, dict):
            h.update(b"{")
            for k in sorted(node, key=repr):
                if k != "integrity":
                    h.update(repr(k).encode())
                    walk(node[k])
            h.update(b"}")
        elif isinstance(node, (list, tuple)):
            h.update(b"[")
            for v in node:
                walk(v)
            h.update(b"]")
        else:
            h.update(repr(node).encode())

    walk(obj)
    return h.hexdigest()


# ---- files ------------------------------------------------------------------------------------

def atomic_save(obj: dict, path: str) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over `path` and fsync
    the directory: a reader (or a restart after a crash at any point) sees the old checkpoint or
    the new one, never half of one. The contents carry their own sha256 (`integrity`)."""
    obj = dict(obj, format=FORMAT)
    obj["integrity"] = content_digest(obj)
    tmp = f"{path}{TMP_SUFFIX}.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save(state: dict, run_dir: str, step: int, keep_every: int) -> list[str]:
    """Rank 0: write `checkpoint.pt` and, every `keep_every` steps, `checkpoint_step<N>.pt`."""
    paths = [os.path.join(run_dir, LATEST)]
    if keep_every and step % keep_every == 0:
        paths.append(os.path.join(run_dir, f"checkpoint_step{step}.pt"))
    for path in paths:
        atomic_save(state, path)
    return paths


def clean_stale_temporaries(run_dir: str) -> list[str]:
    """Temporaries left by a save that was killed midway (rank 0 only, at start)."""
    stale = glob.glob(os.path.join(run_dir, f"*.pt{TMP_SUFFIX}.*"))
    for path in stale:
        os.remove(path)
    return stale


def load(path: str) -> dict:
    """Load a checkpoint with weights_only=True; a truncated or corrupted file is a ConfigError."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a damaged zip or pickle
        raise ConfigError(f"checkpoint {path} is unreadable, truncated or corrupted "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    if not isinstance(ckpt, dict) or "step" not in ckpt or not {"model", "layout"} & set(ckpt):
        raise ConfigError(f"checkpoint {path} is not a ddp_lab checkpoint (no model/step)")
    if "integrity" in ckpt and content_digest(ckpt) != ckpt["integrity"]:
        raise ConfigError(f"checkpoint {path} is corrupted: its contents do not match the sha256 "
                          "written with them")
    return ckpt


def candidates(run_dir: str) -> list[str]:
    """Checkpoints in the run dir, newest first: the latest, then the kept ones by step."""
    kept = glob.glob(os.path.join(run_dir, "checkpoint_step*.pt"))
    step_of = lambda p: int(re.search(r"checkpoint_step(\d+)\.pt$", p).group(1))
    ordered = sorted(kept, key=step_of, reverse=True)
    latest = os.path.join(run_dir, LATEST)
    # A sharded checkpoint's state (ddp_lab/sharded_checkpoint.py) is another config's: listed
    # last, so that a run dir of ZeRO or FSDP is refused by its config, never started over.
    sharded = sorted(glob.glob(os.path.join(run_dir, "checkpoint_step*", SHARDED_STATE)))
    return ([latest] if os.path.exists(latest) else []) + ordered + sharded


def _config_diff(old: dict | None, new: dict) -> str:
    if not isinstance(old, dict):
        return ""
    keys = set(old) | set(new)
    if ("global_batch" in old) != ("global_batch" in new):
        # a sharded checkpoint keeps its global batch, a whole one its world size and batch
        # (resume_config): compared as global batches, not as keys one side lacks
        old, new = _global_batch(old), _global_batch(new)
        keys = set(old) | set(new)
    diff = [f"{k}: {old.get(k, '<unset>')!r} -> {new.get(k, '<unset>')!r}" for k in sorted(keys)
            if old.get(k, "<unset>") != new.get(k, "<unset>")]
    return (" Differences (checkpoint -> now): " + "; ".join(diff[:8])
            + (f"; and {len(diff) - 8} more" if len(diff) > 8 else "") + ".") if diff else ""


def _global_batch(flat: dict) -> dict:
    """A resume_config with its global batch in place of its world size and batch."""
    if "global_batch" in flat:
        return flat
    rest = {k: v for k, v in flat.items() if k not in ("world_size", "train.batch_size")}
    return rest | {"global_batch": flat.get("world_size", 1) * flat.get("train.batch_size", 0)}


def check_config(ckpt: dict, path: str, digest: str, current: dict | None) -> None:
    """The checkpoint at `path` was written by this config (`digest`), or a ConfigError that
    names the differences (`current`: this run's resume_config)."""
    if ckpt.get("config_digest") != digest:
        raise ConfigError(
            f"{path} was written by a different config (digest {ckpt.get('config_digest')} "
            f"!= {digest}): resuming would not continue that run, so nothing was loaded or "
            f"written.{_config_diff(ckpt.get('resume_config'), current or {})} Run the "
            "original command again to continue it, or use another run dir "
            "(hydra.run.dir=...), or train.resume=never to start over there.")


def find_resumable(run_dir: str, resume: str, digest: str, log=print,
                   current: dict | None = None) -> dict | None:
    """The checkpoint to resume from, per `train.resume`: auto (newest good one in the run dir, or
    none), never, or an explicit path. A damaged file falls back to the previous good one; if
    every checkpoint there is damaged the run is refused rather than started over (that would
    overwrite them); a checkpoint of a different config is refused."""
    if resume == "never":
        return None
    if resume != "auto":
        if not os.path.isfile(resume):
            raise ConfigError(f"train.resume={resume!r}: no such file")
        paths = [resume]
    else:
        paths = candidates(run_dir)
    refused = []
    for path in paths:
        try:
            ckpt = load(path)
        except ConfigError as e:
            log(f"refusing {e}; trying the previous checkpoint")
            refused.append(str(e))
            continue
        check_config(ckpt, path, digest, current)
        return ckpt | {"path": path}
    if refused:
        raise ConfigError(
            f"no usable checkpoint to resume from in {os.path.dirname(paths[0]) or '.'}: "
            + " | ".join(refused) + ". Starting over would overwrite them: move them away, or "
            "use train.resume=never (start over) or another hydra.run.dir")
    return None


def resume(cfg_dict: dict, run_dir: str, resume_opt: str, world_size: int, log,
           find=find_resumable, reshardable: bool = False) -> dict | None:
    """Collective: every rank picks its checkpoint (`find`: checkpoint.pt's `find_resumable`, or
    the sharded one's, which is `reshardable`), then the ranks check that they agree (same step,
    same file) or fail together: a rank that resumed elsewhere, or one that failed alone while
    the others wait in a collective, would hang or corrupt the run."""
    digest = config_digest(cfg_dict, world_size, reshardable)
    try:
        ckpt = find(run_dir, resume_opt, digest, log,
                    resume_config(cfg_dict, world_size, reshardable))
        mine = ("ok", None if ckpt is None else (ckpt["step"], os.path.basename(ckpt["path"])))
    except ConfigError as e:
        ckpt, mine = None, ("error", str(e))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    errors = [msg for kind, msg in every if kind == "error"]
    if errors:
        raise ConfigError(errors[0])
    if len({choice for _, choice in every}) > 1:
        raise ConfigError(f"ranks disagree on the checkpoint to resume from (per rank: "
                          f"{[choice for _, choice in every]}): every rank must see the same run "
                          "dir (a shared file system for multi-node runs)")
    return ckpt


def check_position(ckpt: dict, steps_per_epoch: int, accum_steps: int) -> None:
    """The stored epoch / batch-in-epoch must be what the step implies for this data and batch."""
    step = ckpt["step"]
    expected = (step // steps_per_epoch, (step % steps_per_epoch) * accum_steps)
    stored = (ckpt.get("epoch", expected[0]), ckpt.get("epoch_batch", expected[1]))
    if stored != expected:
        raise ConfigError(f"{ckpt['path']}: step {step} is epoch {expected[0]}, batch {expected[1]} "
                          f"here but the checkpoint says epoch {stored[0]}, batch {stored[1]}: the "
                          "data or batch layout changed, resuming would not continue the run")


def check_keep_every(keep_every: int, checkpoint_every: int, steps_per_epoch: int) -> None:
    """Kept checkpoints are the regular ones taken at multiples of keep_every: it must divide."""
    interval = checkpoint_every or steps_per_epoch
    if keep_every and keep_every % interval:
        what = (f"train.checkpoint_every={checkpoint_every}" if checkpoint_every else
                f"the {steps_per_epoch} steps per epoch (train.checkpoint_every=0 saves at the end "
                "of each epoch)")
        raise ConfigError(f"train.keep_every={keep_every} must be a multiple of {what}: kept "
                          "checkpoints are the regular ones saved at those steps, so others would "
                          "silently be missing")
