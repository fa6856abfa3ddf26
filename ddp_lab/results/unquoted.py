"""`python -m ddp_lab.results unquoted [FINDING ...]`: the decimal numbers a results page prints
that no figure's quote covers, places for a maintainer to look, not a verdict.

The check (check.py) proves every quoted figure; it cannot see a number nobody registered. This
lists, per page, each number with a decimal point outside code blocks and indented command lines
that lies in no quote of any figure that names the page (a number after a hyphen, a range's upper
end or a negative sign's, is not listed on its own; integers are not listed). Some it lists are
rightly left unregistered: settings, targets, datasheet values, formulas worked on the same line.
It reads files only and always exits 0.
"""

from __future__ import annotations

import os
import re

from ddp_lab.results import manifest
from ddp_lab.results.check import RESULTS, findings

NUMBER = re.compile(r"(?<![\w.-])\d+\.\d+(?![\w.])")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
INDENTED = re.compile(r"^ {4}.*$", re.M)  # a command line, not prose (a list's text is 2 in)


def quotes_by_page(root: str) -> dict[str, list[str]]:
    """Every quote in every finding's manifest, by the page (a path from `root`) it quotes."""
    quotes: dict[str, list[str]] = {}
    for finding in findings(root):
        for fig in manifest.load(os.path.join(root, RESULTS, finding)):
            for page, words in fig.quoted.items():
                quotes.setdefault(page, []).extend(words)
    return quotes


def covered_spans(text: str, quotes: list[str]) -> list[tuple[int, int]]:
    """Where each quote stands in `text`, its spaces matching any run of whitespace."""
    spans = []
    for words in quotes:
        pattern = r"\s+".join(re.escape(w) for w in words.split())
        spans += [m.span() for m in re.finditer(pattern, text)]
    return spans


def unquoted(root: str, finding: str, quotes: dict[str, list[str]]) -> list[tuple[int, str, str]]:
    """(line, number, the line) for each number on `finding`'s page that none of `quotes`
    (quotes_by_page) covers."""
    page = os.path.join(RESULTS, finding, "README.md")
    with open(os.path.join(root, page)) as f:
        text = f.read()
    blanked = INDENTED.sub(lambda m: " " * len(m.group()),
                           FENCE.sub(lambda m: re.sub(r"\S", " ", m.group()), text))
    spans = covered_spans(text, quotes.get(page, []))
    lines = text.splitlines()
    out = []
    for m in NUMBER.finditer(blanked):
        if not any(a <= m.start() and m.end() <= b for a, b in spans):
            line = text.count("\n", 0, m.start()) + 1
            out.append((line, m.group(), lines[line - 1].strip()))
    return out


def report(root: str, only: list[str] | None) -> str:
    names, quotes = only or findings(root), quotes_by_page(root)
    rows = [f"{name}/README.md:{line}: {number} | {text[:100]}"
            for name in names for line, number, text in unquoted(root, name, quotes)]
    return "\n".join(rows + [f"{len(rows)} numbers on {len(names)} pages in no quote"])
