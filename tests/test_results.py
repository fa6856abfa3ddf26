"""`python -m ddp_lab.results check`: every quoted figure recomputed from its raw files.

The real docs/results must pass; a copy with one figure edited by hand, one raw number changed,
one raw file missing or one file nobody cites must fail, naming what broke. The derivations are
checked against numbers worked out in the test's own comments."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from ddp_lab.results import citations, derive, manifest, raw
from ddp_lab.results.check import check, report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRECISION = "h200-precision-and-layout"


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


# ---------------------------------------------------------------- raw files


def test_raw_reads_csv_cells_as_the_values_the_benchmark_wrote(tmp_path):
    _write(str(tmp_path / "r.csv"), "algo,ok,n,t,note\nring,True,4,1.5,\nnative,False,8,nan,x\n")
    rows = raw.read(str(tmp_path), "r.csv")
    assert rows[0] == {"algo": "ring", "ok": True, "n": 4, "t": 1.5, "note": None, "_file": "r.csv"}
    assert rows[1]["ok"] is False and rows[1]["t"] != rows[1]["t"]  # nan


def test_raw_reads_jsonl_json_logs_and_markdown_tables(tmp_path):
    _write(str(tmp_path / "a.jsonl"), '{"x": 1}\n\n{"x": 2, "y": {"z": 3}}\n')
    _write(str(tmp_path / "s.json"), '{"time_ms": {"step": 7.5}}')
    _write(str(tmp_path / "b.log"), "W1205 noise\nalgo=ring bytes=64 busbw_GBps=2.5 wrong=0\n2 passed in 3s\n")
    _write(str(tmp_path / "r.md"), "text\n\n| N | eff |\n| --- | --- |\n| 8 | 99% |\n| 16 | 95% |\n")
    assert [r["x"] for r in raw.read(str(tmp_path), "a.jsonl")] == [1, 2]
    assert raw.get(raw.read(str(tmp_path), "a.jsonl")[1], "y.z") == 3
    assert raw.get(raw.read(str(tmp_path), "s.json")[0], "time_ms.step") == 7.5
    log = raw.read(str(tmp_path), "b.log")
    assert [r["line"] for r in log][2] == "2 passed in 3s" and log[1]["busbw_GBps"] == 2.5
    assert "algo" not in log[0]  # a prose line has no fields
    assert raw.read(str(tmp_path), "r.md")[1] == {"N": 16, "eff": "95%", "_file": "r.md"}


def test_raw_refuses_a_page_and_an_unknown_kind(tmp_path):
    _write(str(tmp_path / "README.md"), "| a |\n| --- |\n| 1 |\n")
    with pytest.raises(ValueError, match="a page is not a raw file"):
        raw.read(str(tmp_path), "README.md")
    with pytest.raises(ValueError, match="no reader"):
        raw.read(str(tmp_path), "plot.png")


def test_select_matches_any_of_a_list_and_names_the_files_when_nothing_matches():
    rows = [{"algo": "ring", "n": 2, "_file": "a"}, {"algo": "tree", "n": 4, "_file": "b"}]
    assert len(raw.select(rows, {"algo": ["ring", "tree"]})) == 2
    assert raw.select(rows, {"n": 4.0}) == [rows[1]]  # a float cell matches an int selection
    with pytest.raises(LookupError, match="a, b"):
        raw.select(rows, {"algo": "naive"})


# ---------------------------------------------------------------- derivations

ROWS = [{"algo": "ring", "bytes": 64, "t": 110.0, "_file": "run1"},
        {"algo": "native", "bytes": 64, "t": 100.0, "_file": "run1"},
        {"algo": "ring", "bytes": 64, "t": 90.0, "_file": "run2"},
        {"algo": "native", "bytes": 64, "t": 100.0, "_file": "run2"},
        {"algo": "ring", "bytes": 64, "t": 130.0, "_file": "run3"},
        {"algo": "native", "bytes": 64, "t": 100.0, "_file": "run3"}]


def test_value_and_row_values_want_exactly_one_row():
    assert derive.value(ROWS, "t", {"algo": "ring", "_file": "run2"}) == 90.0
    assert derive.row_values(ROWS, ["t", "bytes"], {"algo": "ring", "_file": "run1"}, unit=10) \
        == (11.0, 6.4)
    with pytest.raises(LookupError, match="3 rows"):
        derive.value(ROWS, "t", {"algo": "ring"})


def test_paired_ratios_are_per_run_ratios_with_their_median_and_range():
    # per run: 110/100, 90/100, 130/100 -> median 1.1, range 0.9-1.3, 3 runs
    med, lo, hi, n = derive.paired_ratios(ROWS, "t", {"algo": "ring"}, {"algo": "native"})
    assert (round(med, 9), round(lo, 9), round(hi, 9), n) == (1.1, 0.9, 1.3, 3)


def test_per_run_takes_each_runs_peak_then_their_median():
    # peaks per run: run1 110, run2 100, run3 130 -> median 110 (100-130); the pooled peak is 130
    assert derive.per_run(ROWS, "maximum", column="t") == (110.0, 100.0, 130.0, 3)
    # ring's peak / native's per run: 1.1, 0.9, 1.3
    med, lo, hi, n = derive.per_run(ROWS, "ratio_of_maxima", column="t",
                                    num={"algo": "ring"}, den={"algo": "native"})
    assert (round(med, 9), round(lo, 9), round(hi, 9), n) == (1.1, 0.9, 1.3, 3)
    with pytest.raises(LookupError, match="not a derivation"):
        derive.per_run(ROWS, "_spread", column="t")


def test_unpaired_ratio_spans_every_pairing_of_the_repeats():
    rows = [{"side": "a", "r": [30.0, 33.0, 36.0]}, {"side": "b", "r": [10.0, 11.0, 12.0]}]
    # medians 33 / 11 = 3; lowest 30 / 12 = 2.5; highest 36 / 10 = 3.6
    assert derive.unpaired_ratio(rows, "r", {"side": "a"}, {"side": "b"}) == (3.0, 2.5, 3.6)


def test_median_min_max_ratio_of_medians_and_counts():
    assert derive.median_min_max(ROWS, "t", {"algo": "ring"}) == (110.0, 90.0, 130.0, 3)
    assert derive.median_min_max(ROWS, "t", {"algo": "native"}, unit=1e3)[0] == 0.1
    assert derive.ratio_of_medians(ROWS, "t", {"algo": "ring"}, {"algo": "native"}) == 1.1
    assert derive.count(ROWS, {"algo": "naive"}) == 0  # `#wrong` 0 must be derivable
    assert derive.counts(ROWS, [{"algo": "ring"}, None]) == (3, len(ROWS))
    assert derive.total(ROWS, "t", {"algo": "native"}) == 300.0
    # |err| <= 10 for 5 and -10, not for 15 and -20
    errs = [{"e": 5.0}, {"e": -10.0}, {"e": 15.0}, {"e": -20.0}]
    assert derive.within(errs, "e", 10) == (2, 4)
    assert derive.largest_abs(errs, "e") == 20.0


def test_shares_divide_within_each_row_not_across_them():
    rows = [{"t": {"guard": 5.0, "step": 100.0}}, {"t": {"guard": 30.0, "step": 200.0}},
            {"t": {"guard": 8.0, "step": 80.0}}, {"other": 1}]
    # per row 0.05, 0.15, 0.1; pooled sums would give 43 / 380 = 0.113
    assert derive.shares(rows, "t.guard", "t.step") == (0.1, 0.05, 0.15, 3)
    assert derive.shares(rows, "t.guard", "t.step", {"t.step": 200.0}) == (0.15, 0.15, 0.15, 1)
    with pytest.raises(LookupError):
        derive.shares(rows, "t.comm", "t.step")


def test_lists_and_strings_of_numbers_pool_every_number():
    rows = [{"ratios": [0.9, 1.0, 1.1]}, {"ratios": [1.3]}, {"passes": "0.5 0.7"}]
    assert derive.median_min_max(rows, "ratios") == (1.05, 0.9, 1.3, 4)
    assert derive.median_min_max(rows, "passes")[:3] == (0.6, 0.5, 0.7)


def test_bootstrap_interval_is_seeded_and_brackets_the_point():
    rows = [{"side": "a", "r": x} for x in (0.9, 1.0, 1.1, 1.2, 0.95)] + \
           [{"side": "b", "r": x} for x in (1.0, 1.0, 1.05, 0.98, 1.02)]
    args = ("r", {"side": "a"}, {"side": "b"})
    point, lo, hi = derive.bootstrap_ratio_of_medians(rows, *args, resamples=500)
    assert point == 1.0 / 1.0  # median 1.0 over median 1.0
    assert lo <= point <= hi and lo < hi
    assert derive.bootstrap_ratio_of_medians(rows, *args, resamples=500) == (point, lo, hi)


def test_crossover_is_where_the_fast_column_stays_below():
    rows = [{"n": n, "cpu": c, "gpu": g} for n, c, g in
            [(1, 1.0, 5.0), (10, 2.0, 5.0), (100, 8.0, 6.0), (1000, 50.0, 7.0)]]
    assert derive.crossover(rows, "n", "cpu", "gpu") == 100
    assert derive.crossover(rows, "n", "gpu", "cpu") == float("inf")  # never


def test_summary_memory_blocks():
    block = {"params_bytes": [100, 100], "grads_bytes": [50, 52], "optimizer_state_bytes": [50, 52],
             "comm_buffer_bytes": [100, 100],
             "predicted": {"params_bytes": 100, "grads_bytes": 50.0, "optimizer_state_bytes": 48,
                           "comm_buffer_bytes": 100}}
    rows = [{"memory": block}]
    # rank 0: 100 + 50 + 50 + 100 = 300 counted, 298 predicted; rank 1 counts 2 B more twice
    assert derive.memory_row(rows, unit=100) == (1.0, 0.5, 0.5, 1.0, 3.0, 2.0)
    assert derive.counted_minus_predicted(rows) == (0, 4)
    assert derive.ranks_counted(rows) == "differently"


def test_counted_minus_predicted_pairs_per_rank_predictions():
    # summaries now predict per rank (a shard rounds to whole elements), and leave out what is
    # not counted (None): rank 0 +2 B over its own prediction, rank 1 -2 B under its own
    block = {"params_bytes": [102, 98], "comm_buffer_bytes": [None, None],
             "predicted": {"params_bytes": [100.0, 100.0], "comm_buffer_bytes": [None, None]}}
    assert derive.counted_minus_predicted([{"memory": block}]) == (-2, 2)


def test_log_lines_give_numbers_and_per_pass_ratios():
    rows = [{"line": f"[{i}] n2-{s}: ok, step {t} ms"} for i, (s, t) in
            enumerate([("ddp", 100.0), ("ring", 120.0), ("ddp", 200.0), ("ring", 180.0)])]
    # passes: 120/100 = 1.2, 180/200 = 0.9
    assert derive.line_ratios(rows, r"n2-ring: ok, step ([0-9.]+)", r"n2-ddp: ok, step ([0-9.]+)") \
        == (pytest.approx(1.05), 0.9, 1.2, 2)
    assert derive.numbers_in_lines(rows, r"step ([0-9.]+) ms")[1:] == (100.0, 200.0, 4)


# ---------------------------------------------------------------- manifests and citations


def _figure(**over):
    entry = {"name": "f", "printed": "1.10", "files": ["r.csv"],
             "derive": "ddp_lab.results.derive.value", "args": {"column": "t"},
             "format": "{:.2f}", "quoted": {"README.md": "at 1.10 here"}}
    entry.update(over)
    return entry


def _manifest(tmp_path, *entries):
    _write(str(tmp_path / manifest.NAME), json.dumps({"figures": list(entries)}))
    return manifest.load(str(tmp_path))


def test_manifest_rejects_what_cannot_be_checked(tmp_path):
    assert _manifest(tmp_path, _figure())[0].quoted == {"README.md": ("at 1.10 here",)}
    with pytest.raises(manifest.ManifestError, match="missing keys"):
        _manifest(tmp_path, {k: v for k, v in _figure().items() if k != "format"})
    with pytest.raises(manifest.ManifestError, match="do not contain its printed value"):
        _manifest(tmp_path, _figure(quoted={"README.md": "at 1.11 here"}))
    with pytest.raises(manifest.ManifestError, match="names no raw file"):
        _manifest(tmp_path, _figure(files=[]))
    with pytest.raises(manifest.ManifestError, match="two figures share a name"):
        _manifest(tmp_path, _figure(), _figure())
    with pytest.raises(manifest.ManifestError, match="not a function"):
        _manifest(tmp_path, _figure(derive="ddp_lab.results.derive.nothing"))[0].function()


def test_citations_expand_braces_and_globs_but_not_bare_folders(tmp_path):
    assert citations.expand_braces("z{0,1}_{a,b}.json") == ["z0_a.json", "z0_b.json",
                                                             "z1_a.json", "z1_b.json"]
    for name in ("z0.json", "z1.json", "pts/a/summary.json", "pts/a/log.txt", "other.csv"):
        _write(str(tmp_path / name), "{}")
    page = "`z{0,1}.json` and `pts/*/summary.json`, folder `pts/`, [plot](other.png#x)"
    assert citations.uncited(str(tmp_path), page, set()) == ["other.csv", "pts/a/log.txt"]
    assert citations.uncited(str(tmp_path), page, {"other.csv", "pts/a/log.txt"}) == []


def test_headline_sections_and_bold_figures():
    text = "# T\n## Headline results\n| **3.25x** and **new** |\n## Tests\n**x**\n"
    assert citations.section(text, "Headline results").strip() == "| **3.25x** and **new** |"
    assert citations.unchecked_bold(citations.section(text, "Headline results"), {"3.25x"}) \
        == ["new"]


# ---------------------------------------------------------------- the real results, and planted bugs


def test_check_passes_on_the_committed_results():
    outcomes, problems = check(ROOT)
    text, ok = report(outcomes, problems)
    assert ok, text
    assert len({o.finding for o in outcomes}) >= 10 and len(outcomes) >= 300


def _copy_results(tmp_path, findings=None):
    """The repository's README.md, its docs pages, and docs/results (or some findings of it, with
    every other finding's page, which may quote theirs) under tmp_path: every place a figure is
    quoted."""
    src = os.path.join(ROOT, "docs", "results")
    dst = tmp_path / "docs" / "results"
    if findings is None:
        shutil.copytree(src, dst)
    else:
        for f in findings:
            shutil.copytree(os.path.join(src, f), dst / f)
        for other in set(os.listdir(src)) - set(findings):
            if os.path.exists(os.path.join(src, other, "README.md")):
                os.makedirs(dst / other)
                shutil.copy(os.path.join(src, other, "README.md"), dst / other / "README.md")
        shutil.copy(os.path.join(src, "README.md"), dst / "README.md")
    shutil.copy(os.path.join(ROOT, "README.md"), tmp_path / "README.md")
    for page in os.listdir(os.path.join(ROOT, "docs")):
        if page.endswith(".md"):
            shutil.copy(os.path.join(ROOT, "docs", page), tmp_path / "docs" / page)
    return dst


def _edit(path, old, new):
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


def _failures(root, only=None):
    text, ok = report(*check(str(root), only))
    assert not ok
    return [line for line in text.splitlines() if line.startswith("FAIL")]


def test_a_figure_edited_on_its_page_fails_naming_it_and_the_place(tmp_path):
    dst = _copy_results(tmp_path, [PRECISION])
    _edit(dst / PRECISION / "README.md", "trains at **3.25x** fp32", "trains at **3.26x** fp32")
    fails = _failures(tmp_path, [PRECISION])
    assert fails == [f"FAIL {PRECISION}: bf16 + channels_last over fp32: docs/results/{PRECISION}/"
                     "README.md no longer reads 'trains at **3.25x** fp32'"]


def test_a_raw_number_changed_fails_naming_the_figure_the_file_and_both_values(tmp_path):
    dst = _copy_results(tmp_path, [PRECISION])
    csv_path = dst / PRECISION / "loop_vs_bare_alexnet_precisions.csv"
    _edit(csv_path, "11487.68489647473", "11687.68489647473")  # fp32 NCHW ddp_lab img/s
    fails = "\n".join(_failures(tmp_path, [PRECISION]))
    assert ("bf16 + channels_last over fp32: printed '3.25x' but "
            "loop_vs_bare_alexnet_precisions.csv give '3.19x'") in fails
    assert "printed '11,488 | 11,577 | 0.992' but" in fails


def test_a_missing_raw_file_and_an_uncited_one_fail(tmp_path):
    dst = _copy_results(tmp_path, [PRECISION])
    os.rename(dst / PRECISION / "loop_vs_bare_alexnet_precisions.csv", dst / PRECISION / "old.csv")
    fails = "\n".join(_failures(tmp_path, [PRECISION]))
    assert "raw file missing: loop_vs_bare_alexnet_precisions.csv" in fails
    assert "old.csv is cited by neither README.md nor figures.json" in fails


def test_a_headline_figure_edited_in_readme_fails(tmp_path):
    _copy_results(tmp_path)
    _edit(tmp_path / "README.md", "at **0.990** of a bare loop", "at **0.999** of a bare loop")
    fails = "\n".join(_failures(tmp_path))
    assert "README.md no longer reads 'at **0.990** of a bare loop'" in fails
    assert "README.md: **0.999** is bold in a headline place but no checked figure" in fails


def test_the_command_exits_1_on_a_planted_bug_and_imports_no_torch(tmp_path):
    dst = _copy_results(tmp_path, [PRECISION])
    script = ("import sys; from ddp_lab.results.__main__ import main; "
              f"rc = main(['check', '--root', sys.argv[1], '{PRECISION}']); "
              "assert 'torch' not in sys.modules, 'check imported torch'; sys.exit(rc)")
    env = {**os.environ, "PYTHONPATH": ROOT}
    ok = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                        text=True, env=env, timeout=60)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    _edit(dst / PRECISION / "README.md", "| tf32 | yes | 26,757 |", "| tf32 | yes | 26,575 |")
    bad = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=60)
    assert bad.returncode == 1 and "table: tf32, channels_last yes" in bad.stdout


# ---------------------------------------------------------------- unquoted numbers


def test_unquoted_lists_the_numbers_no_quote_covers(tmp_path):
    """Quoted numbers (also across a line break) are covered, code blocks and indented command
    lines are not prose; another finding's quote of the page counts too."""
    from ddp_lab.results.unquoted import quotes_by_page, unquoted

    page = "docs/results/f/README.md"
    _write(str(tmp_path / page), "# f\n\nStep 1.25 ms here, and a\nratio of 0.50 over\nthe "
           "base. Load 3.14 unregistered.\n\n```\n9.99 in a block\n```\n\n    run 5.55 x\n")
    _write(str(tmp_path / "docs/results/f/figures.json"), json.dumps({"figures": [
        _figure(printed="1.25", quoted={page: "Step 1.25 ms here"})]}))
    _write(str(tmp_path / "docs/results/g/figures.json"), json.dumps({"figures": [
        _figure(printed="0.50", quoted={page: "ratio of 0.50 over the base"})]}))
    _write(str(tmp_path / "docs/results/g/README.md"), "# g\n")
    quotes = quotes_by_page(str(tmp_path))
    assert unquoted(str(tmp_path), "f", quotes) == [(5, "3.14", "the base. Load 3.14 unregistered.")]
