"""timeline.png: trace.json's steps as a Gantt chart, one row per (rank, lane).

Compute spans (data, forward, backward, wait, guard, optimizer) on each rank's `compute` row,
each bucket's all-reduce on its `comm` row labelled with the bucket's index, a tick where a
bucket became ready. The part of communication that nothing hid (the `wait`) is shaded across
both rows of its rank, so overlap reads at a glance: all-reduces under backward are hidden,
those past it are paid for.
"""

from __future__ import annotations

COLORS = {"data": "#b0b0b0", "forward": "#4c72b0", "backward": "#55a868", "wait": "#c44e52",
          "guard": "#8172b2", "optimizer": "#ccb974", "allreduce": "#dd8452",
          "step (CUDA graph)": "#64b5cd"}


def draw(events: list[dict], path: str) -> str:
    """Draw `events` (Chrome trace events, ts/dur in us) into the PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted({e["pid"] for e in events if e["ph"] in ("X", "i")})
    rows = [(r, lane) for r in ranks for lane in (0, 1)]  # compute, comm
    y = {row: len(rows) - 1 - i for i, row in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.55 * len(rows)))
    for e in events:
        if e["ph"] == "X":
            _span(ax, e, y[(e["pid"], e["tid"])])
        elif e["ph"] == "i":
            row = y[(e["pid"], e["tid"])]
            ax.plot([e["ts"] / 1e3] * 2, [row - 0.45, row + 0.45], color="black", lw=0.8)
    for e in events:  # exposed communication: the wait, shaded over the rank's two rows
        if e["ph"] == "X" and e["name"] == "wait" and e["dur"] > 0:
            ax.axvspan(e["ts"] / 1e3, (e["ts"] + e["dur"]) / 1e3,
                       ymin=_frac(y[(e["pid"], 1)] - 0.5, len(rows)),
                       ymax=_frac(y[(e["pid"], 0)] + 0.5, len(rows)), color=COLORS["wait"],
                       alpha=0.15, lw=0)
    ax.set_yticks([y[row] for row in rows],
                  [f"rank {r} {'compute' if lane == 0 else 'comm'}" for r, lane in rows])
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlabel("ms (rank 0's clock)")
    ax.set_title("traced steps: buckets ready (ticks), all-reduces (numbered), exposed wait "
                 "(shaded)", fontsize=9)
    names = [n for n in COLORS if any(e.get("name") == n for e in events)]
    ax.legend(handles=[Patch(color=COLORS[n], label=n) for n in names], fontsize=7, ncol=len(names),
              loc="upper center", bbox_to_anchor=(0.5, -0.25 if len(rows) > 2 else -0.4))
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _span(ax, e: dict, row: int) -> None:
    start, width = e["ts"] / 1e3, e["dur"] / 1e3
    ax.broken_barh([(start, width)], (row - 0.4, 0.8), color=COLORS.get(e["name"], "#999999"),
                   edgecolor="white", lw=0.3)
    if e["name"] == "allreduce":
        ax.text(start + width / 2, row, str(e["args"]["bucket"]), ha="center", va="center",
                fontsize=6, color="black", clip_on=True)


def _frac(y: float, n_rows: int) -> float:
    """A data y as a fraction of the axes' height (ylim -0.6 .. n_rows - 0.4)."""
    return (y + 0.6) / n_rows
