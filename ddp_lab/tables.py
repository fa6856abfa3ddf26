"""Rows of results as a plain fixed-width table (the console) and as files (JSON lines + CSV):
what the benchmarks, the sweep and the performance model's command line print and write."""

from __future__ import annotations

import csv
import json
import os
from typing import Sequence


def format_table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """A plain fixed-width table; floats to 4 significant digits."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)
    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))
    return "\n".join([line(columns), line(["-" * w for w in widths]), *map(line, cells)])


def write_rows(rows: Sequence[dict], out_dir: str, name: str) -> tuple[str, str]:
    """rows -> out_dir/name.jsonl and out_dir/name.csv; returns both paths."""
    os.makedirs(out_dir, exist_ok=True)
    jsonl, csv_path = os.path.join(out_dir, f"{name}.jsonl"), os.path.join(out_dir, f"{name}.csv")
    with open(jsonl, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return jsonl, csv_path
