"""Plots for the README from a directory of device outputs, as the benchmarks wrote them:

    python scripts/plot_results.py docs/results/h200-loop-vs-bare        # loop_vs_bare.png
    python scripts/plot_results.py docs/results/h200-real-vs-synthetic   # real_vs_synthetic.png

- loop_vs_bare_*.csv (`python -m ddp_lab.bench.train_throughput`): img/s of the ddp_lab loop and
  the bare loop per row -> loop_vs_bare.png (a file named *_nonfinite_off.csv: rows run with
  `ddp_overrides=["train.nonfinite=off"]`)
- train_<data>_g<cuda_graph>.json (`python -m ddp_lab.train`'s summary.json): img/s per data set,
  eager and graphed -> real_vs_synthetic.png
"""

from __future__ import annotations

import csv
import glob
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ddp_lab.bench.common import plot_bars  # noqa: E402


def row_label(r: dict, path: str) -> str:
    net = "AlexNet" if r["model"] == "alexnet" else "AlexNet-CIFAR"
    extras = [name for name, key in (("s2d", "stem"), ("compile", "compile"), ("graph", "cuda_graph"))
              if r[key] in ("True", "space_to_depth")]
    if path.endswith("_nonfinite_off.csv"):
        extras.append("nonfinite=off")
    # bf16 + channels_last unless said otherwise
    if (r["precision"], r["channels_last"]) != ("bf16", "True"):
        net += f" {r['precision']}" + (" CL" if r["channels_last"] == "True" else "")
    return f"{net} b{r['batch']}" + "".join(f"\n+{e}" for e in extras)


def main(results: str) -> None:
    groups = {}
    for path in sorted(glob.glob(os.path.join(results, "loop_vs_bare_*.csv"))):
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                groups[row_label(r, path)] = {"ddp_lab loop": float(r["ddp_img_s"]),
                                        "bare loop": float(r["bare_img_s"])}
    if groups:
        print(plot_bars(groups, os.path.join(results, "loop_vs_bare.png"), ylabel="img/s (log)",
                        logy=True, title="ddp_lab loop vs bare PyTorch loop (bf16 + channels_last unless named)"))
    data = {}
    for path in sorted(glob.glob(os.path.join(results, "train_*_g*.json"))):
        name, graph = os.path.basename(path)[len("train_"):-len(".json")].rsplit("_g", 1)
        s = json.load(open(path))
        label = {"c_syn": "synthetic", "c_dig": "digits", "c_aug": "digits, augmented"}.get(name, name)
        mode = "train.cuda_graph=true" if graph == "true" else "eager"
        data.setdefault(label, {})[mode] = s["train_img_per_s"]
    if data:
        order = {"synthetic": 0, "digits": 1, "digits, augmented": 2}
        data = dict(sorted(data.items(), key=lambda kv: order.get(kv[0], 9)))
        print(plot_bars(data, os.path.join(results, "real_vs_synthetic.png"), ylabel="img/s",
                        title="AlexNet-CIFAR, batch 512, bf16 + channels_last: real vs synthetic"))


if __name__ == "__main__":
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        sys.exit("usage: python scripts/plot_results.py <directory of device outputs>")
    main(sys.argv[1])
