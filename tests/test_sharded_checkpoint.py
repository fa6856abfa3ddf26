"""Sharded checkpoints (ddp_lab/sharded_checkpoint.py: sync.zero>=1, sync=fsdp) on real gloo
groups: each rank's shards written at N ranks load at M ranks and save back the same state
(ZeRO's flat shards cut again from the offsets map, torch's ZeRO-1 dealing whole parameters out
again, FSDP's DTensors resharded by DCP), AdamW's `step` included; damage and a model that does
not match are refused in one line and leave the checkpoint as it was; end to end, a 2-rank
`sync=ring sync.zero=2` run stopped at step 2 continues at 1 and at 3 ranks as the uninterrupted
1-rank run does.

Tolerance of the end-to-end continuation: SGD, the same global batch (the same samples in each
step: ddp_lab/data/streams.py), the sums in another order at each world size: a few ulp of a
weight a step, held to 1e-6 as every SGD comparison of ranks against one process is."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace

import pytest
import torch

from ddp_lab import checkpoint, comm, sharded_checkpoint
from ddp_lab.errors import ConfigError
from background import background
from helpers import check, training_state
from launchers import ranks, spawn
from reliab_helpers import NO_DROPOUT, train_log
from test_bad_input import snapshot
from test_fsdp import fsdp_cfg
from test_sync import batch, make_model
from test_zero import make_sync, scfg

STEP = 4  # the checkpoint's step (the small CNN's training steps before it)
MORE = 2  # and the steps after it
KINDS = {"ring-zero2": scfg("ring", 2), "ring-zero3": scfg("ring", 3), "ddp-zero1": scfg("ddp", 1),
         "fsdp": fsdp_cfg()}


def _fresh(rank, n, kind, wide=False):
    """A sync, model and AdamW over what this rank updates, before any step: ZeRO-2 (ring),
    torch's ZeRO-1 (ZeroRedundancyOptimizer) or FSDP. `wide`: another model, its first
    convolution 5 channels wide instead of 4."""
    model = make_model(seed=rank)  # (rank 0's parameters are broadcast)
    if wide:
        model[0], model[3] = torch.nn.Conv2d(3, 5, 3), torch.nn.Linear(5 * 6 * 6, 10)
    sync = make_sync(KINDS[kind], n)
    wrapped = sync.prepare(model)
    return sync, model, wrapped, sync.build_optimizer(model, torch.optim.AdamW,
                                                      dict(lr=1e-3, fused=True))


def _steps(rank, run, steps) -> None:
    sync, _, wrapped, opt = run
    for step in steps:
        x, y = batch(rank, step, 0)
        torch.nn.functional.cross_entropy(wrapped(x), y).backward()
        sync.finish()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _save(run, run_dir):
    sync, model, _, opt = run
    n = sync.world_size
    state = {"step": STEP, "config_digest": checkpoint.config_digest(_cfg(n), n, True),
             "optimizer": {"param_groups": sharded_checkpoint.hyperparameters(opt)}}
    return sharded_checkpoint.save(sync, model, opt, state, str(run_dir), STEP, keep_every=0)


def _cfg(n: int) -> dict:
    """The config of a checkpoint here (its digest): the same global batch at any world size."""
    return {"train": {"batch_size": 24 // n}}


def _resumed(rank, n, kind, run_dir, wide=False):
    """At n ranks, what a resumed run does: find the run dir's checkpoint, check it (its config,
    every file) and load it."""
    run = _fresh(rank, n, kind, wide)
    resumed = sharded_checkpoint.resume(_cfg(n), str(run_dir), "auto", n, log=print)
    sharded_checkpoint.load(resumed, run[0], run[1], run[3])
    return run


def _state(run) -> list[torch.Tensor]:
    """This rank's parameters and optimizer state, as tensors."""
    sync, model, _, opt = run
    opt = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer: this rank's part
    with sync.unsharded():
        tensors = [*model.parameters(), *(s[k] for s in opt.state.values() for k in sorted(s))]
        return [t.to_local() if hasattr(t, "to_local") else t.detach().clone() for t in tensors]


def _write_and_continue(rank, n, run_dirs):
    """Per kind: STEP steps, a checkpoint, MORE steps; then the checkpoint loaded in a fresh
    run and the same MORE steps: bitwise the same parameters and state?"""
    out = {}
    for kind, run_dir in run_dirs.items():
        run = _fresh(rank, n, kind)
        _steps(rank, run, range(STEP))
        _save(run, run_dir)
        _steps(rank, run, range(STEP, STEP + MORE))
        again = _resumed(rank, n, kind, run_dir)
        _steps(rank, again, range(STEP, STEP + MORE))
        out[kind] = all(torch.equal(a, b) for a, b in zip(_state(run), _state(again)))
        run[0].close(), again[0].close()
    return out


def _load_then_write(rank, m, run_dirs, new_dirs):
    """At m ranks: per kind, load the checkpoint in run_dirs[kind] and write it into new_dirs."""
    for kind, run_dir in run_dirs.items():
        run = _resumed(rank, m, kind, run_dir)
        _save(run, new_dirs[kind])
        run[0].close()


def whole(path) -> dict:
    """Every tensor of a checkpoint, ZeRO's flat shards joined into their bucket's whole (their
    keys end in the rank: `optim.<bucket>.<state>.<rank>`, ZeRO-3's `param.<unit>.<rank>`), by
    key."""
    read = sharded_checkpoint.read_whole(path)
    tensors, layout = read["tensors"], read["layout"]
    if "buckets" not in layout:
        return tensors
    joined = {k: v for k, v in tensors.items() if k.startswith("model.")}
    sharded = [(f"optim.{b}.{key}", key == "step") for b in range(len(layout["buckets"]))
               for key in layout["state"]]
    if "params" in layout:
        sharded += [(f"param.{u}", False) for u in range(len(layout["buckets"]))]
    for key, scalar in sharded:
        parts = [tensors[f"{key}.{r}"] for r in range(layout["world_size"])]
        joined[key] = parts[0] if scalar else torch.cat(parts)
    return joined


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Per kind: the run dir of a checkpoint written at 2 ranks, and whether continuing from it
    equals training on (on each rank)."""
    dirs = {kind: str(tmp_path_factory.mktemp(f"written-{kind}")) for kind in KINDS}
    return dirs, spawn(_write_and_continue, 2, dirs, timeout=100)


@pytest.mark.timeout(120)
def test_continuing_from_a_checkpoint_at_2_ranks_is_bitwise_training_on(written):
    """ZeRO-2, ZeRO-3, torch's ZeRO-1 and FSDP: MORE AdamW steps after loading the checkpoint leave every
    rank's parameters and optimizer state bitwise where MORE steps straight on leave them."""
    assert written[1] == [{kind: True for kind in KINDS}] * 2


@pytest.mark.timeout(200)
def test_a_checkpoint_written_at_2_ranks_loads_at_1_and_3_unchanged(written, tmp_path):
    """Loaded at 1 and at 3 ranks and written again, every tensor is what the 2 ranks wrote,
    bitwise (ZeRO's shards joined whole: they are cut elsewhere), AdamW's per-parameter (ZeRO:
    per-shard) `step` included, which is STEP."""
    dirs = written[0]
    saved = {kind: whole(_checkpoint(d)) for kind, d in dirs.items()}
    for kind, tensors in saved.items():
        steps = [v for k, v in tensors.items() if k.endswith(".step")]
        assert steps and all(float(s) == STEP for s in steps), (kind, steps)
    for m in (1, 3):
        new = {kind: str(tmp_path / f"{kind}-at-{m}") for kind in KINDS}
        spawn(_load_then_write, m, dirs, new, timeout=100)
        for kind, tensors in saved.items():
            again = whole(_checkpoint(new[kind]))
            assert again.keys() == tensors.keys()
            assert all(torch.equal(again[k], v) for k, v in tensors.items()), (m, kind)


def _zero3_save_and_load(rank, n, run_dir):
    """ZeRO-3 at n ranks: a step, a save, and a load into a fresh run, every all-gather of a unit
    counted in both syncs. Returns (those gathers, the bytes the loaded run's units then hold,
    whether its parameters and state are the saved run's, the saved run's parameters whole)."""
    run, again = _fresh(rank, n, "ring-zero3"), _fresh(rank, n, "ring-zero3")
    _steps(rank, run, range(1))
    gathers = []
    for sync in (run[0], again[0]):
        sync._all_gather = _counting(sync._all_gather, gathers)
    _save(run, run_dir)
    sharded_checkpoint.load(sharded_checkpoint.resume(_cfg(n), str(run_dir), "auto", n, log=print),
                            again[0], again[1], again[3])
    counted = len(gathers)  # (what follows gathers on purpose, to compare)
    held = [flat.untyped_storage().nbytes() for flat in again[0].flats]
    same = all(torch.equal(a, b) for a, b in zip(_state(run), _state(again)))
    with run[0].unsharded():
        params = {name: p.tolist() for name, p in run[1].named_parameters()}  # (no shared fd)
    run[0].close(), again[0].close()
    return counted, held, same, params


def _counting(fn, calls: list):
    def counted(*args, **kwargs):
        calls.append(args)
        return fn(*args, **kwargs)
    return counted


@pytest.mark.timeout(120)
def test_a_zero3_checkpoint_gathers_nothing_and_holds_each_parameter_once(tmp_path):
    """Saved and loaded at 2 ranks without one unit gathered (the loaded run's units stay freed
    until its first forward) and bitwise what was saved; the checkpoint holds each unit's shards
    (`param.<unit>.<rank>`, as long as `comm.shard` cuts them) and no parameter whole, and
    read_whole puts every parameter back together as the ranks held it."""
    got = spawn(_zero3_save_and_load, 2, str(tmp_path), timeout=100)
    assert [(gathers, set(held), same) for gathers, held, same, _ in got] == [(0, {0}, True)] * 2
    read = sharded_checkpoint.read_whole(_checkpoint(tmp_path))
    tensors, layout, params = read["tensors"], read["layout"], got[0][3]
    assert not any(k.startswith("model.") for k in sharded_checkpoint.Shards(
        _checkpoint(tmp_path)).metadata)  # (the model has no buffers: nothing else is whole)
    from ddp_lab.sync.zero_checkpoint import shard_ranges
    for u, bucket in enumerate(layout["buckets"]):
        assert [tensors[f"param.{u}.{r}"].numel() for r in range(2)] == \
            [e - s for s, e in shard_ranges(bucket["numel"], 2)]
    assert sorted(layout["params"]) == sorted(params)
    assert all(torch.equal(tensors[f"model.{name}"], torch.tensor(p)) for name, p in params.items())


def _load_an_older_zero3_layout(rank, n):
    sync, model, _, opt = _fresh(rank, n, "ring-zero3")
    try:  # the layout of a ZeRO-3 checkpoint from before its parameters were sharded: no params
        sync.load_state_shards(model, opt, SimpleNamespace(path="old"), {"buckets": [],
                                                                          "state": []})
    except ConfigError as e:
        return str(e)
    finally:
        sync.close()


def test_a_zero3_checkpoint_of_the_older_format_is_refused_in_one_line():
    said = spawn(_load_an_older_zero3_layout, 1, timeout=30)[0]
    assert said.startswith("checkpoint old holds ZeRO-3's parameters whole") and "\n" not in said


def _checkpoint(run_dir) -> str:
    return os.path.join(run_dir, f"checkpoint_step{STEP}")


def test_shard_ranges_are_where_comm_shard_cuts():
    from ddp_lab.sync.zero_checkpoint import shard_ranges

    for numel in (0, 1, 5, 10, 11, 1031):
        for n in (1, 2, 3, 4, 7):
            flat = torch.arange(numel)
            assert [flat[s:e].tolist() for s, e in shard_ranges(numel, n)] == \
                [comm.shard(flat, r, n).tolist() for r in range(n)]


# ---- damage, and another model: refused in one line, nothing changed ----------------------------

def _refusals(rank, n, run_dirs):
    """Per run dir: the ConfigError resuming from it raises (None: none)."""
    out = {}
    for name, run_dir in run_dirs.items():
        try:
            _resumed(rank, n, "ring-zero2", run_dir, wide=name == "another model")[0].close()
            out[name] = None
        except ConfigError as e:
            out[name] = str(e)
    return out


def _flip_a_byte(path):
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))


class _Exploit:
    def __reduce__(self):
        return (os.system, ("touch /tmp/ddp_lab_pwned_dcp",))


def _pickled_code(path):
    import pickle

    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(_Exploit(), f)


DAMAGE = {  # what is done to a copy of the checkpoint -> what the refusal says
    "a flipped byte in a shard": (lambda p: _flip_a_byte(os.path.join(p, "__1_0.distcp")),
                                  "is damaged: __1_0.distcp does not match the sha256"),
    "a missing shard": (lambda p: os.remove(os.path.join(p, "__0_0.distcp")),
                        "is damaged: __0_0.distcp is missing"),
    "a truncated state.pt": (lambda p: os.truncate(os.path.join(p, "state.pt"), 100),
                             "state.pt is unreadable, truncated or corrupted"),
}


@pytest.mark.timeout(120)
def test_a_damaged_checkpoint_or_another_model_is_refused_on_every_rank_and_left_as_it_is(
        written, tmp_path):
    """Copies of the ZeRO-2 run dir, each damaged as DAMAGE says, and one resumed by a model with
    a wider first convolution: one line, the same on every rank, and not a byte changed."""
    runs = {}
    for name, (do, _) in DAMAGE.items():
        runs[name] = str(tmp_path / name.replace(" ", "-"))
        shutil.copytree(written[0]["ring-zero2"], runs[name])
        do(_checkpoint(runs[name]))
    runs["another model"] = written[0]["ring-zero2"]
    before = {name: snapshot(run) for name, run in runs.items()}
    errors = spawn(_refusals, 2, runs, timeout=60)
    for name, run in runs.items():
        got = errors[0][name]
        says = DAMAGE[name][1] if name in DAMAGE else OTHER_MODEL
        assert got == errors[1][name] and says in got, (name, got)
        assert "Nothing was loaded or written" in got and "\n" not in got, got
        assert snapshot(run) == before[name], name


OTHER_MODEL = ("holds another model (0.bias: [4] there, [5] here; 0.weight: [4, 3, 3, 3] there, "
               "[5, 3, 3, 3] here; 3.weight: [10, 144] there, [10, 180] here)")


@pytest.mark.timeout(120)
def test_pickled_code_in_dcp_metadata_is_refused_and_runs_nothing(written, tmp_path):
    if os.path.exists("/tmp/ddp_lab_pwned_dcp"):
        os.remove("/tmp/ddp_lab_pwned_dcp")
    path = str(tmp_path / "checkpoint")
    shutil.copytree(_checkpoint(written[0]["ring-zero2"]), path)
    _pickled_code(path)
    with pytest.raises(ConfigError, match=r"\.metadata is unreadable.*refusing to load posix"):
        sharded_checkpoint.Shards(path)
    assert not os.path.exists("/tmp/ddp_lab_pwned_dcp")


# ---- end to end: stopped at 2 ranks, continued at 1 and 3 ---------------------------------------

# 96 samples, global batch 24 (2 x 12, 1 x 24, 3 x 8): 4 steps an epoch; SGD, dropout off.
RESHARD = [a for a in NO_DROPOUT if not a.startswith(("data.num_samples", "train.batch_size"))] + [
    "sync=ring", "sync.zero=2", "data.num_samples=96", "train.max_steps=4",
    "train.checkpoint_every=2"]
BATCH = {1: 24, 2: 12, 3: 8}


@background(cost=30)
def resharded(directory):
    """(the uninterrupted 1-rank run, {n: the 2-rank run stopped at step 2 and continued at n
    ranks} for n = 1 and 3)."""
    def launch(n, run, *extra):
        check(ranks(RESHARD + [f"train.batch_size={BATCH[n]}", f"hydra.run.dir={run}", *extra],
                    nproc=n if n > 1 else 0, timeout=180))

    ref, stopped = directory / "one-rank", directory / "stopped"
    launch(1, ref)
    launch(2, stopped, "train.stop_at_step=2")
    runs = {}
    for n in (1, 3):
        runs[n] = directory / f"continued-at-{n}"
        shutil.copytree(stopped, runs[n])
        launch(n, runs[n])
    return ref, runs


@pytest.mark.timeout(400)
@pytest.mark.parametrize("n", [1, 3])
def test_a_2_rank_zero2_run_continues_at_another_world_size(n, resharded):
    ref, runs = resharded
    assert f"resumed from {runs[n]}/checkpoint_step2 at step 2" in train_log(runs[n])
    info = json.loads((runs[n] / "run_info.json").read_text())  # both segments' records kept
    assert [e["run"]["world_size"] for e in info["earlier"]] == [2]
    assert (info["run"]["world_size"], info["run"]["start_step"]) == (n, 2)
    got, want = training_state(runs[n]), training_state(ref)
    assert got["step"] == want["step"] == 4
    model = [k for k in want["tensors"] if k.startswith("model.")]
    diff = max((got["tensors"][k].double() - want["tensors"][k].double()).abs().max().item()
               for k in model)
    assert diff < 1e-6, diff


def _dirs(run_dir, names, marker=None):
    for name in names:
        os.makedirs(run_dir / name)
        (run_dir / name / "which").write_text(marker or name)


@pytest.mark.parametrize("keep_every, left", [(0, ["checkpoint_step4"]),
                                              (2, ["checkpoint_step4", "checkpoint_step2"])])
def test_a_save_removes_an_earlier_runs_later_checkpoints(tmp_path, keep_every, left):
    """A run started over (train.resume=never) saves step 4 where an earlier run left step 6:
    the next resume must pick step 4, this run's, so step 6 goes; the earlier steps as always."""
    _dirs(tmp_path, ["checkpoint_step2", "checkpoint_step4", "checkpoint_step6"])
    sharded_checkpoint._prune(str(tmp_path), 4, keep_every)
    assert [os.path.basename(p) for p in sharded_checkpoint.candidates(str(tmp_path))] == left


@pytest.mark.parametrize("present, kept", [((".tmp", ".old"), ".tmp"), ((".old",), ".old"),
                                           ((".tmp",), None)])
def test_a_kill_between_the_two_renames_loses_no_checkpoint(tmp_path, present, kept):
    """_replace_dir moves the step's old directory to .old, then the complete .tmp into place:
    killed between the two, the start's clean-up makes .tmp the checkpoint (.old where .tmp went
    too). A .tmp alone is a save killed while writing: removed, as before."""
    _dirs(tmp_path, [f"checkpoint_step4{suffix}" for suffix in present])
    sharded_checkpoint.clean_stale_temporaries(str(tmp_path))
    final = tmp_path / "checkpoint_step4"
    assert sorted(os.listdir(tmp_path)) == (["checkpoint_step4"] if kept else [])
    if kept:
        assert (final / "which").read_text() == f"checkpoint_step4{kept}"
