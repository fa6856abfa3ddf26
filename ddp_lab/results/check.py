"""`python -m ddp_lab.results check`: every figure the results pages, their index and README.md
quote, recomputed from its raw files.

For each finding folder under docs/results it fails (exit 1) when
- a figure's derived value, printed with its format, differs from the printed value (a typo, a
  stale number, a figure from another run), naming the figure, its files and both values;
- a place that quotes a figure no longer has the words around it (the figure edited by hand);
- a manifest names a raw file that is missing, or a file of the folder is cited by nothing;
- a bold figure in a headline place (README.md's "Headline results", the index) is not a checked
  figure quoted there.
It reads files only, imports no torch, and writes nothing.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ddp_lab.results import citations, manifest, raw

RESULTS = os.path.join("docs", "results")
INDEX = os.path.join(RESULTS, "README.md")
# Places whose bold figures must all be checked ones: (path, the section of it, "" = all).
HEADLINES = (("README.md", "Headline results"), (INDEX, ""))


@dataclass
class Outcome:
    finding: str
    figure: str
    printed: str = ""
    derived: str = ""
    problems: list[str] = field(default_factory=list)


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _read(root: str, rel: str, texts: dict) -> str | None:
    if rel not in texts:
        path = os.path.join(root, rel)
        texts[rel] = _normal(open(path).read()) if os.path.exists(path) else None
    return texts[rel]


def format_value(fmt: str, value) -> str:
    return fmt.format(*value) if isinstance(value, tuple) else fmt.format(value)


def derive(folder: str, fig: manifest.Figure):
    """The figure's value from its raw files (raises what reading or deriving raised)."""
    rows = [row for name in fig.files for row in raw.read(folder, name)]
    return fig.function()(rows, **fig.args)


def check_figure(root: str, finding: str, fig: manifest.Figure, texts: dict) -> Outcome:
    folder = os.path.join(root, RESULTS, finding)
    out = Outcome(finding, fig.name, fig.printed)
    missing = [f for f in fig.files if not os.path.exists(os.path.join(folder, f))]
    if missing:
        out.derived = "-"
        out.problems.append(f"raw file missing: {', '.join(missing)}")
    else:
        try:
            out.derived = format_value(fig.format, derive(folder, fig))
        except Exception as e:  # a bad selection or file is this figure's failure, not the run's
            out.derived = "error"
            out.problems.append(f"cannot derive from {', '.join(fig.files)}: "
                                f"{type(e).__name__}: {e}")
        if out.derived not in ("error", fig.printed):
            out.problems.append(f"printed {fig.printed!r} but {', '.join(fig.files)} give "
                                f"{out.derived!r}")
    for place, quotes in fig.quoted.items():
        text = _read(root, place, texts)
        if text is None:
            out.problems.append(f"quoted in {place}, which does not exist")
            continue
        out.problems += [f"{place} no longer reads {words!r}" for words in quotes
                         if _normal(words) not in text]
    return out


def check_finding(root: str, finding: str, texts: dict):
    """The finding's figures checked, the problems of the folder itself (manifest, uncited
    files), and the figures."""
    folder = os.path.join(root, RESULTS, finding)
    try:
        figures = manifest.load(folder)
        for fig in figures:
            fig.function()
    except (manifest.ManifestError, ValueError) as e:
        return [], [f"{finding}: {e}"], []
    outcomes = [check_figure(root, finding, fig, texts) for fig in figures]
    page = open(os.path.join(folder, "README.md")).read()
    named = {f for fig in figures for f in fig.files}
    problems = [f"{finding}: {f} is cited by neither README.md nor {manifest.NAME}: cite it or "
                f"remove it" for f in citations.uncited(folder, page, named)]
    return outcomes, problems, figures


def findings(root: str) -> list[str]:
    base = os.path.join(root, RESULTS)
    return sorted(d for d in os.listdir(base)
                  if os.path.exists(os.path.join(base, d, "README.md")))


def headline_problems(root: str, quoted: dict[str, set]) -> list[str]:
    """Bold figures of the headline places that no checked figure quotes there."""
    problems = []
    for place, heading in HEADLINES:
        path = os.path.join(root, place)
        if not os.path.exists(path):
            continue
        text = open(path).read()
        text = citations.section(text, heading) if heading else text
        for span in citations.unchecked_bold(text, quoted.get(place, set())):
            problems.append(f"{place}: **{span}** is bold in a headline place but no checked "
                            f"figure is quoted there with that value")
    return problems


def check(root: str, only: list[str] | None = None) -> tuple[list[Outcome], list[str]]:
    """Every figure of the findings (`only`: these), and the problems outside single figures."""
    texts: dict = {}
    outcomes, problems = [], []
    quoted: dict[str, set] = {}  # place -> printed values of the checked figures quoted there
    for finding in only or findings(root):
        got, folder_problems, figures = check_finding(root, finding, texts)
        outcomes += got
        problems += folder_problems
        for fig in figures:
            for place in fig.quoted:
                quoted.setdefault(place, set()).add(fig.printed)
    if not only:  # the headline places quote every finding: judged only when all were read
        problems += headline_problems(root, quoted)
    return outcomes, problems


def table(outcomes: list[Outcome]) -> str:
    head = ("finding", "figure", "printed", "derived", "ok")
    rows = [head] + [(o.finding, o.figure, o.printed, o.derived, "ok" if not o.problems else
                      "FAIL") for o in outcomes]
    widths = [min(48, max(len(r[i]) for r in rows)) for i in range(len(head))]
    return "\n".join("  ".join(c[:w].ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def report(outcomes: list[Outcome], problems: list[str]) -> tuple[str, bool]:
    """The printed table and its failures; whether everything held."""
    lines = [table(outcomes)]
    failures = [f"FAIL {o.finding}: {o.figure}: {p}" for o in outcomes for p in o.problems]
    failures += [f"FAIL {p}" for p in problems]
    ok = not failures
    lines += [""] + failures if failures else []
    lines.append(f"\n{len(outcomes)} figures in {len({o.finding for o in outcomes})} findings: "
                 + ("all hold" if ok else f"{len(failures)} failures"))
    return "\n".join(lines), ok
