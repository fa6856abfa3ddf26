"""Plant defects one at a time and show that the tests catch each: a test suite that passes proves
something only if a broken lab would fail it.

    python scripts/mutation_check.py OUT_DIR [--only NAME ...] [--timeout S]

For each defect below: a copy of this checkout's tracked files (as they are in the working tree)
in a temporary directory, the defect planted by replacing text that must occur exactly once, the
mutated file compiled, then the tests named for it run there (`python -m pytest -x -q`). A
defect is *caught* when those tests fail; *missed* when they pass; *broken plant* when the text
to replace is not found exactly once (the code moved: fix the defect's text). The unmutated copy
runs the same tests first, and must pass, so a failure is the defect's, not the tests'.
Writes OUT_DIR/mutation_check.json (one row per defect) and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (what it breaks, file, [(text, replacement)], the tests that must catch it)
DEFECTS = {
    "ring chunks swapped": (
        "the ring all-reduce leaves chunks 0 and 1 in each other's place",
        "ddp_lab/comm/ring.py",
        [("    _ring(flat, ch, range(2 * (ch.size - 1)), shift=0)\n",
          "    _ring(flat, ch, range(2 * (ch.size - 1)), shift=0)\n"
          "    c = torch.tensor_split(flat, ch.size)\n"
          "    if len(c) > 1 and c[0].numel() == c[1].numel():\n"
          "        first = c[0].clone()\n"
          "        c[0].copy_(c[1])\n"
          "        c[1].copy_(first)\n")],
        ["tests/test_comm.py"]),
    "last bucket dropped": (
        "our bucketed sync never reduces its last bucket",
        "ddp_lab/sync/bucketed.py",
        [("        while (self._launched < len(self.buckets)\n",
          "        while (self._launched < len(self.buckets) - 1\n"),
         ("                for b in range(self._launched, len(self.buckets)):",
          "                for b in range(self._launched, len(self.buckets) - 1):"),
         ("                self._launched = len(self.buckets)\n",
          "                self._launched = len(self.buckets) - 1\n"),
         ("            else:\n                for b in range(len(self.buckets)):\n",
          "            else:\n                for b in range(len(self.buckets) - 1):\n")],
        ["tests/test_sync.py"]),
    "average's divide skipped": (
        "our bucketed sync unpacks the sum of the gradients, not their average",
        "ddp_lab/sync/bucketed.py",
        [("torch.div(view, self.world_size, out=p.grad)", "p.grad.copy_(view)")],
        ["tests/test_sync.py"]),
    "shard off by one element": (
        "every rank but 0 takes its shard one element early",
        "ddp_lab/comm/__init__.py",
        [("    return torch.tensor_split(tensor.view(-1), world_size)[rank]\n",
          "    flat = tensor.view(-1)\n"
          "    piece = torch.tensor_split(flat, world_size)[rank]\n"
          "    start = max(0, piece.storage_offset() - flat.storage_offset() - 1)\n"
          "    return flat[start:start + piece.numel()] if rank else piece\n")],
        ["tests/test_comm_shards.py", "tests/test_zero.py"]),
    "ZeRO all-gather skipped": (
        "after the optimizer, ZeRO never gathers the updated shards into every replica",
        "ddp_lab/sync/zero.py",
        [('                self._communicate(b, comm.all_gather, shard, flat, span="all_gather")',
          "                pass")],
        ["tests/test_zero.py"]),
    "checkpoint field not restored": (
        "a resumed run does not load its learning-rate schedule",
        "ddp_lab/train.py",
        [('    scheduler.load_state_dict(resumed["scheduler"])\n', "")],
        ["tests/test_resume.py"]),
}


def copy_tree(dest: str) -> None:
    """This checkout's tracked files, as they are in the working tree, under `dest`."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True,
                           capture_output=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = os.path.join(REPO, rel)
        if os.path.isfile(src):
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))


def plant(tree: str, path: str, edits: list[tuple[str, str]]) -> str | None:
    """Apply the edits to tree/path; None, or why the defect could not be planted."""
    full = os.path.join(tree, path)
    with open(full) as f:
        text = f.read()
    for old, new in edits:
        if text.count(old) != 1:
            return f"{path}: the text to replace occurs {text.count(old)} times: {old.strip()!r}"
        text = text.replace(old, new)
    with open(full, "w") as f:
        f.write(text)
    py_compile.compile(full, doraise=True)
    return None


def run_tests(tree: str, tests: list[str], timeout: float) -> tuple[str, list[str], float]:
    """('passed' | 'failed' | 'timeout', the failed tests' ids, seconds)."""
    env = dict(os.environ, PYTHONPATH=tree, PYTHONDONTWRITEBYTECODE="1")
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               *tests], cwd=tree, env=env, capture_output=True, text=True,
                              timeout=timeout, start_new_session=True)
    except subprocess.TimeoutExpired:
        return "timeout", [], time.monotonic() - t0
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", proc.stdout, flags=re.M)
    return ("passed" if proc.returncode == 0 else "failed"), failed, time.monotonic() - t0


def check(name: str, timeout: float) -> dict:
    what, path, edits, tests = DEFECTS[name]
    row = {"defect": name, "what": what, "file": path, "tests": tests}
    with tempfile.TemporaryDirectory(prefix="mutation.") as tree:
        copy_tree(tree)
        baseline, failed, _ = run_tests(tree, tests, timeout)
        if baseline != "passed":
            return {**row, "result": f"baseline {baseline}", "failed_tests": failed}
        problem = plant(tree, path, edits)
        if problem:
            return {**row, "result": "broken plant", "failed_tests": [], "why": problem}
        outcome, failed, seconds = run_tests(tree, tests, timeout)
    result = {"failed": "caught", "timeout": "caught (timeout)", "passed": "MISSED"}[outcome]
    return {**row, "result": result, "failed_tests": failed, "seconds": round(seconds, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--only", nargs="*", choices=list(DEFECTS), default=list(DEFECTS))
    p.add_argument("--timeout", type=float, default=900)
    a = p.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    rows = []
    for name in a.only:
        print(f"planting: {name} ...", flush=True)
        rows.append(check(name, a.timeout))
        print(f"  {rows[-1]['result']}: {', '.join(rows[-1]['failed_tests'][:3])}", flush=True)
    with open(os.path.join(a.out_dir, "mutation_check.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{'defect':<32} {'result':<18} first failing test")
    for r in rows:
        print(f"{r['defect']:<32} {r['result']:<18} {(r['failed_tests'] or [''])[0]}")
    if any(not r["result"].startswith("caught") for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
