"""The derivations a figure names in its manifest: each takes the rows of the figure's raw files
(`ddp_lab.results.raw`) and keyword arguments, and returns a number or a tuple of numbers.

Where a benchmark already computed a figure and wrote it into its row (train_throughput's
`ratio_paired` with `ratio_lo`..`ratio_hi`, a sweep's `pred_err_pct`), the figure reads that
column (`value`, `row_values`): the benchmark's own arithmetic. The rest are the few statistics
the results pages use, written once: a median with its range, a ratio of two selections of one
run, a derivation done run by run (ratios paired by run, a peak per run), a bootstrap interval,
counts. Selections are `where` dicts
(`{"precision": "bf16", "channels_last": true}`; a list means any of its values). A column that
holds a list (a benchmark's per-repeat `ratios`) or a string of numbers (a sweep's
`efficiency_passes`) contributes every number in it.
"""

from __future__ import annotations

import random
import re
import statistics

from ddp_lab.results.raw import get, matches, select

# The storages a summary.json's `memory` block counts per rank (ddp_lab/summary.py).
MEMORY_KINDS = ("params_bytes", "grads_bytes", "optimizer_state_bytes", "comm_buffer_bytes")


def _one(rows: list[dict], where: dict | None, columns: tuple[str, ...] = ()) -> dict:
    """The one row matching `where` among those that have `columns` (a report's tables share
    keys such as `N`; the column names the table)."""
    chosen = [r for r in select(rows, where) if all(_has(r, c) for c in columns)]
    if len(chosen) != 1:
        raise LookupError(f"{len(chosen)} rows with {list(columns)} match {where}, expected one")
    return chosen[0]


def _has(row: dict, column: str) -> bool:
    try:
        get(row, column)
    except KeyError:
        return False
    return True


def _numbers(value) -> list[float]:
    if isinstance(value, list):
        return [float(x) for x in value]
    if isinstance(value, str):
        return [float(x) for x in value.split()]
    return [float(value)]


def _pooled(rows: list[dict], column: str, where: dict | None) -> list[float]:
    """Every number of the column over the matching rows that have it (a log's other lines
    lack it)."""
    chosen = [r for r in select(rows, where) if _has(r, column)]
    if not chosen:
        raise LookupError(f"no row matching {where} has {column!r}")
    return [x for row in chosen for x in _numbers(get(row, column))]


def _spread(xs: list[float]) -> tuple:
    """(median, min, max, n): how a timing or a ratio over repeats is printed."""
    return statistics.median(xs), min(xs), max(xs), len(xs)


def _captured(rows: list[dict], pattern: str) -> list[float]:
    """The number each log line matching `pattern` captures in its first group, in order."""
    return [float(m.group(1)) for row in rows if "line" in row
            for m in [re.search(pattern, row["line"])] if m]


def value(rows: list[dict], column: str, where: dict | None = None) -> float:
    """The column of the one row matching `where`."""
    return get(_one(rows, where, (column,)), column)


def row_values(rows: list[dict], columns: list[str], where: dict | None = None,
               unit: float = 1) -> tuple:
    """Several columns of the one row matching `where`, in order (a table row), each divided by
    `unit` (1e6: bytes as MB)."""
    row = _one(rows, where, tuple(columns))
    return tuple(get(row, c) / unit if unit != 1 else get(row, c) for c in columns)


def throughput_row(rows: list[dict], where: dict | None = None) -> tuple:
    """A `ddp_lab.bench.train_throughput` row as its tables print it: (ddp_lab img/s, bare img/s,
    the median of the repeats' own loop / bare ratios, their min, their max, repeats, steps)."""
    row = _one(rows, where)
    return (row["ddp_img_s"], row["bare_img_s"], row["ratio_paired"], row["ratio_lo"],
            row["ratio_hi"], len(row["ratios"]), row["steps"])


def ratio(rows: list[dict], column: str, num: dict, den: dict) -> float:
    """column of the row `num` over column of the row `den`: two rows of one run side by side."""
    return value(rows, column, num) / value(rows, column, den)


def column_values(rows: list[dict], column: str, wheres: list[dict]) -> tuple:
    """The column of one row per selection, in order (a figure that prints several rows)."""
    return tuple(value(rows, column, where) for where in wheres)


def relative_change(rows: list[dict], column: str, num: dict, den: dict) -> float:
    """ratio - 1: how much the `num` row gains (or loses) over the `den` row, side by side."""
    return ratio(rows, column, num, den) - 1


def difference(rows: list[dict], column: str, num: dict, den: dict) -> float:
    """column of the row `num` minus column of the row `den` (what one setting adds)."""
    return value(rows, column, num) - value(rows, column, den)


def excess(rows: list[dict], column: str, over: str, where: dict | None = None) -> float:
    """One row's `column` minus its `over` column (measured minus predicted)."""
    measured, predicted = row_values(rows, [column, over], where)
    return measured - predicted


def shares(rows: list[dict], part: str, whole: str, where: dict | None = None) -> tuple:
    """(median, min, max, n) of part / whole within each matching row that has both (a phase's
    share of its own run's step, `time_ms.guard` of `time_ms.step`)."""
    chosen = [r for r in select(rows, where) if _has(r, part) and _has(r, whole)]
    if not chosen:
        raise LookupError(f"no row matching {where} has {part!r} and {whole!r}")
    return _spread([get(r, part) / get(r, whole) for r in chosen])


def counted_minus_predicted(rows: list[dict], block: str = "memory") -> tuple:
    """(lowest, highest) bytes counted minus predicted, over every rank's count of every field
    of every row's `block` of a summary.json (`memory`: each rank's count of each kind of storage,
    beside a prediction: one for all ranks, or one per rank as summaries now write it; a field
    not counted, None, is left out)."""
    gaps = []
    for row in rows:
        counted = row[block]
        for field, predicted in counted["predicted"].items():
            counts = counted[field]
            per_rank = predicted if isinstance(predicted, list) else [predicted] * len(counts)
            gaps += [c - p for c, p in zip(counts, per_rank) if c is not None and p is not None]
    return min(gaps), max(gaps)


def memory_row(rows: list[dict], where: dict | None = None, unit: float = 1e6) -> tuple:
    """A summary.json `memory` block as a table row: rank 0's parameters, gradients, optimizer
    state, communication buffers and their total (in `unit` bytes), and bytes counted minus
    predicted over the four (the prediction: one, or one per rank as summaries now write it)."""
    block = get(_one(rows, where, ("memory",)), "memory")
    counts = [_numbers(block[k])[0] for k in MEMORY_KINDS]
    excess = sum(counts) - sum(_numbers(block["predicted"][k])[0] for k in MEMORY_KINDS)
    return (*(c / unit for c in counts), sum(counts) / unit, excess)


def ranks_counted(rows: list[dict], where: dict | None = None) -> str:
    """"the same" when every rank of every matching summary.json counted the same bytes of each
    kind in its `memory` block, else "differently"."""
    same = all(len(set(_numbers(get(row, "memory")[k]))) == 1
               for row in select(rows, where) for k in MEMORY_KINDS)
    return "the same" if same else "differently"


def maximum(rows: list[dict], column: str, where: dict | None = None) -> float:
    """The largest value of the column over the matching rows (a peak over sizes, not over runs)."""
    return max(_pooled(rows, column, where))


def maxima(rows: list[dict], column: str, wheres: list[dict]) -> tuple:
    """`maximum` of each selection, in order (one run's peaks per dtype, say)."""
    return tuple(maximum(rows, column, where) for where in wheres)


def ratio_of_maxima(rows: list[dict], column: str, num: dict, den: dict) -> float:
    """maximum over `num` rows / maximum over `den` rows (one run's peaks, side by side)."""
    return maximum(rows, column, num) / maximum(rows, column, den)


def total(rows: list[dict], column: str, where: dict | None = None) -> float:
    """The sum of the column over the matching rows."""
    return sum(_pooled(rows, column, where))


def count(rows: list[dict], where: dict | None = None) -> int:
    """How many rows match (0 when none does: `#wrong` 0)."""
    return sum(matches(row, where) for row in rows)


def counts(rows: list[dict], wheres: list[dict | None]) -> tuple:
    """How many rows match each of `wheres` (None: every row): "6 of 6"."""
    return tuple(count(rows, where) for where in wheres)


def median_min_max(rows: list[dict], column: str, where: dict | None = None,
                   unit: float = 1) -> tuple:
    """(median, min, max, n) of every number in the column over the matching rows, divided by
    `unit` (1e3: microseconds as milliseconds)."""
    return _spread([x / unit for x in _pooled(rows, column, where)])


def ratio_of_medians(rows: list[dict], column: str, num: dict, den: dict) -> float:
    """The median of the `num` selection's numbers over the median of the `den` selection's."""
    return statistics.median(_pooled(rows, column, num)) / statistics.median(
        _pooled(rows, column, den))


def bootstrap_ratio_of_medians(rows: list[dict], column: str, num: dict, den: dict,
                               resamples: int = 5000, seed: int = 0) -> tuple:
    """(ratio of medians, low, high): the 95% bootstrap interval, each side's numbers resampled
    with replacement `resamples` times (Python's random, seeded: the same interval every time)."""
    xs, ys = _pooled(rows, column, num), _pooled(rows, column, den)
    rng = random.Random(seed)
    draws = sorted(statistics.median(rng.choices(xs, k=len(xs)))
                   / statistics.median(rng.choices(ys, k=len(ys))) for _ in range(resamples))
    cut = int(0.025 * resamples)
    return statistics.median(xs) / statistics.median(ys), draws[cut], draws[-cut - 1]


def _runs(rows: list[dict], pair_by: str) -> list[list[dict]]:
    """The rows grouped by `pair_by` (by default one file: one run), in the order of its values."""
    groups: dict = {}
    for row in rows:
        groups.setdefault(get(row, pair_by), []).append(row)
    return [group for _, group in sorted(groups.items())]


def per_run(rows: list[dict], of: str, pair_by: str = "_file", **args) -> tuple:
    """(median, min, max, n) of one derivation of this module (`of`: "maximum", "ratio_of_maxima",
    ...) done within each run alone, the rows sharing `pair_by`: a peak over sizes taken in each
    of three runs, then the median of the three peaks, never the peak of all."""
    fn = globals().get(of)
    if not callable(fn) or of.startswith("_"):
        raise LookupError(f"{of!r} is not a derivation of ddp_lab.results.derive")
    return _spread([fn(group, **args) for group in _runs(rows, pair_by)])


def paired_ratios(rows: list[dict], column: str, num: dict, den: dict,
                  pair_by: str = "_file") -> tuple:
    """(median, min, max, n) of per-run ratios: within each group of rows sharing `pair_by` (by
    default one file: one run), the median of the `num` selection's column over the `den`
    selection's (with one row each, their ratio)."""
    return per_run(rows, "ratio_of_medians", pair_by, column=column, num=num, den=den)


def unpaired_ratio(rows: list[dict], column: str, num: dict, den: dict) -> tuple:
    """(ratio of medians, lowest, highest) for repeats that ran apart (a benchmark's rows one after
    the other, not interleaved), so no repeat of one side has a partner: the range is what any
    pairing gives, min(num) / max(den) to max(num) / min(den)."""
    xs, ys = _pooled(rows, column, num), _pooled(rows, column, den)
    return statistics.median(xs) / statistics.median(ys), min(xs) / max(ys), max(xs) / min(ys)


def numbers_in_lines(rows: list[dict], pattern: str) -> tuple:
    """(median, min, max, n) of the number each log line matching `pattern` captures (its first
    group): for logs whose lines are prose, such as `... max |param diff| = 0.0111`."""
    xs = _captured(rows, pattern)
    if not xs:
        raise LookupError(f"no line matches {pattern!r}")
    return _spread(xs)


def line_ratios(rows: list[dict], num: str, den: str) -> tuple:
    """(median, min, max, n) of per-pass ratios from a log of prose lines: the number the k-th
    line matching `num` captures over the one the k-th line matching `den` captures (a sweep's
    passes, logged one after the other)."""
    xs, ys = _captured(rows, num), _captured(rows, den)
    if not xs or len(xs) != len(ys):
        raise LookupError(f"{len(xs)} lines match {num!r} and {len(ys)} match {den!r}")
    return _spread([x / y for x, y in zip(xs, ys)])


def within(rows: list[dict], column: str, limit: float, where: dict | None = None) -> tuple:
    """(how many, of how many) matching rows have |column| <= limit (an error inside a band)."""
    xs = _pooled(rows, column, where)
    return sum(abs(x) <= limit for x in xs), len(xs)


def crossover(rows: list[dict], key: str, slow: str, fast: str) -> float:
    """The smallest `key` from which column `fast` is below column `slow` at that and every
    larger measured `key` (`ddp_lab.bench.vector_add.crossover`'s rule); inf when it never is."""
    pairs = sorted((get(r, key), get(r, slow), get(r, fast)) for r in rows)
    best = float("inf")
    for n, slow_t, fast_t in reversed(pairs):
        if not fast_t < slow_t:
            break
        best = n
    return best


def largest_abs(rows: list[dict], column: str, where: dict | None = None,
                minus: str | None = None) -> float:
    """The largest |column| (or |column - minus|: counted against predicted) over the matching
    rows: the worst error, whatever its sign."""
    if minus is None:
        return max(abs(x) for x in _pooled(rows, column, where))
    return max(abs(get(r, column) - get(r, minus)) for r in select(rows, where))
