"""The dry run (ddp_lab/dry_run.py): one step's communication of every rank of a large world, on
torch's fake backend in this process, against the performance model (comm.cost() in total and
rank by rank, the memory prediction) and the arithmetic of ZeRO's shards.

Sizes: what the counts depend on is the world size against each bucket's element count (chunk
rounding: N divides none of these buckets), whether N is a power of two (the tree's last level is
partial otherwise), the bucket plan (several buckets, uneven) and, for the ring, whether a chunk is
cut into slices (not from N of about 5 on, here, as at N=1024). A few hundred ranks exercise all
of them, as N=1024 does, in seconds: the ring posts 2(N-1) messages a bucket on every rank, so the
whole run grows as N^2 (2-4 s at N=256 on a shared 2-core host, minutes at 1024); the tree's
2 log2 N (N=300 here). ZeRO-3 runs a forward and backward a rank (about 0.1 s), so 12 ranks.
The model is AlexNet-CIFAR with an 8-wide classifier (2.26 M parameters: small buffers, the same 16
parameter tensors, 8 modules that own them: ZeRO-3's units).
"""

from __future__ import annotations

import json

import pytest
import torch

from ddp_lab import comm
from ddp_lab.cli import compose
from ddp_lab.dry_run import dry_run, fake_group, run
from ddp_lab.errors import ConfigError

SMALL = ["model.fc_width=8"]


def counted(*overrides: str) -> dict:
    return dry_run(compose([*SMALL, *overrides], "dry_run"))


def ring_rounding_ok(out: dict) -> bool:
    """The busiest rank's bytes within the rings' rounding bound of the model's (comm/ring.py:
    under 2 elements a collective a level of rings, and the bound sums them)."""
    return abs(out["max_rank_bytes"] - out["predicted_max_rank_bytes"]) < out["rounding_bound_bytes"]


def bytes_off_model(out: dict) -> float:
    """The most any rank's counted bytes differ from the model's figure for that rank."""
    return max(abs(r["bytes_sent"] - r["predicted_bytes_sent"]) for r in out["per_rank"])


def messages_as_modelled(out: dict) -> bool:
    return all(r["messages"] == r["predicted_messages"] for r in out["per_rank"])


@pytest.mark.timeout(120)
def test_ring_at_256_ranks_sends_what_comm_cost_says():
    # one bucket of 2,259,946 elements (not a multiple of 256): chunks cut unevenly
    out = counted("world_size=256", "sync=ring", "sync.bucket_mb=100")
    assert out["device"] == "cpu" and out["ranks_run"] == 256
    assert out["total_bytes"] == out["predicted_total_bytes"]  # exactly 2(N-1)S
    assert ring_rounding_ok(out), out
    # every rank: its messages the model's, its bytes within the rounding of the model's
    assert messages_as_modelled(out)
    assert 0 < bytes_off_model(out) < out["rounding_bound_bytes"]
    assert out["max_bytes_off_model"] == bytes_off_model(out) and out["messages_as_predicted"]
    # every rank keeps the scratch comm.scratch_numel says (two slices of the largest chunk)
    assert out["scratch_as_predicted"] and out["per_rank"][0]["scratch_bytes"] > 0


@pytest.mark.timeout(60)
def test_bf16_on_the_wire_is_priced_as_it_travels_whichever_key_sets_it():
    """sync.compress=bf16 is sync.comm_dtype=bf16 under its newer name: both are counted and
    priced at 2 bytes an element (the model once priced compress=bf16 at fp32's 4: half off)."""
    old, new = (counted("world_size=8", "sync=ring", key) for key in
                ("sync.comm_dtype=bf16", "sync.compress=bf16"))
    for out in (old, new):
        assert out["comm_dtype"] == "bf16" and out["total_bytes"] == out["predicted_total_bytes"]
        assert ring_rounding_ok(out) and out["scratch_as_predicted"], out
    assert new["total_bytes"] == old["total_bytes"]


@pytest.mark.timeout(120)
def test_tree_at_300_ranks_sends_what_comm_cost_says():
    out = counted("world_size=300", "sync=tree", "sync.bucket_mb=4")  # 3 buckets, 9 levels
    assert len(out["bucket_numels"]) > 2
    assert out["total_bytes"] == out["predicted_total_bytes"]  # exactly 2(N-1)S a bucket
    assert out["max_rank_bytes"] == out["predicted_max_rank_bytes"]  # rank 0: ceil(log2 N) S
    assert out["max_rank"] == 0
    # whole tensors up and down: every rank's bytes and messages exactly the model's
    assert bytes_off_model(out) == 0 and messages_as_modelled(out)
    assert len({r["messages"] for r in out["per_rank"]}) > 2  # ranks with more children send more


@pytest.mark.timeout(120)
def test_hring_at_240_ranks_sends_what_comm_cost_says():
    # 30 nodes of 8: the node ring's chunks and the cross ring's pieces both cut unevenly
    out = counted("world_size=240", "sync=hring", "dist.node_size=8", "sync.bucket_mb=100")
    assert out["node_size"] == 8 and out["ranks_run"] == 240
    assert out["total_bytes"] == out["predicted_total_bytes"]
    assert ring_rounding_ok(out), out
    # 2(G-1) messages in the node, 2(M-1) across, as the model counts them, on every rank
    assert messages_as_modelled(out)
    assert 0 < bytes_off_model(out) < out["rounding_bound_bytes"]
    assert out["scratch_as_predicted"]  # hring's scratch, priced on its nodes before any group


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overrides, times_dp", [
    (("sync=ring", "world_size=12"), 1.5),  # the ZeRO paper's: a reduce-scatter, two gathers
    (("sync=hring", "world_size=12", "dist.node_size=4"), 1.5),
    (("sync=ring", "world_size=12", "sync.reshard_after_forward=false"), 1.0),  # one gather
])
def test_zero3_gathers_in_forward_and_backward_as_the_model_says(overrides, times_dp):
    out = counted("sync.zero=3", *overrides)
    units = len(out["bucket_numels"])  # a bucket a module with parameters: 8
    assert units == 8 and out["collectives"].count("reduce_scatter") == units
    assert out["collectives"].count("all_gather") == units * (2 if times_dp == 1.5 else 1)
    assert out["total_bytes"] == out["predicted_total_bytes"]  # every half moves (N-1)S
    assert out["predicted_total_bytes"] == times_dp * out["allreduce_total_bytes"]
    assert messages_as_modelled(out)
    assert 0 < bytes_off_model(out) < out["rounding_bound_bytes"]
    assert out["scratch_as_predicted"] and out["zero_shards_cover"] is True


@pytest.mark.timeout(120)
def test_zero3_runs_on_the_meta_device_too():
    """The tree's default device is meta (no scratch to count): ZeRO-3's freeing and gathering of
    units, and the sample's forward and backward, run on meta tensors as on the CPU's."""
    out = counted("sync.zero=3", "sync=tree", "world_size=12")
    assert out["device"] == "meta" and out["scratch_not_counted"] == "meta"
    assert out["collectives"].count("all_gather") == 2 * len(out["bucket_numels"]) == 16
    assert out["zero_shards_cover"] is True and messages_as_modelled(out)


@pytest.mark.parametrize("algo", ["naive", "ring", "tree", "hring"])
@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter", "all_gather"])
def test_each_ranks_model_figure_adds_up_to_comm_cost(algo, op):
    # rank_sends splits comm.cost() over the ranks: the most any rank sends is bytes_per_rank,
    # all of them together total_bytes (N | numel: 1,200 elements)
    from ddp_lab.dry_run_report import rank_sends

    for n, g in ((2, 1), (6, 3), (8, 4), (12, 4), (24, 8), (5, 5)):
        sent = [rank_sends(algo, op, 1200, 4, n, r, g)[0] for r in range(n)]
        c = comm.cost(algo, 1200 * 4, n, op, node_size=g)
        assert max(sent) == pytest.approx(c.bytes_per_rank), (n, g)
        assert sum(sent) == pytest.approx(c.total_bytes), (n, g)


@pytest.mark.timeout(120)
def test_zero_shards_at_1024_ranks_cover_every_element_once():
    out = counted("world_size=1024", "sync=tree", "sync.zero=2", "sync.bucket_mb=100",
                  "sync.overlap=false")
    assert out["zero_shards_cover"] is True
    numel = out["bucket_numels"][0]
    sizes = [r["shards"][0][1] - r["shards"][0][0] for r in out["per_rank"]]
    assert sum(sizes) == numel and max(sizes) - min(sizes) == 1  # tensor_split's: the larger first


def test_shards_cover_finds_a_gap_and_an_overlap():
    from ddp_lab.dry_run_report import shards_cover

    rows = lambda *pieces: [{"shards": [list(p)]} for p in pieces]
    assert shards_cover(rows((0, 3), (3, 5)), [5], 2) is True
    assert shards_cover(rows((0, 3), (4, 5)), [5], 2) is False  # element 3 nowhere
    assert shards_cover(rows((0, 3), (2, 5)), [5], 2) is False  # element 2 twice
    assert shards_cover(rows((0, 3)), [5], 2) is None  # not every rank ran


def test_naive_root_scratch_over_the_device_is_refused_with_the_arithmetic():
    # AlexNet-CIFAR's largest bucket: 16,777,216 fp32 elements = 67,108,864 B, 1023 of them
    with pytest.raises(ConfigError, match=r"^sync=naive at world_size=1024: rank 0 .* 1023 x "
                                          r"67108864 B = 68\.7 GB > dry_run\.device_gb=16;"):
        dry_run(compose(["world_size=1024", "sync=naive", "dry_run.device_gb=16"], "dry_run"))


@pytest.mark.parametrize("overrides, says", [
    (["world_size=0"], "world_size=0 must be >= 1"),
    (["sync=ddp"], "sync=ddp: the dry run counts the messages of our collectives"),
    (["dry_run.ranks=[0,8]"], "dry_run.ranks=[0,8]: each rank once, from 0 to world_size-1=7 "
                              "(8 is not)"),
    (["dry_run.ranks=[1,1]"], "dry_run.ranks=[1,1]: each rank once"),
    (["sync=hring", "dist.node_size=3"], "dist.node_size=3 does not divide the world size 8"),
    (["dist.node_size=4", "dist.link.gbps=10"], "dist.link delays messages, and the dry run"),
    (["sync.compress=powersgd"], "sync.compress=powersgd: the dry run checks bytes against"),
    # AlexNet (61.1 M parameters, 0.24 GB in fp32) with SGD's momentum, unsharded
    (["model=alexnet", "dry_run.device_gb=0.5"],
     "rank 0 would hold 0.99 GB > dry_run.device_gb=0.5: params 0.24 + grads 0.24 + optimizer "
     "state 0.24 + comm buffer 0.24 + comm scratch 0.01 GB (activations on top)"),
])
def test_layouts_that_cannot_exist_are_refused_in_one_line(overrides, says):
    with pytest.raises(ConfigError) as e:
        dry_run(compose(overrides, "dry_run"))
    assert str(e.value).startswith(says) and "\n" not in str(e.value)


@pytest.mark.timeout(60)
def test_run_writes_the_contract_and_prints_the_table(tmp_path, capsys):
    run(compose([*SMALL, "world_size=6", "sync=ring", "sync.zero=1", "dry_run.ranks=[0,5]"],
                "dry_run"), str(tmp_path))
    out = json.loads((tmp_path / "dry_run.json").read_text())
    for k in ("world_size", "sync", "total_bytes", "predicted_total_bytes", "max_rank_bytes",
              "predicted_max_rank_bytes", "per_rank"):
        assert k in out
    assert [r["rank"] for r in out["per_rank"]] == [0, 5]
    assert set(out["per_rank"][0]) >= {"rank", "bytes_sent", "messages", "scratch_bytes",
                                       "predicted_bytes_sent", "predicted_messages"}
    # a subset of ranks: the busiest rank still within the model's rounding; shards unchecked
    assert ring_rounding_ok(out) and out["zero_shards_cover"] is None
    printed = capsys.readouterr().out
    assert "tensor values mean nothing on the fake backend" in printed
    assert "bytes, busiest rank:" in printed and "dry_run.json" in printed
    assert "model_bytes" in printed and "model_messages" in printed


def fast_and_not(*overrides: str) -> tuple[list, list]:
    """Each rank's counts (bytes, messages, scratch, ZeRO's shards), with the dry run's shortcuts
    and without: torch's batch_isend_irecv per message, buffers of each rank's own."""
    cfg = compose([*SMALL, "sync.bucket_mb=1", *overrides], "dry_run")  # several buckets
    rows = lambda out: [(r["rank"], r["bytes_sent"], r["messages"], r["scratch_bytes"],
                         r.get("shards")) for r in out["per_rank"]]
    return rows(dry_run(cfg)), rows(dry_run(cfg, fast=False))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overrides", [
    ("sync=ring", "world_size=12"),  # chunks cut unevenly
    ("sync=tree", "world_size=12"),  # on meta tensors; a partial last level
    ("sync=hring", "world_size=12", "dist.node_size=4"),  # subgroups
    ("sync=ring", "world_size=6", "sync.zero=2"),  # ZeRO-2's pooled buffers, the gather
    ("sync=ring", "world_size=6", "sync.zero=3"),  # forward and backward, a model a rank
])
def test_the_shortcuts_count_what_torch_fake_backend_counts(overrides):
    fast, real = fast_and_not(*overrides)
    assert fast == real


def test_a_planted_miscount_fails_the_comparison(monkeypatch):
    # The shortcut most likely to go wrong: buffers lent by size. One element too many a bucket
    # moves the ring's chunk boundaries, so some ranks' bytes, and the comparison must see it.
    import ddp_lab.dry_run as dr

    transport, _ = dr.shortcuts()
    longer = lambda sizes: dr.new_buffers([(n + 1, dtype, dev) for n, dtype, dev in sizes])
    monkeypatch.setattr(dr, "shortcuts", lambda: (transport, longer))
    fast, real = fast_and_not("sync=ring", "world_size=12")
    assert fast != real and [r[2] for r in fast] == [r[2] for r in real]  # bytes, not messages


def test_cpu_and_meta_count_alike():
    common = ("world_size=5", "sync=tree", "sync.zero=1", "sync.bucket_mb=1")
    on_cpu, on_meta = counted(*common, "dry_run.device=cpu"), counted(*common, "dry_run.device=meta")
    keep = lambda out: [(r["bytes_sent"], r["messages"]) for r in out["per_rank"]]
    assert keep(on_cpu) == keep(on_meta)
    assert on_cpu["scratch_as_predicted"] is True and on_meta["scratch_as_predicted"] is None


def test_scratch_not_counted_on_meta_says_why_in_one_word():
    from ddp_lab.dry_run_report import report

    out = counted("world_size=4", "sync=tree")  # auto: meta for the tree
    assert out["device"] == "meta" and out["scratch_not_counted"] == "meta"
    assert {r["scratch_bytes"] for r in out["per_rank"]} == {None}
    lines = report(out).splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("rank "))
    column = lines[head].split().index("scratch_B")
    assert {line.split()[column] for line in lines[head + 2:head + 6]} == {"meta"}  # 4 ranks
    assert counted("world_size=4", "sync=ring")["scratch_not_counted"] is None  # cpu: counted


def test_nested_recorders_each_count_and_leave_as_they_came():
    # Recorders with equal counts are still two: the inner one's exit must not remove the outer
    with fake_group(0, 2):
        channel = comm.Channel("ring")
        with comm.recording() as outer:
            with comm.recording():
                pass
            channel.post(0, sends=[(1, torch.ones(4), None)]).wait()
    assert (outer.bytes_sent, outer.messages) == (16, 1)
