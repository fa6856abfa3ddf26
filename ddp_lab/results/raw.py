"""Raw result files read as rows: one dict per CSV row, JSON line, JSON object or `key=value` line.

A finding's figures are derived from the files the benchmarks and sweeps wrote, never from a table
typed into a page. Every file becomes a list of rows, each tagged with `_file` (its path relative
to the finding's folder), so that a derivation can compare selections within one file (one run)
or pair them across files (repeated runs).
"""

from __future__ import annotations

import csv
import json
import math
import os
import re

# A benchmark's log line of fields (`algo=ring bytes=67108864 busbw_GBps=2.067 wrong=0`): the
# allreduce benchmark prints one per row, and some device runs brought back only their logs.
_KV_LINE = re.compile(r"^\s*\w+=\S+(\s+\w+=\S+)*\s*$")


def scalar(text: str):
    """A CSV cell or log field as the value the benchmark wrote: bool, int, float, None or str."""
    if text in ("True", "true"):
        return True
    if text in ("False", "false"):
        return False
    if text == "":
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def _csv_rows(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: scalar(v) for k, v in row.items()} for row in csv.DictReader(f)]


def _jsonl_rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _json_rows(path: str) -> list[dict]:
    with open(path) as f:
        data = json.load(f)
    return data if isinstance(data, list) else [data]


def _log_rows(path: str) -> list[dict]:
    """One row per line: its text as `line`, and its fields too where it is a line of fields."""
    rows = []
    with open(path) as f:
        for line in f:
            fields = ({k: scalar(v) for k, v in (kv.split("=", 1) for kv in line.split())}
                      if _KV_LINE.match(line) else {})
            rows.append({"line": line.rstrip("\n"), **fields})
    return rows


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _md_rows(path: str) -> list[dict]:
    """The rows of every pipe table a program wrote into a Markdown report (report.md,
    simulation.md), keyed by their table's header."""
    rows, header = [], None
    with open(path) as f:
        lines = [line for line in f]
    for line, following in zip(lines, lines[1:] + [""]):
        if not line.lstrip().startswith("|"):
            header = None
        elif header is None and following.lstrip().startswith("| ---"):
            header = _cells(line)
        elif header is not None and not line.lstrip().startswith("| ---"):
            rows.append({k: scalar(v) for k, v in zip(header, _cells(line))})
    return rows


READERS = {".csv": _csv_rows, ".jsonl": _jsonl_rows, ".json": _json_rows, ".log": _log_rows,
           ".txt": _log_rows, ".md": _md_rows}


def read(folder: str, name: str) -> list[dict]:
    """The rows of `name` (relative to `folder`), each with `_file` set to `name`."""
    ext = os.path.splitext(name)[1]
    if os.path.basename(name) == "README.md":
        raise ValueError(f"{name}: a page is not a raw file (figures come from what programs wrote)")
    if ext not in READERS:
        raise ValueError(f"{name}: no reader for {ext!r} files (readers: {', '.join(READERS)})")
    rows = READERS[ext](os.path.join(folder, name))
    return [{**row, "_file": name} for row in rows]


def get(row: dict, key: str):
    """row[key], where a dotted key walks into nested objects (`time_ms.step` of a summary.json)."""
    if key in row:
        return row[key]
    value = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise KeyError(f"no {key!r} in a row of {row.get('_file', '?')}")
        value = value[part]
    return value


def matches(row: dict, where: dict | None) -> bool:
    """Whether the row has every `where` field at its value (a list: any of its values)."""
    for key, want in (where or {}).items():
        try:
            have = get(row, key)
        except KeyError:
            return False
        wanted = want if isinstance(want, list) else [want]
        if not any(_same(have, w) for w in wanted):
            return False
    return True


def _same(have, want) -> bool:
    if isinstance(have, float) and isinstance(want, (int, float)) and not isinstance(want, bool):
        return math.isclose(have, want)
    return have == want


def select(rows: list[dict], where: dict | None) -> list[dict]:
    """The rows matching `where`; an error naming the files when none does."""
    chosen = [r for r in rows if matches(r, where)]
    if not chosen:
        files = sorted({r.get("_file", "?") for r in rows})
        raise LookupError(f"no row matches {where} in {', '.join(files)}")
    return chosen
