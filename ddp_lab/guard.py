"""Guards around the training step: non-finite policy, cross-rank consistency, hang diagnosis.

* Non-finite loss or gradients. Each step the guard checks the loss and the gradients on the
  device (with more than one rank it all-reduces a per-rank [loss, gradients] flag: ranks decide
  together, never alone) and leaves the verdict there: a fused optimizer (the default) skips the
  update itself through its `found_inf` input, the mechanism GradScaler uses, so parameters,
  momentum and weight decay are untouched and the host never waits. fp16's GradScaler skips on
  its own (it sees the averaged gradients, so every rank skips alike). The
  verdicts are read at sync points (log steps, checkpoints, the end): `train.nonfinite=skip`
  logs and counts the skipped steps, `stop` raises `NonFiniteError` naming the step and ranks,
  `off` checks nothing per step (the read pass costs ~3.5% of a graphed AlexNet-CIFAR step on the
  H200) and applies every step. `assert_finite` is the last line before a checkpoint, whatever
  the policy: a NaN never reaches one.
* Replicas. Every `train.consistency_every` steps the ranks compare an exact checksum of their
  parameters (computed on the device, no copy to the host) and a divergence stops training with
  the ranks named.
* Hangs. gloo collectives (and send/recv) honour the process-group timeout (`dist.timeout_s`) and
  then raise a bare "Timed out waiting 10000ms for recv operation"; NCCL's watchdog aborts the
  process after the same timeout with its own message naming the operation
  (`WorkNCCL(SeqNum=.., OpType=ALLREDUCE ..)`, TORCH_NCCL_ASYNC_ERROR_HANDLING=3 by default).
  `collective_errors` turns the gloo case into one line that names the collective (from the
  traceback) and the ranks that were behind (from per-rank step heartbeats in the c10d store).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import traceback

import torch
import torch.distributed as dist

log = logging.getLogger("ddp_lab")

# Gradients of at least this many bytes are checked through their norms (one read pass), smaller
# ones in place (a read and a write, but one op fewer): see Guard.after_sync. Their size stands in
# for what bounds an eager step, measured on the H200: AlexNet-CIFAR's (93 MB of gradients) is
# bounded by the host, so one op fewer is what counts; 224 px AlexNet's (244 MB) by the GPU, where
# the write costs ~60 us of a ~4.2 ms step and the norms' extra host work is hidden.
NORMS_FROM_BYTES = 128 * 2**20


class TrainingError(RuntimeError):
    """Training cannot go on: printed as one line, exit code 3. `every_rank`: each rank's message
    differs (print them all); otherwise the ranks decided together and rank 0 speaks for all."""
    every_rank = False


class NonFiniteError(TrainingError):
    pass


class ReplicaDivergence(TrainingError):
    pass


class CollectiveError(TrainingError):
    every_rank = True


# ---- heartbeats, for naming the rank that is behind -------------------------------------------

_progress = {"step": None, "sync": "?"}


def _store():
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # private API: degrade to "rank unknown"
        return None


def _heartbeat_key(rank: int) -> str:
    return f"ddp_lab/step/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{rank}"


def _ranks_behind(my_step) -> str:
    store = _store()
    if store is None or my_step is None or not dist.is_initialized():
        return ""
    behind, same = [], 0
    try:
        for r in range(dist.get_world_size()):
            key = _heartbeat_key(r)
            step = int(store.get(key)) if store.check([key]) else 0
            if step < my_step:
                behind.append(f"rank {r} (last began step {step})")
            else:
                same += 1
    except Exception:
        return ""
    if behind:
        return f"; ranks behind: {', '.join(behind)}"
    return f"; every rank began step {my_step}, so the stall is inside it"


def _where(tb) -> tuple[str, str]:
    """(collective, call site) for an exception from a collective, read off its traceback."""
    frames = traceback.extract_tb(tb)
    ours = [f for f in frames if f"{os.sep}ddp_lab{os.sep}" in f.filename]
    site = (f"{os.path.relpath(ours[-1].filename, os.path.dirname(os.path.dirname(__file__)))}:"
            f"{ours[-1].lineno} `{(ours[-1].line or '').strip()}`") if ours else "?"
    c10d = [f for f in frames if f.filename.endswith("distributed_c10d.py")]
    if c10d:
        # the outermost c10d frame is the public function our code called
        return f"{c10d[0].name}", site
    if any(f"{os.sep}autograd{os.sep}" in f.filename for f in frames):
        return f"the gradient all-reduce inside backward (sync={_progress['sync']})", site
    ddp = [f for f in frames if f.filename.endswith(f"parallel{os.sep}distributed.py")]
    if ddp:
        line = ddp[-1].line or ""
        if "_rebuild_buckets" in line:  # DDP's forward after its first backward
            return "DDP's bucket-rebuild broadcast (forward of its second step)", site
        if "sync_buffers" in line or "_sync_buffers" in ddp[-1].name:
            return "DDP's buffer broadcast in forward", site
        return f"DistributedDataParallel.{ddp[-1].name}", site
    return f"a collective of sync={_progress['sync']}", site


_DIST_PATTERNS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe",
                  "gloo", "nccl", "socket", "peer")


@contextlib.contextmanager
def collective_errors(timeout_s: float):
    """Turn a failed or timed-out collective into a `CollectiveError` naming what and who."""
    try:
        yield
    except TrainingError:
        raise
    except RuntimeError as e:  # DistBackendError / DistError subclass RuntimeError
        msg = str(e)
        if not (isinstance(e, getattr(dist, "DistError", ())) or
                any(p in msg.lower() for p in _DIST_PATTERNS)):
            raise
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
        what, site = _where(e.__traceback__)
        step = _progress["step"]
        timed_out = "timed out" in msg.lower() or "timeout" in msg.lower()
        verdict = (f"timed out after dist.timeout_s={timeout_s:g}" if timed_out else
                   "failed (a peer closed its connection: did a rank die?)"
                   if "closed" in msg.lower() or "reset" in msg.lower() else "failed")
        raise CollectiveError(
            f"rank {rank}: collective {what} {verdict} at step {step} (called at {site})"
            f"{_ranks_behind(step) if timed_out else ''}. "
            f"Original error: {msg.strip().splitlines()[-1][:300]}") from e


# ---- the guard ----------------------------------------------------------------------------------

class Guard:
    """Called by the loop at three points of a step; decides on every rank alike."""

    def __init__(self, tcfg, sync_name: str, info, model: torch.nn.Module, scaler, total_steps: int):
        self.policy, self.every = tcfg.nonfinite, tcfg.consistency_every
        self.info, self.scaler = info, scaler
        self.params = list(model.parameters())  # listed once: walking the modules costs ~30 us
        self.graphed = tcfg.cuda_graph
        # What the per-step check reads (after_sync): a graph's eager calls check as its replays.
        grad_bytes = sum(p.numel() * p.element_size() for p in self.params if p.requires_grad)
        self.reads_norms = self.graphed or grad_bytes >= NORMS_FROM_BYTES
        self.last_step = total_steps
        self.skipped: list[int] = []
        self.checks = 0
        self._pending: list[list] = []  # [step, found, detail, scale before, scale after]
        self._store = _store() if info.world_size > 1 else None
        self._one: torch.Tensor | None = None  # the check's scale, made on the first step's device
        self._flags: list[torch.Tensor] = []  # zeroed one-element flags for the steps to come
        self._captured: list | None = None  # train.cuda_graph: the captured step's entry
        _progress["sync"] = sync_name

    def begin_step(self, step: int) -> None:
        """step is 1-based. A heartbeat in the c10d store: the rank that stops beating is named
        when the others time out."""
        _progress["step"] = step
        if self._store is not None:
            self._store.set(_heartbeat_key(self.info.rank), str(step))

    def after_sync(self, step: int, loss: torch.Tensor, optimizer) -> None:
        """Between the gradient sync and the optimizer step. No host sync: the verdict stays on
        the device and a fused optimizer skips the update itself (its `found_inf`, the mechanism
        GradScaler uses); it is read later, at a sync point (resolve)."""
        if self.scaler.is_enabled():
            # fp16: the scaler finds inf/NaN gradients and skips by itself (a non-finite loss
            # makes them so), whatever the policy; keep its scale (a device tensor) to report it.
            scale = self.scaler._scale.clone()  # noqa: SLF001 - get_scale() would sync the host
            self._pending.append([step, None, None, scale, None])
            return
        if self.policy == "off":  # every step is applied; assert_finite still guards checkpoints
            return
        grads = [p.grad for p in self.params if p.grad is not None]
        loss = loss.detach()
        if self._one is None:
            self._one = torch.ones(1, device=loss.device)
        # GradScaler's multi-tensor check (with a scale of 1: values unchanged) sets a zeroed flag
        # to 1.0 if a value is inf/NaN. What it reads is chosen once (__init__), by what the
        # check would cost the step:
        # - small gradients (AlexNet-CIFAR's 93 MB), eager: such a step is bounded by how fast the
        #   host issues ops, so the check runs over the loss and gradients themselves, one op (15
        #   us of host time on the H200's host, against 70 us for norms then a check), reading
        #   and rewriting the gradients;
        # - large gradients (224 px AlexNet's 244 MB: its step is bounded by the GPU), or in a CUDA
        #   graph (train.cuda_graph), bytes are what cost: the L1 norms of the loss and every
        #   gradient in one read pass, then the check over those few norms. A norm is inf/NaN iff
        #   some element is (or a tensor's finite values sum past fp32's range: skip that too).
        checked = (torch._foreach_norm([loss, *grads], 1, dtype=torch.float32)
                   if self.reads_norms else [loss, *grads])
        check = lambda tensors, flag: torch._amp_foreach_non_finite_check_and_unscale_(
            tensors, flag, self._one)
        if self.info.world_size == 1:
            found = self._zeroed_flag(loss.device)
            check(checked, found)
            detail = loss  # which one it was is worked out on the host, for a flagged step only
        else:
            # [loss, gradients] x rank, each rank filling its own column: all ranks decide
            # together and the message can say where the inf/NaN came from.
            r = self.info.rank
            detail = torch.zeros(2, self.info.world_size, device=loss.device)
            check(checked[:1], detail[0, r:r + 1])
            check(checked[1:], detail[1, r:r + 1])
            dist.all_reduce(detail)  # columns are disjoint: entries stay 0/1
            found = detail.amax()
        if optimizer.defaults.get("fused") and (optimizer.state or _stateless(optimizer)):
            optimizer.found_inf = found  # 1.0 skips the fused update, 0.0 applies it
        elif found.item():
            # Unfused optimizer, or the very first step (fused SGD would leave its new momentum
            # buffers uninitialised when skipped): decide on the host now.
            optimizer.zero_grad(set_to_none=True)  # no gradients: the optimizer step is a no-op
        self._pending.append([step, found, detail, None, None])

    def _zeroed_flag(self, device: torch.device) -> torch.Tensor:
        """A zeroed one-element tensor for a step's verdict. Eager, views of one buffer zeroed
        every 64 steps (a torch.zeros a step costs ~10 us of host time); in a CUDA graph a new
        one, so that zeroing it is part of the graph and every replay starts from 0."""
        if self.graphed:
            return torch.zeros(1, device=device)
        if not self._flags:
            self._flags = list(torch.zeros(64, device=device).split(1))
        return self._flags.pop()

    def rank_flags(self, found: torch.Tensor, detail: torch.Tensor) -> torch.Tensor:
        """[loss, gradients] x rank, 1.0 where that rank's loss / gradients were not finite."""
        if detail.dim() == 2:
            return detail
        # World size 1: the step's loss. A non-finite loss makes the gradients so too: name the
        # cause.
        bad_loss = ~torch.isfinite(detail)
        return torch.stack([bad_loss, found.view(()).bool() & ~bad_loss]).float().view(2, 1)

    def replayed(self, step: int) -> None:
        """train.cuda_graph: after a replay of the captured step. Its after_sync ran once, at
        capture, and every replay overwrites the same verdict tensors: keep this step's copy."""
        if self.policy == "off":
            return
        if self._captured is None:
            self._captured = self._pending.pop()
        _, found, loss, _, _ = self._captured
        snap = torch.cat([found.view(1), loss.view(1)])  # one op
        self._pending.append([step, snap[:1], snap[1], None, None])

    def end_step(self, step: int, sync_point: bool) -> bool:
        """After the optimizer step. At a sync point (log step, checkpoint, end) read the
        pending verdicts; every `train.consistency_every` steps compare replicas. Returns whether
        it compared (that time is not step time)."""
        if self._pending and self._pending[-1][0] == step and self.scaler.is_enabled():
            self._pending[-1][4] = self.scaler._scale.clone()  # noqa: SLF001 - as above
        if sync_point:
            self.resolve()
        if self.every and (step % self.every == 0 or step == self.last_step):
            self.check_replicas(step)
            return True
        return False

    def resolve(self) -> None:
        """Read the verdicts of the steps since the last call: one copy to the host for all of
        them (an .item() per step would cost a transfer each, ~30 us of a small model's step)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        if self.scaler.is_enabled():
            # [before, after] per step; "after" is None where the step did not end (a stop)
            scales = torch.stack([t.view(()) for _, _, _, before, after in pending
                                  for t in (before, before if after is None else after)])
            scales = scales.view(-1, 2).tolist()
            for (step, *_), (before, after) in zip(pending, scales):
                if after < before:
                    self.skipped.append(step)
                    log.info("step %d: GradScaler found inf/NaN gradients, step skipped on every "
                             "rank, loss scale %g -> %g", step, before, after)
            return
        found = torch.cat([f.view(1) for _, f, _, _, _ in pending]).tolist()
        for (step, f, detail, _, _), flagged in zip(pending, found):
            if not flagged:
                continue
            flags = self.rank_flags(f, detail)
            where = "; ".join(f"non-finite {what} on rank(s) {row.nonzero().flatten().tolist()}"
                              for what, row in zip(("loss", "gradients"), flags) if row.any())
            if self.policy == "stop":
                raise NonFiniteError(
                    f"step {step}: {where}; stopping (train.nonfinite=stop). The step was not "
                    "applied and the last checkpoint holds no NaN; train.nonfinite=skip drops "
                    "such steps on every rank instead")
            self.skipped.append(step)
            log.warning("step %d: %s; step skipped on every rank (train.nonfinite=skip, %d "
                        "skipped so far)", step, where, len(self.skipped))

    def check_replicas(self, step: int) -> None:
        """Collective: every rank's parameter checksum; a difference stops training."""
        mine = param_checksum(self.params)
        every = [torch.empty_like(mine) for _ in range(self.info.world_size)]
        dist.all_gather(every, mine)
        self.checks += 1
        groups: dict[tuple, list[int]] = {}
        for r, c in enumerate(every):
            groups.setdefault(tuple(c.tolist()), []).append(r)
        if len(groups) == 1:
            return
        ranked = sorted(groups.values(), key=lambda rs: (-len(rs), rs[0]))
        short = lambda key: f"{hash(key) & 0xFFFFFFFF:08x}"
        detail = ", ".join(f"ranks {rs} have checksum {short(k)}" for k, rs in groups.items())
        odd = [r for rs in ranked[1:] for r in rs]
        raise ReplicaDivergence(
            f"replicas diverged by step {step}: rank(s) {odd} differ from rank(s) {ranked[0]} "
            f"({detail}). Data-parallel replicas must stay bitwise equal; stopping "
            "(train.consistency_every)")

    def summary(self) -> dict:
        """Collective: per-rank skipped steps (they must agree) for summary.json."""
        self.resolve()
        every = [None] * self.info.world_size
        dist.all_gather_object(every, self.skipped)
        return {"nonfinite_skipped_steps": len(self.skipped),
                "rank_nonfinite_skipped_steps": every,
                "consistency_checks": self.checks}


def _stateless(optimizer) -> bool:
    """SGD without momentum keeps no state, so its first step may be skipped on the device too."""
    return isinstance(optimizer, torch.optim.SGD) and all(
        g["momentum"] == 0 for g in optimizer.param_groups)


def assert_finite(model: torch.nn.Module, optimizer, step: int) -> None:
    """Collective, before a checkpoint: parameters and optimizer state must be finite everywhere."""
    tensors = list(model.parameters()) + [v for s in optimizer.state.values() for v in s.values()
                                          if isinstance(v, torch.Tensor) and v.is_floating_point()]
    bad = ~torch.stack([torch.isfinite(t.detach()).all() for t in tensors]).all()
    device = tensors[0].device
    flag = bad.to(torch.float32).reshape(1).to(device)
    dist.all_reduce(flag)
    if flag.item():
        raise NonFiniteError(f"refusing to checkpoint step {step}: non-finite parameters or "
                             f"optimizer state on {int(flag.item())} rank(s); the previous "
                             "checkpoint is kept")


_WEIGHTS: dict = {}
_CHUNK = 1 << 22


def param_checksum(params) -> torch.Tensor:
    """Exact checksum of parameter bits, on their device: per chunk, sum of (16-bit word + 2^15)
    x (odd position weight) in int64. Any single changed bit changes it; no overflow (each chunk's
    sum < 2^55); integer sums do not depend on reduction order, so equal bits give equal sums."""
    sums = []
    for p in params:
        words = p.detach().reshape(-1).view(torch.int16)
        key = words.device
        if key not in _WEIGHTS:
            _WEIGHTS[key] = (torch.arange(_CHUNK, device=key) % 65536) * 2 + 1
        w = _WEIGHTS[key]
        for s in range(0, words.numel(), _CHUNK):
            c = words[s:s + _CHUNK].to(torch.int64) + 32768
            sums.append((c * w[:c.numel()]).sum())
    return torch.stack(sums)


# ---- the run dir, before Hydra writes into it ---------------------------------------------------

try:
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - hydra < 1.1
    Callback = object


def unwritable(run_dir: str) -> str | None:
    """Why `run_dir` cannot hold a run (None if it can): made if missing, then a probe file.
    (A permission check alone is not enough: root passes os.access on any mode bits.)"""
    import tempfile

    try:
        os.makedirs(run_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write_probe.", dir=run_dir)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return f"{e.strerror or e} ({e.filename or run_dir})"
    return None


class RunDirCheck(Callback):
    """Hydra callback (conf/config.yaml: hydra.callbacks): refuse an unwritable run dir with one
    line before Hydra's own mkdir fails with a traceback, and before any training starts."""

    def on_run_start(self, config, **kwargs) -> None:
        from hydra.core.hydra_config import HydraConfig

        # The default run dir interpolates ${hydra:job.override_dirname}, which resolves only once
        # HydraConfig is set, and Hydra sets it after this callback (in run_job, again).
        HydraConfig.instance().set_config(config)
        run_dir = str(config.hydra.run.dir)
        problem = unwritable(run_dir)
        if problem:
            if os.environ.get("RANK", "0") == "0":
                print(f"error: the run dir {run_dir!r} is not writable: {problem}. Choose another "
                      "with hydra.run.dir=<dir>", file=sys.stderr, flush=True)
            sys.exit(2)
