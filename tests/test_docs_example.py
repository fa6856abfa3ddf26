"""docs/scaling.md's worked example (the ring's predicted step at N=8, phase by phase) is run as the
page prints it, on the raw files it names, and the figures it prints are checked: the measured
efficiency, the predicted step and efficiency in the code's last comment, and each phase's
predicted time in the table after it (not the inputs the table's last column quotes)."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "scaling.md")


def example_section() -> str:
    text = open(PAGE).read()
    start = text.index("### Worked example: the ring at N=8")
    end = text.find("\n#", start + 1)
    return text[start:end if end > 0 else None]


def run_example(code: str) -> dict:
    """The example's code, run from the repository root: its namespace afterwards."""
    namespace: dict = {}
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        exec(compile(code, PAGE, "exec"), namespace)
    finally:
        os.chdir(cwd)
    return namespace


def same_as_printed(value: float, printed: str) -> bool:
    """`value` rounds to `printed`, to the decimals printed."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return f"{value:.{decimals}f}" == printed


def test_the_worked_example_reproduces_every_predicted_figure():
    section = example_section()
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    row = run_example(code)["rows"][1]
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
