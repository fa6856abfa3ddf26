"""Sharded checkpoints (sync.zero>=1, sync=fsdp): every rank writes its own shards with
torch.distributed.checkpoint (DCP), and a checkpoint written at N ranks loads at M.

At sync.zero=0 every rank holds everything and rank 0 writes checkpoint.pt (ddp_lab/checkpoint.py).
With ZeRO or FSDP each rank holds part of the state, and gathering it to one rank would put the
whole of it through one rank's memory (on the GPU, through device memory). Instead a checkpoint
is a directory, `checkpoint_step<N>/`:

    state.pt          rank 0: the step, schedule, loss scale, learning rates, every rank's RNG, the
                      config digest, how the shards were cut (`layout`, the sync's) and a sha256 of
                      every other file; written and read as checkpoint.pt is (weights_only, and a
                      sha256 of its own contents)
    .metadata         DCP's index: each key's global size, dtype, and where its chunks lie
    __<r>_<i>.distcp  DCP's data files: rank r's tensors

What each rank writes is its sync's `state_shards`: FSDP's DTensors (DCP knows their cut), ZeRO's
flat shards under one key per rank with the offsets map in `layout`
(ddp_lab/sync/zero_checkpoint.py; at ZeRO-3 the parameters' shards too), and the tensors every
rank holds (ZeRO-1/2's parameters) once, by whichever rank DCP picks. Nothing is gathered; a GPU tensor is copied to
the host one at a time.

Writing is atomic: into `checkpoint_step<N>.tmp/`, every rank's files synced; then each rank
hashes a share of the files, rank 0 gathers the digests, writes state.pt last and renames the
directory. A crash at any point leaves the previous checkpoints whole; the temporary is removed
at the next start. After a save the older directories go, except those train.keep_every keeps.

Loading is checked before anything is read into the model, and refused with one line if anything
is wrong (the run dir is left as it is, not started over): state.pt's own sha256, then every
other file against the sha256 in state.pt (each rank hashes a share, the verdicts are gathered,
so all ranks refuse together), a missing file, a model whose parameters are not the checkpoint's.
Unlike checkpoint.pt there is no fallback to an older checkpoint: the newest one is the one the
run continues from, so it is repaired or moved away by hand.

No pickled code runs. DCP reads tensor data with `torch.load(weights_only=True)`; its `.metadata`
is a pickle, which `SafeReader` reads with an unpickler that builds only DCP's own metadata
classes, torch.Size, dtypes and paths (anything else is refused); no non-tensor value goes
through DCP (those would be read with weights_only=False): they are in state.pt.
"""

from __future__ import annotations

import glob
import hashlib
import os
import pickle
import re
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ddp_lab import checkpoint
from ddp_lab.errors import ConfigError

STATE = checkpoint.SHARDED_STATE
TMP = ".tmp"
_DIR = re.compile(r"checkpoint_step(\d+)$")
_UNTOUCHED = ("Nothing was loaded or written: move it away (to resume from an older checkpoint), "
              "or use train.resume=never (start over) or another hydra.run.dir")


def directory(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, f"checkpoint_step{step}")


def candidates(run_dir: str) -> list[str]:
    """The run dir's sharded checkpoints, newest first (temporaries are not candidates)."""
    found = [p for p in glob.glob(os.path.join(run_dir, "checkpoint_step*"))
             if os.path.isdir(p) and _DIR.search(p)]
    return sorted(found, key=_step_of, reverse=True)


def _step_of(path: str) -> int:
    return int(_DIR.search(path.rstrip(os.sep)).group(1))


# ---- writing ----------------------------------------------------------------------------------

def save(sync, model, optimizer, state: dict, run_dir: str, step: int, keep_every: int) -> str:
    """Collective: this rank's part of the model and optimizer (`sync.state_shards`) with DCP,
    and on rank 0 `state` (plain data), the layout and the digests of every file, in a directory
    written aside and then renamed. Returns the checkpoint's directory."""
    tensors, layout = sync.state_shards(model, optimizer)
    state = dict(state, layout=layout)
    final = directory(run_dir, step)
    tmp, rank = final + TMP, dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a save of this step killed midway
        os.makedirs(tmp)
    dist.barrier()
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
    dist.barrier()  # every rank's files are written and synced
    digests = _gather_digests(tmp)
    if rank == 0:
        checkpoint.atomic_save(dict(state, files=digests), os.path.join(tmp, STATE))
        _replace_dir(tmp, final)
        _prune(run_dir, step, keep_every)
    dist.barrier()  # nobody runs ahead of a checkpoint that is not in place yet
    return final


def _gather_digests(path: str) -> dict[str, str]:
    """Collective: the sha256 of every file in `path`, each rank hashing every N-th of them."""
    names = sorted(os.listdir(path))
    rank, n = dist.get_rank(), dist.get_world_size()
    mine = {name: _sha256(os.path.join(path, name)) for name in names[rank::n]}
    every = [None] * n
    dist.all_gather_object(every, mine)
    return {name: d for part in every for name, d in sorted(part.items())}


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _replace_dir(tmp: str, final: str) -> None:
    """Rename `tmp` to `final` (a directory of this step written before, by a run started over
    with train.resume=never, is swapped out first) and sync the parent directory."""
    if os.path.exists(final):
        old = final + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old)
    else:
        os.replace(tmp, final)
    fd = os.open(os.path.dirname(os.path.abspath(final)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(run_dir: str, step: int, keep_every: int) -> None:
    """Remove the checkpoints before `step` that train.keep_every does not keep, and every one
    after it: steps only grow within a run, so a later one is an earlier run's, one this run
    started over from (train.resume=never), and the next resume would pick it over ours."""
    for path in candidates(run_dir):
        s = _step_of(path)
        if s > step or s < step and not (keep_every and s % keep_every == 0):
            shutil.rmtree(path)


def hyperparameters(optimizer) -> list[dict]:
    """The optimizer's param groups without their parameters: what state.pt keeps of it."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def clean_stale_temporaries(run_dir: str) -> list[str]:
    """Directories left by a save that was killed midway (rank 0 only, at start). A kill inside
    _replace_dir's two renames leaves `.old` and no final directory: the temporary was complete
    by then, so it becomes the checkpoint (else `.old` goes back), rather than losing both."""
    for old in glob.glob(os.path.join(run_dir, "checkpoint_step*.old")):
        final = old[:-len(".old")]
        if not os.path.exists(final):
            os.replace(final + TMP if os.path.isdir(final + TMP) else old, final)
    stale = [p for p in glob.glob(os.path.join(run_dir, "checkpoint_step*"))
             if p.endswith((TMP, ".old")) and os.path.isdir(p)]
    for path in stale:
        shutil.rmtree(path)
    return stale


# ---- reading ----------------------------------------------------------------------------------

def resume(cfg_dict: dict, run_dir: str, resume_opt: str, world_size: int, log) -> dict | None:
    """Collective: `checkpoint.resume` with this module's `find_resumable` (a config at any world
    size with the same global batch), then every file of the checkpoint checked (`verify`)."""
    ckpt = checkpoint.resume(cfg_dict, run_dir, resume_opt, world_size, log,
                             find=find_resumable, reshardable=True)
    if ckpt is not None:
        verify(ckpt["path"], ckpt["files"])
    return ckpt


def find_resumable(run_dir: str, resume: str, digest: str, log=print,
                   current: dict | None = None) -> dict | None:
    """The checkpoint `train.resume` names (auto: the newest directory in the run dir; never:
    none; or a directory), its state.pt read and its config checked. A run dir with only
    checkpoint.pt files holds another config's run: checkpoint.find_resumable refuses it."""
    if resume == "never":
        return None
    if resume != "auto" and not os.path.isfile(os.path.join(resume, STATE)):
        raise ConfigError(f"train.resume={resume!r}: not a sharded checkpoint (no {STATE} there); "
                          "sync.zero>=1 and sync=fsdp resume from a checkpoint_step<N> directory")
    found = [resume] if resume != "auto" else candidates(run_dir)
    if not found:
        return checkpoint.find_resumable(run_dir, resume, digest, log, current)
    ckpt = read_state(found[0])
    checkpoint.check_config(ckpt, found[0], digest, current)
    return ckpt


def read_state(path: str) -> dict:
    """state.pt of the checkpoint at `path`: weights_only, its own sha256 checked."""
    try:
        return checkpoint.load(os.path.join(path, STATE)) | {"path": path}
    except ConfigError as e:
        raise ConfigError(f"{e}. {_UNTOUCHED}") from None


def verify(path: str, digests: dict[str, str]) -> None:
    """Collective: every file of the checkpoint against its sha256, each rank checking every
    N-th; a missing, extra-short or altered file is one ConfigError on every rank."""
    names = sorted(digests)
    rank, n = dist.get_rank(), dist.get_world_size()
    bad = [_damage(os.path.join(path, name), digests[name]) for name in names[rank::n]]
    every = [None] * n
    dist.all_gather_object(every, [b for b in bad if b])
    found = [b for part in every for b in part]
    if found:
        raise ConfigError(f"checkpoint {path} is damaged: {'; '.join(found[:4])}. {_UNTOUCHED}")


def _damage(path: str, digest: str) -> str | None:
    name = os.path.basename(path)
    if not os.path.isfile(path):
        return f"{name} is missing"
    if _sha256(path) != digest:
        return f"{name} does not match the sha256 written with it"
    return None


class SafeReader(FileSystemReader):
    """DCP's file reader, its `.metadata` read by `_MetadataUnpickler` instead of pickle.load."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _MetadataUnpickler(pickle.Unpickler):
    """Builds the classes of DCP's metadata module, torch.Size, dtypes, layouts and paths;
    nothing else (no function, no class of another module, no attribute of an attribute)."""

    _METADATA = "torch.distributed.checkpoint.metadata"
    _ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                ("torch.serialization", "_get_layout"), ("torch", "Size"),
                ("pathlib", "PosixPath"), ("pathlib", "WindowsPath")}

    def find_class(self, module: str, name: str):
        if "." not in name:
            if (module, name) in self._ALLOWED:
                return super().find_class(module, name)
            obj = getattr(torch, name, None) if module == "torch" else None
            if isinstance(obj, torch.dtype):
                return obj
            if module == self._METADATA:
                obj = super().find_class(module, name)
                if isinstance(obj, type) and obj.__module__ == module:
                    return obj
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from DCP metadata")


class Shards:
    """The tensors of a sharded checkpoint: `metadata` says what each key holds (its global
    size and dtype), `read(tensors)` fills the given tensors (or DTensors: DCP reads just this
    rank's part of them) in place. Collective, as DCP is."""

    def __init__(self, path: str):
        self.path = path
        try:
            self.metadata = SafeReader(path).read_metadata().state_dict_metadata
        except Exception as e:  # noqa: BLE001 - whatever DCP or the unpickler raised
            raise ConfigError(f"checkpoint {path}: DCP's .metadata is unreadable "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None

    def empty(self, key: str) -> torch.Tensor:
        """A CPU tensor of the size and dtype `key` was saved with (the whole of it)."""
        md = self.metadata[key]
        return torch.empty(md.size, dtype=md.properties.dtype)

    def dtype(self, key: str) -> torch.dtype:
        return self.metadata[key].properties.dtype

    def read(self, tensors: dict) -> None:
        try:
            dcp.load(tensors, storage_reader=SafeReader(self.path))
        except Exception as e:  # noqa: BLE001 - DCP's CheckpointException wraps every rank's
            first = str(e).splitlines()[0][:300]
            raise ConfigError(f"checkpoint {self.path} could not be read ({type(e).__name__}: "
                              f"{first}). {_UNTOUCHED}") from None


def check_model(shards: Shards, model_state: dict, layout: dict) -> None:
    """The checkpoint's model tensors ("model.<name>", and ZeRO-3's parameters in shards, which
    its layout lists) are this model's, by name and shape."""
    saved = {k[len("model."):]: tuple(md.size) for k, md in shards.metadata.items()
             if k.startswith("model.")}
    saved |= {k: tuple(where["shape"]) for k, where in layout.get("params", {}).items()}
    here = {k: tuple(v.shape) for k, v in model_state.items()}
    diff = [f"{k}: {list(saved[k]) if k in saved else 'absent'} there, "
            f"{list(here[k]) if k in here else 'absent'} here"
            for k in sorted(set(saved) | set(here)) if saved.get(k) != here.get(k)]
    if diff:
        more = f"; and {len(diff) - 3} more" if len(diff) > 3 else ""
        raise ConfigError(f"checkpoint {shards.path} holds another model ({'; '.join(diff[:3])}"
                          f"{more}). {_UNTOUCHED}")


def load(resumed: dict, sync, model, optimizer) -> None:
    """Collective: the checkpoint `resumed` (its state.pt) into this rank's model and optimizer,
    through `sync.load_state_shards`, after checking it holds this model."""
    shards = Shards(resumed["path"])
    check_model(shards, model.state_dict(), resumed["layout"])  # (shapes only: nothing is read)
    sync.load_state_shards(model, optimizer, shards, resumed["layout"])
    for group, saved in zip(optimizer.param_groups, resumed["optimizer"]["param_groups"]):
        group.update(saved)  # learning rates and the rest (`params` was not saved)


def read_whole(path: str) -> dict:
    """One process, no group: state.pt and every tensor of the checkpoint whole, by key (for
    tests and inspection; what each key holds is the writing sync's `layout`). ZeRO-3's
    parameters are also given whole, as `model.<name>`, as the other stages save them."""
    state = read_state(path)
    shards = Shards(path)
    tensors = {k: shards.empty(k) for k in shards.metadata}
    with warnings.catch_warnings():  # ("assuming the intent is to load in a single process": it is)
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, storage_reader=SafeReader(path), no_dist=True)
    return state | {"tensors": tensors | _whole_params(tensors, state["layout"])}


def _whole_params(tensors: dict, layout: dict) -> dict:
    """ZeRO-3's parameters, `model.<name>`: each unit's shards (`param.<unit>.<rank>`) joined,
    each parameter cut out of its unit as it lay there (shape and strides), made contiguous."""
    n = layout.get("world_size", 0)
    units = {u: torch.cat([tensors[f"param.{u}.{r}"] for r in range(n)])
             for u in {where["unit"] for where in layout.get("params", {}).values()}}
    return {f"model.{name}": units[w["unit"]].as_strided(w["shape"], w["stride"], w["offset"])
            .contiguous() for name, w in layout.get("params", {}).items()}
