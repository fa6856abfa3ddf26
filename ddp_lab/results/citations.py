"""What a finding's page cites, and what the headline places print in bold.

A raw file stays in `docs/results/<finding>/` only while something cites it: its manifest (a
figure's `files`) or its page, by a path in backticks or a link (`sweep/scaling.csv`,
`points/*/summary.json`, `zero{0,1,2}_{fp32,bf16}.summary.json`). A folder alone (`sweep/`) cites
nothing: every file kept is one a reader is pointed at.
"""

from __future__ import annotations

import glob
import os
import re

EXEMPT = {"README.md", "figures.json"}
_BACKTICKS = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_BRACES = re.compile(r"\{([^{}]*)\}")
_BOLD = re.compile(r"\*\*(.+?)\*\*")


def expand_braces(pattern: str) -> list[str]:
    """`a{1,2}b{x,y}` -> a1bx, a1by, a2bx, a2by (the shell's brace expansion, no nesting)."""
    m = _BRACES.search(pattern)
    if not m:
        return [pattern]
    head, tail = pattern[:m.start()], pattern[m.end():]
    return [p for alt in m.group(1).split(",") for p in expand_braces(head + alt + tail)]


def cited_paths(folder: str, page_text: str) -> set[str]:
    """Files under `folder` that a backticked path or a link of the page names (globs allowed)."""
    candidates = _BACKTICKS.findall(page_text) + _LINK.findall(page_text)
    cited = set()
    for token in candidates:
        token = token.split("#", 1)[0].strip()
        if not token or " " in token or token.endswith("/") or "://" in token:
            continue
        for pattern in expand_braces(token):
            for path in glob.glob(os.path.join(folder, pattern), recursive=True):
                if os.path.isfile(path):
                    cited.add(os.path.relpath(path, folder))
    return cited


def files_in(folder: str) -> list[str]:
    """Every file under `folder` but the page and the manifest, relative to it."""
    out = []
    for dirpath, _, names in os.walk(folder):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), folder)
            if rel not in EXEMPT:
                out.append(rel)
    return sorted(out)


def uncited(folder: str, page_text: str, manifest_files: set[str]) -> list[str]:
    """Files of the finding that neither its manifest nor its page cites."""
    cited = cited_paths(folder, page_text) | manifest_files
    return [f for f in files_in(folder) if f not in cited]


def section(text: str, heading: str) -> str:
    """The Markdown section under `## heading`, up to the next heading of that level or above."""
    m = re.search(rf"^## {re.escape(heading)}\s*$", text, flags=re.M)
    if not m:
        return ""
    rest = text[m.end():]
    end = re.search(r"^#{1,2} ", rest, flags=re.M)
    return rest[:end.start()] if end else rest


def unchecked_bold(text: str, printed: set[str]) -> list[str]:
    """Bold spans of a headline place that are not the printed value of a checked figure."""
    return [span for span in _BOLD.findall(text) if span not in printed]
