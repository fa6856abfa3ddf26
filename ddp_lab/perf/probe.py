"""The interference probe's result, as the model reads it: measured on its own at one world size
(ddp_lab/scale/interfere.py runs it; not fitted to the sweep it helps predict).

Each round of the probe runs every condition once, on every rank (see interfere.py): `solo` (rank
0 computes a step alone), `all` (every rank computes, nothing sent), and per algorithm `comm`
(the sync's bucket collectives alone), `bwd+comm` (backward with them beside it), `comm+bwd`
(them with backward beside them). `derive` turns every rank's rounds into, from rank 0's medians
(the training loop reports rank 0's):

    contention[phase]  all / solo                          (k_phase of ddp_lab/perf/predict.py)
    skew[...]          slowest rank / rank 0 - 1, per round (stragglers)
    store_ms           one c10d store round trip (the loop's heartbeat)
    grad_ready         each gradient's readiness: the fraction of backward done when produced
    <algo>:
      bucket_ms          each bucket's [pack, all-reduce, unpack] alone: the model's price of it
      local_s_per_byte   packing and unpacking, per byte
      compute_slowdown   backward in bwd+comm / in all          (Interference.compute)
      comm_slowdown      all-reduces in comm+bwd / in comm      (Interference.comm)

`Probe` holds one result, or several pooled (their rounds together, derived again).
"""

from __future__ import annotations

import copy
import json
import os
import statistics

from ddp_lab.perf.params import NO_INTERFERENCE, Interference

PHASES = ("forward", "backward", "guard", "optim")  # the probe's timed phases of one step
# The all-reduce timings of an algorithm: its world size's own, never carried to another.
TIMED_AT_N = ("bucket_ms", "comm_ms", "comm_loaded_ms")
NAN = float("nan")


def _med(values) -> float:
    values = [v for v in values if v == v]
    return statistics.median(values) if values else float("nan")


def derive(every: list[list[dict]], sizes: dict[str, list[int]], n_params: int) -> dict:
    """Contention, skew, slowdowns and per-bucket times (see the module) from every rank's
    rounds (`every[rank]`; rank 0's medians, as the loop reports its own); `sizes`: each
    algorithm's bucket bytes. Rounds of several probes pool (`Probe.load`)."""
    rounds = every[0]
    med = lambda cond, key: _med(r[cond].get(key, float("nan")) for r in rounds)
    contention = {ph: med("all", ph) / med("solo", ph) for ph in PHASES}
    step = lambda cond: _med(sum(r[cond][ph] for ph in PHASES) for r in rounds)
    contention["step"] = step("all") / step("solo")
    # Stragglers: a collective waits for the slowest rank. From the guard's all-reduce to the
    # step's gradient all-reduces each rank runs optim, forward and backward on its own.
    seg = lambda r: sum(r["all"][ph] for ph in ("optim", "forward", "backward"))
    per_round = list(zip(*every))  # (rank 0's round i, rank 1's round i, ...)
    skew = {"backward": _med(max(seg(r) for r in rs) / seg(rs[0]) - 1 for rs in per_round),
            "guard": _med(max(r["all"]["guard"] for r in rs) / rs[0]["all"]["guard"] - 1
                          for rs in per_round)}
    out = {"solo_ms": {ph: med("solo", ph) for ph in PHASES},
           "all_ms": {ph: med("all", ph) for ph in PHASES},
           "contention": contention, "skew": skew, "store_ms": med("all", "store"),
           "grad_ready": [_med(r["ready"][i] for r in rounds) for i in range(n_params)]}
    for algo, bucket_bytes in sizes.items():
        out[algo] = _derive_algo(rounds, algo, bucket_bytes, med("all", "backward"),
                                 med("all", "forward"))
    return out


def _derive_algo(rounds: list[dict], algo: str, bucket_bytes: list[int], backward_ms: float,
                 forward_ms: float) -> dict:
    alone = [sum(sum(x) for x in r[f"{algo}/comm"]) for r in rounds]
    loaded = [sum(sum(x) for x in r[f"{algo}/comm+bwd"]) for r in rounds]
    per_bucket = [[_med(r[f"{algo}/comm"][i][j] for r in rounds) for j in range(3)]
                  for i in range(len(bucket_bytes))]
    local = sum(p + u for p, _, u in per_bucket)
    under = lambda ph: _med(r[f"{algo}/bwd+comm"][ph] for r in rounds)
    return {"bucket_bytes": bucket_bytes, "comm_ms": _med(alone), "comm_loaded_ms": _med(loaded),
            "bucket_ms": per_bucket,  # [pack, all-reduce, unpack] per bucket, alone
            "local_s_per_byte": local * 1e-3 / max(1, sum(bucket_bytes)),
            "compute_slowdown": under("backward") / backward_ms,
            "forward_slowdown": under("forward") / forward_ms,
            "comm_slowdown": _med(loaded) / _med(alone)}


class Probe:
    """An interference probe's result (interfere.py's OUT.json), or several pooled: their rounds
    together, derived again (sweeps with repeats run one probe per repeat)."""

    def __init__(self, result: dict, path: str = ""):
        self.path, self.raw = path, result
        d = result["derived"]
        self.world_size = int(result["world_size"])
        self.rounds = int(result.get("rounds", 0))
        self.contention = {k: v for k, v in d["contention"].items() if v == v}
        self.algos = {k: v for k, v in d.items() if isinstance(v, dict) and "comm_ms" in v}
        self.store_ms = float(d.get("store_ms", 0.0))
        self.skew = {k: max(0.0, v) for k, v in d.get("skew", {}).items() if v == v}
        self.other_cores = float(result.get("other_cores", NAN))
        self.numels = result.get("param_numels", [])
        self.ready = d.get("grad_ready", [])

    @classmethod
    def load(cls, *paths: str) -> "Probe":
        results = []
        for path in paths:
            with open(path) as f:
                results.append(json.load(f))
        if len(results) == 1:
            return cls(results[0], paths[0])
        every = [[r for res in results for r in res["samples"][rank]]  # per rank, pooled
                 for rank in range(len(results[0]["samples"]))]
        sizes = {a: v["bucket_bytes"] for a, v in results[0]["derived"].items()
                 if isinstance(v, dict) and "bucket_bytes" in v}
        pooled = {**results[0], "rounds": len(every[0]), "samples": every,
                  "derived": derive(every, sizes, len(results[0]["param_numels"]))}
        return cls(pooled, ", ".join(paths))

    def lent(self) -> "Probe":
        """This probe, for a point at a world size that was not probed (predict.from_nproc):
        contention, skew, slowdowns, readiness, the store round trip and the packing rate as
        measured here (assumed not to change with N), without its all-reduce timings, which are
        this world size's: the model then prices every bucket with the fit at the point's N."""
        out = copy.copy(self)
        out.algos = {a: {k: v for k, v in d.items() if k not in TIMED_AT_N}
                     for a, d in self.algos.items()}
        return out

    def k(self, phase: str) -> float:
        return self.contention.get(phase, 1.0)

    def interference(self, algo: str) -> Interference:
        a = self.algos.get(algo)
        if a is None:
            return NO_INTERFERENCE
        # A slowdown below 1 is noise (nothing runs faster for sharing): floor it.
        return Interference(max(1.0, a["compute_slowdown"]), max(1.0, a["comm_slowdown"]))

    def grads(self) -> list[tuple[int, float]] | None:
        """(numel, ready fraction) in backward order, where readiness was measured (CPU)."""
        if not self.ready or len(self.ready) != len(self.numels) or any(
                f != f for f in self.ready):
            return None
        return list(zip(self.numels, self.ready))[::-1]


def load_probes(paths: dict[str, list[str]]) -> dict:
    """{key: Probe} pooled over each key's paths that exist (a failed probe leaves none)."""
    out = {}
    for key, ps in paths.items():
        ps = [p for p in ps if p and os.path.exists(p)]
        if ps:
            out[key] = Probe.load(*ps)
    return out
