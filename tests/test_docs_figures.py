"""Figures the docs compute, recomputed from what they name (measured figures are the results
check's: docs/results/README.md):

- docs/scaling.md's worked example (the ring's predicted step at N=8, phase by phase) is run as
  the page prints it, on the raw files it names: the measured efficiency, the predicted step and
  efficiency, each phase's predicted time and the inputs the table's last column quotes, and
  the ring's fit and bus bandwidths after the table;
- docs/zero.md's memory table (the Ultra-Scale Playbook's formulas for 7B and 70B) and
  docs/seeds.md's corrected model memory for GPT-3 and LLaMA-2 70B (`perf.memory`);
- docs/zero.md's AlexNet tables: what a rank holds at each stage by design (`predict_held`, as the
  dry run plans it) and the ZeRO paper's formulas (`perf.memory.zero_bytes`) beside ours, and the
  largest layer's share of each model;
- docs/zero.md's simulated ZeRO tables, as the simulation's results page has them
  (h200-scaling-and-simulation/simulation.md, which tests/test_scale.py regenerates);
- docs/compression.md's count of what PowerSGD r = 2 sends per step (`powersgd.as_matrix`, the
  compressor's own view of each parameter; the counted run is the results check's)."""

import functools
import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "scaling.md")
ZERO_PAGE = os.path.join(ROOT, "docs", "zero.md")


def section(page: str, starts_with: str) -> str:
    """`page`'s text from the line starting `starts_with` to the next heading."""
    text = open(page).read()
    start = text.index(starts_with)
    end = text.find("\n#", start + 1)
    return text[start:end if end > 0 else None]


@pytest.fixture(scope="module")
def example() -> tuple[str, str, dict]:
    """The worked example's section, its code, and the code's namespace once run from the
    repository root."""
    text = section(PAGE, "### Worked example: the ring at N=8")
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    namespace: dict = {}
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        exec(compile(code, PAGE, "exec"), namespace)
    finally:
        os.chdir(cwd)
    return text, code, namespace


def same_as_printed(value: float, printed: str) -> bool:
    """`value` rounds to `printed`, to the decimals printed."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return f"{value:.{decimals}f}" == printed


def test_the_worked_example_reproduces_every_predicted_figure(example):
    section, code, namespace = example
    row = namespace["rows"][1]
    step, efficiency = re.search(r"# ([\d.]+), ([\d.]+)\s*$", code.strip()).groups()
    assert same_as_printed(row["pred_step_ms"], step), (row["pred_step_ms"], step)
    assert same_as_printed(row["pred_efficiency"], efficiency), (row["pred_efficiency"], efficiency)
    prose = re.search(r"predict (\d+)% efficiency", section).group(1)
    assert same_as_printed(100 * row["pred_efficiency"], prose), (row["pred_efficiency"], prose)
    measured = re.search(r"measured: ([\d.]+)%", section).group(1)
    assert same_as_printed(100 * row["efficiency"], measured), (row["efficiency"], measured)
    table = re.findall(r"^\| \**(\w+)\** \| \**([\d.]+)\** \|", section, re.M)
    assert [phase for phase, _ in table] == ["data", "forward", "backward", "sync",
                                             "exposed_comm", "guard", "optim", "other", "step"]
    for phase, printed in table:
        assert same_as_printed(row[f"pred_{phase}_ms"], printed), (phase, row[f"pred_{phase}_ms"])
    # the paragraph after the table: the ring's own fit at N=8 and the bus bandwidths beside it
    ring = dict(namespace["fits"][("ring", "gloo")].by_world_size)[8]
    assert f"(N=8: `{ring.describe()}`)" in section
    calib, probed = re.search(r"\(([\d.]+) GB/s, next to\nthe probe's ([\d.]+) and",
                              section).groups()
    assert same_as_printed(row["calib_busbw_GBps"], calib)
    assert same_as_printed(row["probe_busbw_GBps"], probed)


def test_the_worked_example_quotes_its_inputs(example):
    """The table's last column: each phase's inputs as the N=1 point, the N=8 probe and the fits
    have them, and the exposed communication's and the guard's parts as the model added them."""
    section, _, namespace = example
    one, row = namespace["rows"][0], namespace["rows"][1]
    with open(os.path.join(ROOT, namespace["d"], "interference", "n8-ring.json")) as f:
        probe = json.load(f)["derived"]
    c, skew, ring = probe["contention"], probe["skew"], probe["ring"]
    native = dict(namespace["fits"][("native", "gloo")].by_world_size)[8]
    sizes = ring["bucket_bytes"]
    guard_fit_ms = row["pred_guard_ms"] - one["guard_ms"] * c["guard"] * (1 + skew["guard"])
    expected = {
        "data": [one["data_ms"], c["forward"], probe["store_ms"]],
        "forward": [one["forward_ms"], c["forward"]],
        "backward": [one["backward_ms"], c["backward"]],
        "sync": [],
        "exposed_comm": [len(sizes), sizes[0] / 2**10, sizes[1] / 2**20, sizes[2] / 2**20,
                         *[times[1] for times in ring["bucket_ms"]],
                         ring["local_s_per_byte"] * 1e9, row["pred_comm_busy_ms"],
                         ring["compute_slowdown"], ring["comm_slowdown"], row["pred_slowdown_ms"],
                         row["pred_wait_ms"], one["sync_ms"], skew["backward"],
                         row["pred_straggler_ms"]],
        "guard": [one["guard_ms"], c["guard"], 1, skew["guard"], 64,
                  native.regimes[0].alpha_s * 1e6, 2 * (8 - 1), guard_fit_ms],
        "optim": [one["optim_ms"], c["optim"]],
        "other": [one["other_ms"], c["step"]],
        "step": [one["step_ms"], row["pred_step_ms"], row["pred_efficiency"]]}
    table = re.findall(r"^\| \**(\w+)\** \| \**[\d.]+\** \| (.*) \|$", section, re.M)
    assert [phase for phase, _ in table] == list(expected)
    for phase, inputs in table:
        printed = re.findall(r"(?<![\w.<=])(\d+(?:\.\d+)?)", inputs)
        assert len(printed) == len(expected[phase]), (phase, printed)
        for value, shown in zip(expected[phase], printed):
            assert same_as_printed(value, shown), (phase, value, shown)


@functools.lru_cache
def shapes_of(model: str) -> list:
    """The parameter shapes of `model` (built on the meta device: nothing allocated)."""
    import torch

    from ddp_lab.cli import compose
    from ddp_lab.dry_run import _model

    with torch.device("meta"):
        return [p.shape for p in _model(compose([f"model={model}"], "dry_run")).parameters()]


@functools.lru_cache  # (each composes a config: the tables ask for the same ones again)
def planned(model: str, world_size: int, zero: int):
    """The dry run's plan of a ring, AdamW, 25 MB buckets: (the rank holding the most's bytes by
    kind, its total, the model's parameter numels)."""
    from ddp_lab.cli import compose
    from ddp_lab.dry_run import make_plan

    cfg = compose([f"world_size={world_size}", "sync=ring", f"sync.zero={zero}", "optim=adamw",
                   "sync.bucket_mb=25", f"model={model}"], "dry_run")
    plan = make_plan(cfg)
    worst = max(range(world_size), key=plan.memory)
    return plan.held[worst], plan.memory(worst), [s.numel() for s in shapes_of(model)]


def mb(values: str) -> list[str]:
    return [v.strip().split(" ")[0].replace(",", "") for v in values.strip(" |").split("|")]


def test_zero_md_held_table_is_what_the_design_predicts():
    text = section(ZERO_PAGE, "**The lesson AlexNet teaches.**")
    rows = re.findall(r"^\| AdamW `zero=(\d)`, N = ([\d or]+) \|(.*)$", text, re.M)
    assert len(rows) == 7
    kinds = ["params_bytes", "grads_bytes", "optimizer_state_bytes", "comm_buffer_bytes",
             "comm_scratch_bytes"]
    for zero, ns, values in rows:
        *parts, total, vs = mb(values)
        for n in map(int, ns.split(" or ")):
            held, most, _ = planned("alexnet_cifar", n, int(zero))
            base = planned("alexnet_cifar", n, 0)[1]
            got = [held[k] / 1e6 for k in kinds] + [most / 1e6, most / base]
            for value, printed in zip(got, [*parts, total, vs]):
                assert same_as_printed(value, printed), (zero, n, value, printed)
    _, _, numels = planned("alexnet_cifar", 2, 0)
    share = re.search(r"4096 x 4096 layer is (\d+)% of its ([\d.]+) M", text).groups()
    assert same_as_printed(100 * max(numels) / sum(numels), share[0])
    assert same_as_printed(sum(numels) / 1e6, share[1])
    _, _, numels = planned("alexnet", 2, 0)
    share = re.search(r"AlexNet's is (\d+)% of ([\d.]+) M", text).groups()
    assert same_as_printed(100 * max(numels) / sum(numels), share[0])
    assert same_as_printed(sum(numels) / 1e6, share[1])


def test_zero_md_paper_formulas_beside_ours():
    """At N = 8, AdamW: the paper's mixed-precision terms, the same terms at fp32's 4 bytes, and
    the most a rank of ours holds, each with its ratio to stage 0 in parentheses."""
    from ddp_lab.perf.memory import zero_bytes

    text = section(ZERO_PAGE, "**The lesson AlexNet teaches.**")
    rows = re.findall(r"^\| (\d) \|(.*)$", text, re.M)
    assert [int(z) for z, _ in rows] == [0, 1, 2, 3]
    base = {}
    for zero, values in rows:
        cells = [c.strip() for c in values.strip(" |").split("|")]
        got = []
        for model in ("alexnet_cifar", "alexnet"):
            _, ours, numels = planned(model, 8, int(zero))
            params = sum(numels)
            for column, total in (("mixed", zero_bytes(params, int(zero), 8, "mixed")["total"]),
                                  ("fp32", zero_bytes(params, int(zero), 8, "fp32")["total"]),
                                  ("ours", ours)):
                base.setdefault((model, column), total)
                got.append((total / 1e6, total / base[(model, column)]))
        for (value, ratio), cell in zip(got, cells):
            printed = re.match(r"([\d,.]+)(?: \(([\d.]+)x\))?$", cell).groups()
            assert same_as_printed(value, printed[0].replace(",", "")), (zero, value, cell)
            assert printed[1] is None or same_as_printed(ratio, printed[1]), (zero, ratio, cell)


def test_compression_md_powersgd_elements_per_step():
    from ddp_lab.compress.powersgd import as_matrix

    text = open(os.path.join(ROOT, "docs", "compression.md")).read()
    bias, sent, whole, fewer = re.search(
        r"the ([\d,]+) bias elements whole, ([\d,]+) against ([\d,]+), ([\d.]+)x", text).groups()
    shapes = shapes_of("alexnet_cifar")
    vectors = sum(s.numel() for s in shapes if len(s) == 1)
    matrices = [as_matrix(s, 2, 2.0) for s in shapes if len(s) > 1]
    assert all(compress for *_, compress in matrices)
    elements = sum((rows + cols) * r for rows, cols, r, _ in matrices) + vectors
    numel = sum(s.numel() for s in shapes)
    assert (f"{vectors:,}", f"{elements:,}", f"{numel:,}") == (bias, sent, whole)
    assert same_as_printed(numel / elements, fewer)
    rows, cols, r, _ = as_matrix((4096, 4096), 2, 2.0)
    assert f"4096 x 4096\nlayer at r = 2 sends {(rows + cols) * r:,} instead of" in text


def test_zero_md_simulated_tables_are_the_simulations():
    simulated = open(os.path.join(ROOT, "docs", "results", "h200-scaling-and-simulation",
                                  "simulation.md")).read().splitlines()
    text = section(ZERO_PAGE, "The simulation (`python -m ddp_lab.scale simulate=only`)")
    held = re.findall(r"^\| [\d.]+ B \|.*$", text, re.M)
    assert len(held) == 4 and all(row in simulated for row in held)
    header = next(r for r in simulated if r.startswith("| model | zero | 8 | 16 |"))
    sizes = [c.strip() for c in header.strip("|").split("|")][2:]
    cells = {}
    for row in simulated:
        parts = [c.strip() for c in row.strip("|").split("|")]
        if len(parts) == 2 + len(sizes) and parts[1].isdigit():
            cells.update({(parts[0], parts[1], n): v for n, v in zip(sizes, parts[2:])})
    quoted = re.findall(r"^\| (alexnet|resnet50) \| (\d) \| (.*)$", text, re.M)
    assert len(quoted) == 7
    for model, zero, values in quoted:
        for n, value in zip(("8", "64", "1024"), values.strip(" |").split(" | ")):
            assert cells[(model, zero, n)] == value.strip(), (model, zero, n, value)


def gb(printed: str) -> str:
    return printed.replace(" GB", "").replace(",", "").strip()


def test_zero_md_memory_table_is_the_formulas():
    """The Ultra-Scale Playbook's table for 7B and 70B parameters (`perf.memory.zero_bytes`,
    mixed precision + Adam) and the fewest 80 GB GPUs per stage (`gpus_for_zero`)."""
    from ddp_lab.perf.memory import GB, gpus_for_zero, zero_bytes

    text = section(ZERO_PAGE, "## What it saves: the memory table")
    rows = re.findall(r"^\| (\d)(?: \(\w+\))? \| [^|]+ \| [^|]+ \|(.*)$", text, re.M)
    assert [int(z) for z, _ in rows] == [0, 1, 2, 3]
    for zero, values in rows:
        *sizes, gpus = [c.strip() for c in values.strip(" |").split("|")]
        z = int(zero)
        got = [zero_bytes(p, z, n)["total"] / GB for p, n in ((7e9, 8), (70e9, 8), (70e9, 64))]
        for value, printed in zip(got, sizes):
            assert same_as_printed(value, gb(printed)), (zero, value, printed)
        fewest = [gpus_for_zero(p, z, 80) for p in (7e9, 70e9)]
        assert gpus == " / ".join("never" if g is None else str(g) for g in fewest), (zero, gpus)


def test_seeds_md_model_memory_is_the_formulas():
    """The corrected model-memory figures for GPT-3 (175 B) and LLaMA-2 70B."""
    from ddp_lab.perf.memory import GB, gpus_needed, inference_bytes, training_bytes

    text = open(os.path.join(ROOT, "docs", "seeds.md")).read()
    train = {p: training_bytes(p, "mixed", "adam")["total"] for p in (175e9, 70e9)}
    fp16 = {p: inference_bytes(p, "fp16") for p in (175e9, 70e9)}
    assert (f"training with Adam needs 16 B/param ({train[175e9] / 1e12:.1f} TB for GPT-3, "
            f"{train[70e9] / 1e12:.2f} TB for LLaMA-2 70B)") in " ".join(text.split())
    assert f"({fp16[175e9] / GB:.0f} /\n  {fp16[70e9] / GB:.0f} GB)" in text
    needs = [gpus_needed(b, 80) for b in (fp16[175e9], train[175e9], fp16[70e9], train[70e9])]
    assert ("GPT-3 needs {} for fp16 weights and >= {} to train (before activations), LLaMA-2 "
            "70B {} and {}".format(*needs)) in " ".join(text.split())
    assert (f"Adam mixed-precision training {train[175e9] / GB:,.0f} GB: >= {needs[1]} "
            f"A100-80GB or {gpus_needed(train[175e9], 141)} H200") in text
