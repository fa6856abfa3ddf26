"""ZeRO's sharded checkpoints (sync.zero=1|2|3): what each rank's tensors are, and how a rank at
another world size cuts its own shards back out of them. ddp_lab/sharded_checkpoint.py writes
and reads the files (DCP); ShardedSync (zero.py) takes these methods from `ShardCheckpointing`.

    state_shards       the tensors every rank holds whole (`model.<name>`, DCP writes each once),
                       this rank's shard of each bucket's optimizer state, `optim.<bucket>.<state>.
                       <rank>`, and at ZeRO-3 of its parameters, `param.<unit>.<rank>`; the layout
                       (plain data, in state.pt) says where each rank's shard lies in its bucket
    load_state_shards  at M ranks the buckets are the same and only the cuts move: a rank reads
                       the saved shards that overlap its new one and cuts it out of them
"""

from __future__ import annotations

import torch

from ddp_lab.errors import ConfigError


class ShardCheckpointing:
    """ShardedSync's checkpoints (it has rank, world_size, stage, shards and flats); ZeRO-3
    overrides `_whole_entries`, `_param_shards` and `_layout`."""

    def state_shards(self, model, optimizer) -> tuple[dict, dict]:
        """The model's tensors every rank holds whole (DCP writes each once), this rank's shard
        of each bucket's optimizer state under a key of its own, `optim.<bucket>.<state>.<rank>`
        (and at ZeRO-3 of its parameters, `_param_shards`); the layout says where each rank's
        shard lies in its bucket (the offsets map) and which state there is."""
        tensors = {f"model.{k}": v for k, v in self._whole_entries(model).items()}
        tensors |= {f"{key}.{self.rank}": t for (_, key), t in self._param_shards().items()}
        return tensors | self._optimizer_shards(optimizer), self._layout(model, optimizer)

    def _whole_entries(self, model) -> dict:
        """The model's tensors as every rank holds them: all of them (ZeRO-3: not its units')."""
        return model.state_dict()

    def _param_shards(self) -> dict[tuple[int, str], torch.Tensor]:
        """(bucket, key) -> this rank's shard of parameters it holds in shards: none (ZeRO-3's)."""
        return {}

    def _optimizer_shards(self, optimizer) -> dict:
        return {f"optim.{b}.{key}.{self.rank}": optimizer.state[shard][key]
                for b, shard in enumerate(self.shards) for key in self._state_keys(optimizer)}

    def _layout(self, model, optimizer) -> dict:
        buckets = [{"numel": flat.numel(), "shards": shard_ranges(flat.numel(), self.world_size)}
                   for flat in self.flats]
        return {"world_size": self.world_size, "buckets": buckets,
                "state": self._state_keys(optimizer)}

    def _state_keys(self, optimizer) -> list[str]:
        """The optimizer's state per shard (momentum_buffer; exp_avg, exp_avg_sq, step): the
        same for every shard; none before its first step."""
        return sorted(optimizer.state[self.shards[0]]) if self.shards else []

    def load_state_shards(self, model, optimizer, shards, layout: dict) -> None:
        """The tensors every rank holds whole, and this rank's shard of each bucket's state (and
        ZeRO-3's parameters) cut out of the saved shards it overlaps (at any world size the
        buckets are the same; only where they are cut moves)."""
        params = self._param_shards()
        if params and "params" not in layout:
            raise ConfigError(f"checkpoint {shards.path} holds ZeRO-3's parameters whole, as "
                              "ZeRO-3 checkpoints did before they were sharded: resume it with "
                              "the code that wrote it, or start afresh (train.resume=never)")
        whole = {f"model.{k}": v for k, v in self._whole_entries(model).items()}
        keys = self._optimizer_keys(layout) | {where: False for where in params}
        mine = self._read_shards(shards, layout, whole, keys)
        with torch.no_grad():
            for where, shard in params.items():
                shard.copy_(mine[where])
        self._load_optimizer(optimizer, mine, layout)

    def _optimizer_keys(self, layout: dict) -> dict[tuple[int, str], bool]:
        """(bucket, `optim.<bucket>.<state>`) -> whether it is a per-shard value (`step`)."""
        return {(b, f"optim.{b}.{key}"): key in SCALARS
                for b in range(len(layout["buckets"])) for key in layout["state"]}

    def _read_shards(self, shards, layout: dict, whole: dict, keys: dict) -> dict:
        """Collective, one read: `whole` (key -> tensor, filled in place), and for each sharded
        key (`keys`: (bucket, key) -> per-shard value?) this rank's shard of it, cut out of the
        saved shards `<key>.<rank>` that overlap it (a per-shard value: rank 0's, the same in
        every shard). Returns (bucket, key) -> tensor."""
        if [b["numel"] for b in layout["buckets"]] != [f.numel() for f in self.flats]:
            cut = "units (another model)" if self.stage == 3 else \
                "buckets (another model or sync.bucket_mb)"
            raise ConfigError(f"checkpoint {shards.path}: its {cut} are not this run's: nothing "
                              "was loaded")
        wanted, request = {}, dict(whole)  # (bucket, key) -> (this rank's range, the pieces)
        for (b, key), scalar in keys.items():
            mine = shard_ranges(layout["buckets"][b]["numel"], self.world_size)[self.rank]
            wanted[b, key] = mine, [(f"{key}.{r}", where)
                                    for r, where in enumerate(layout["buckets"][b]["shards"])
                                    if (r == 0 if scalar else _overlap(where, mine))]
            request.update({name: shards.empty(name) for name, _ in wanted[b, key][1]})
        shards.read(request)
        return {(b, key): request[pieces[0][0]] if keys[b, key] else
                _cut([(request[name], where) for name, where in pieces], mine,
                     shards.dtype(f"{key}.0"))
                for (b, key), (mine, pieces) in wanted.items()}

    def _load_optimizer(self, optimizer, mine: dict, layout: dict) -> None:
        state = {b: {key: mine[b, f"optim.{b}.{key}"] for key in layout["state"]}
                 for b in range(len(self.shards))}
        optimizer.load_state_dict({"state": state,
                                   "param_groups": optimizer.state_dict()["param_groups"]})


def _overlap(a: list[int], b: list[int]) -> bool:
    return max(a[0], b[0]) < min(a[1], b[1])


def _cut(pieces: list[tuple[torch.Tensor, list[int]]], mine: list[int], dtype) -> torch.Tensor:
    """Elements [start, stop) of a flat tensor, from `pieces`: (a part of it, where that lies)."""
    out = torch.empty(mine[1] - mine[0], dtype=dtype)
    for piece, (s, e) in pieces:
        lo, hi = max(s, mine[0]), min(e, mine[1])
        out[lo - mine[0]:hi - mine[0]] = piece[lo - s:hi - s]
    return out


def shard_ranges(numel: int, world_size: int) -> list[list[int]]:
    """Where each rank's shard (`comm.shard`: torch.tensor_split's pieces) lies in `numel`
    elements: [start, stop) per rank, the first numel % world_size one element longer."""
    size, longer = divmod(numel, world_size)
    starts = [r * size + min(r, longer) for r in range(world_size + 1)]
    return [[starts[r], starts[r + 1]] for r in range(world_size)]


# Optimizer state with one value per parameter (per shard here), not one per element.
SCALARS = ("step",)
