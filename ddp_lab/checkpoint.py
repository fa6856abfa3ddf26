"""Checkpoints: atomic writes on rank 0, `weights_only` loads everywhere, exact resume.

A checkpoint holds everything the next step depends on: model, optimizer, LR schedule, GradScaler,
the step counter (which fixes epoch and position in the epoch, since the sampler is a pure
function of seed and epoch), every rank's RNG states and a digest of the config that must match.
Only tensors, numbers, strings, lists and dicts go in, so `torch.load(weights_only=True)` can read
it and no pickled code is ever executed.
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

from ddp_lab.config import ConfigError

LATEST = "checkpoint.pt"
TMP_SUFFIX = ".tmp"

# Keys that may change between a run and its resumption without changing its result.
RESUME_NEUTRAL = ("train.resume", "train.stop_at_step", "train.progress", "train.log_every",
                  "train.checkpoint_every", "train.keep_every", "train.timing_warmup",
                  "dist.timeout_s", "data.num_workers", "data.root", "data.download", "fault")


def config_digest(cfg_dict: dict, world_size: int) -> str:
    """sha256 over the resolved config minus RESUME_NEUTRAL keys, plus the world size."""
    flat = {}

    def walk(node, prefix=""):
        for k, v in node.items():
            key = f"{prefix}{k}"
            if any(key == n or key.startswith(n + ".") for n in RESUME_NEUTRAL):
                continue
            if isinstance(v, dict):
                walk(v, key + ".")
            else:
                flat[key] = v

    walk(cfg_dict)
    flat["world_size"] = world_size
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


# ---- files ------------------------------------------------------------------------------------

def atomic_save(obj: dict, path: str) -> None:
    """Write to a temporary file in the same directory, fsync, then rename over `path`: a reader
    sees the old checkpoint or the new one, never half of one."""
    tmp = f"{path}{TMP_SUFFIX}.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def clean_stale_temporaries(run_dir: str) -> list[str]:
    stale = glob.glob(os.path.join(run_dir, f"*.pt{TMP_SUFFIX}.*"))
    for path in stale:
        os.remove(path)
    return stale


def load(path: str) -> dict:
    """Load a checkpoint with weights_only=True; a truncated or corrupted file is a ConfigError."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for a damaged zip or pickle
        raise ConfigError(f"checkpoint {path} is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(ckpt, dict) or "model" not in ckpt or "step" not in ckpt:
        raise ConfigError(f"checkpoint {path} is not a ddp_lab checkpoint (no model/step)")
    return ckpt


def candidates(run_dir: str) -> list[str]:
    """Checkpoints in the run dir, newest first: the latest, then the kept ones by step."""
    kept = glob.glob(os.path.join(run_dir, "checkpoint_step*.pt"))
    step_of = lambda p: int(re.search(r"checkpoint_step(\d+)\.pt$", p).group(1))
    ordered = sorted(kept, key=step_of, reverse=True)
    latest = os.path.join(run_dir, LATEST)
    return ([latest] if os.path.exists(latest) else []) + ordered


def find_resumable(run_dir: str, resume: str, digest: str, log=print) -> dict | None:
    """The checkpoint to resume from, per `train.resume`: auto (newest good one in the run dir, or
    none), never, or an explicit path. A damaged file falls back to the previous good one; a
    checkpoint of a different config is refused."""
    if resume == "never":
        return None
    if resume != "auto":
        if not os.path.exists(resume):
            raise ConfigError(f"train.resume={resume!r}: no such file")
        paths = [resume]
    else:
        paths = candidates(run_dir)
    for path in paths:
        try:
            ckpt = load(path)
        except ConfigError as e:
            log(f"warning: skipping {e}")
            continue
        if ckpt.get("config_digest") != digest:
            raise ConfigError(
                f"{path} was written by a different config (digest {ckpt.get('config_digest')} "
                f"!= {digest}): resuming would not continue that run. Use another run dir "
                "(hydra.run.dir=...) or train.resume=never to start over there.")
        return ckpt | {"path": path}
    if paths and resume != "auto":
        raise ConfigError(f"train.resume={resume!r}: the checkpoint is unreadable")
    return None
