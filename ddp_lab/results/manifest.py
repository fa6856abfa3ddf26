"""A finding's manifest, `docs/results/<finding>/figures.json`: every figure its page, the index
or README.md quotes, with what it is derived from.

    {"figures": [
      {"name": "bf16 + channels_last over fp32",
       "printed": "3.25x",
       "files": ["loop_vs_bare_alexnet_precisions.csv"],
       "derive": "ddp_lab.results.derive.ratio",
       "args": {"column": "ddp_img_s", "num": {"precision": "bf16", "channels_last": true},
                "den": {"precision": "fp32", "channels_last": false}},
       "format": "{:.2f}x",
       "quoted": {"docs/results/h200-precision-and-layout/README.md": "**3.25x** fp32",
                  "README.md": "AlexNet at **3.25x** fp32"}}]}

- `printed`: the figure as the pages print it; `format` (Python's str.format, given the derived
  number, or the numbers of a tuple in order) must print exactly that from the raw files.
- `files`: raw files, relative to the finding's folder; `derive`: a function (dotted name) called
  with their rows and `args`.
- `quoted`: each place that prints the figure (a path from the repository root) and the words
  around it there (a list where it is printed more than once), which must contain `printed`: an
  edit of the figure in that place breaks the words, so the check fails (whitespace is compared
  collapsed, as Markdown reflows lines).
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from typing import Callable

NAME = "figures.json"
KEYS = {"name", "printed", "files", "derive", "args", "format", "quoted"}


class ManifestError(ValueError):
    """A manifest that cannot be checked: a missing key, a bad derive name, a quote without its
    figure."""


@dataclass(frozen=True)
class Figure:
    name: str
    printed: str
    files: tuple[str, ...]
    derive: str  # dotted name of a function (rows, **args) -> number or tuple of numbers
    args: dict
    format: str
    quoted: dict[str, tuple[str, ...]]  # path from the repository root -> the words around it there

    def function(self) -> Callable:
        module, _, attr = self.derive.rpartition(".")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError, ValueError) as e:
            raise ManifestError(f"{self.name}: derive {self.derive!r} is not a function ({e})")
        if not callable(fn):
            raise ManifestError(f"{self.name}: derive {self.derive!r} is not callable")
        return fn


def _figure(entry: dict, where: str) -> Figure:
    missing, unknown = KEYS - entry.keys(), entry.keys() - KEYS
    if missing or unknown:
        raise ManifestError(f"{where}: figure {entry.get('name', '?')!r}: missing keys "
                            f"{sorted(missing)}, unknown keys {sorted(unknown)}")
    fig = Figure(name=entry["name"], printed=entry["printed"], files=tuple(entry["files"]),
                 derive=entry["derive"], args=dict(entry["args"]), format=entry["format"],
                 quoted={place: (words,) if isinstance(words, str) else tuple(words)
                         for place, words in entry["quoted"].items()})
    if not fig.files:
        raise ManifestError(f"{where}: figure {fig.name!r} names no raw file")
    if "\n" in fig.printed or "\n" in fig.format:
        raise ManifestError(f"{where}: figure {fig.name!r}: a printed value is one line")
    for place, quotes in fig.quoted.items():
        for words in quotes:
            if fig.printed not in words:
                raise ManifestError(f"{where}: figure {fig.name!r}: the words quoted in {place} "
                                    f"({words!r}) do not contain its printed value {fig.printed!r}")
    return fig


def load(folder: str) -> list[Figure]:
    """The figures of a finding's folder; [] when it has no manifest."""
    path = os.path.join(folder, NAME)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        data = json.load(f)
    figures = [_figure(entry, path) for entry in data.get("figures", [])]
    names = [f.name for f in figures]
    if len(names) != len(set(names)):
        raise ManifestError(f"{path}: two figures share a name")
    return figures
