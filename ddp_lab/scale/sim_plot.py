"""simulation.png: efficiency vs GPUs per algorithm, one panel per model, with the interference
band, and efficiency vs bucket size at the largest world size (rows of ddp_lab/perf/simulate.py)."""

from __future__ import annotations

ALGO_COLORS = {"naive": "tab:red", "ring": "tab:blue", "hring": "tab:green", "tree": "tab:orange",
               "native": "tab:purple"}


def _plot_model(ax, rows, main, m: str, sim) -> None:
    """Efficiency vs GPUs of one model, a line per algorithm and gradient dtype."""
    for algo in main.algos():
        for dtype, ls in zip(sim.grad_dtypes[::-1], ("-", "--", ":")):
            rs = sorted((r for r in rows if r["network"] == main.name and r["model"] == m
                         and r["algo"] == algo and r["grad_dtype"] == dtype
                         and r["bucket_mb"] == sim.bucket_mb), key=lambda r: r["world_size"])
            if rs:
                xs = [r["world_size"] for r in rs]
                ax.plot(xs, [r["efficiency"] for r in rs], ls=ls, marker="o", ms=3,
                        color=ALGO_COLORS.get(algo), label=f"{algo} {dtype}")
                if "efficiency_lo" in rs[0]:  # the interference band
                    ax.fill_between(xs, [r["efficiency_lo"] for r in rs],
                                    [r["efficiency_hi"] for r in rs], alpha=0.12,
                                    color=ALGO_COLORS.get(algo), lw=0)
    ax.set_title(f"{m} on {main.name} (bands: interference)", fontsize=9)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("GPUs")
    ax.grid(True, alpha=0.3)


def _plot_buckets(ax, rows, main, models: list[str], sim) -> None:
    """Efficiency vs bucket size at the largest N, hring and tree, a colour per model."""
    n_top = max(sim.world_sizes)
    dtype = sim.grad_dtypes[-1]
    for m, color in zip(models, ("tab:blue", "tab:green", "tab:red", "tab:purple", "tab:brown",
                                 "tab:gray")):
        for algo, ls in (("hring", "-"), ("tree", "--")):
            rs = sorted((r for r in rows if r["network"] == main.name and r["model"] == m
                         and r["algo"] == algo and r["grad_dtype"] == dtype
                         and r["world_size"] == n_top and r["bucket_mb"] > 0),
                        key=lambda r: r["bucket_mb"])
            if rs:
                ax.plot([r["bucket_mb"] for r in rs], [r["efficiency"] for r in rs], ls=ls,
                        marker="o", ms=3, color=color, label=f"{m} {algo}")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("bucket MB")
    ax.set_title(f"bucket size at {n_top} GPUs ({dtype})", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def plot(rows, main, times, sim, path: str) -> str:
    """Efficiency vs GPUs per algorithm, one panel per model (solid: bf16, dashed: fp32), and the
    efficiency vs bucket size at the largest world size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(times)
    fig, axes = plt.subplots(1, len(models) + 1, figsize=(4.2 * (len(models) + 1), 4.0),
                             squeeze=False)
    for ax, m in zip(axes[0], models):
        _plot_model(ax, rows, main, m, sim)
    axes[0][0].set_ylabel("efficiency")
    axes[0][0].legend(fontsize=7)
    _plot_buckets(axes[0][-1], rows, main, models, sim)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
