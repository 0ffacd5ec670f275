"""PNG plots of benchmark results (matplotlib, headless): throughput against concurrency, latency CDFs."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'mlc[train]' (or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def throughput_plot(series: dict[str, list[tuple[int, float]]], path: Path, title: str) -> Path:
    """One line per server: output tokens/s at each concurrency level."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for label, points in series.items():
        if points:
            xs, ys = zip(*sorted(points))
            ax.plot(xs, ys, marker="o", label=label)
            for x, y in zip(xs, ys):
                ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xscale("log", base=2)
    levels = sorted({x for points in series.values() for x, _ in points})
    ax.set_xticks(levels, [str(x) for x in levels])
    ax.minorticks_off()
    return finish_axes(plt, fig, ax, path, title, "concurrent requests", "output tokens / s")


def latency_plot(series: dict[str, list[tuple[int, float | None]]], path: Path, title: str) -> Path:
    """One line per latency statistic (e.g. "TTFT p50", "TPOT p99"), in ms, against the concurrency level."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for label, points in series.items():
        points = sorted((x, y) for x, y in points if y is not None and y == y)  # drop levels with no value (NaN)
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, marker="o", label=label, ls="--" if "p99" in label else "-")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    levels = sorted({x for points in series.values() for x, _ in points})
    ax.set_xticks(levels, [str(x) for x in levels])
    ax.minorticks_off()
    return finish_axes(plt, fig, ax, path, title, "concurrent requests", "latency (ms, log scale)")


def cdf_plot(series: dict[str, list[float]], path: Path, title: str, xlabel: str) -> Path:
    """Empirical CDF of a latency (ms) per server; the p50 and p99 are readable off the curve."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for label, values in series.items():
        if values:
            xs = sorted(values)
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=f"{label} (n={len(xs)})")
    for q in (0.5, 0.99):
        ax.axhline(q, color="grey", lw=0.6, ls=":")
    ax.set_ylim(0, 1.02)
    return finish_axes(plt, fig, ax, path, title, xlabel, "fraction of requests")


def finish_axes(plt, fig, ax, path: Path, title: str, xlabel: str, ylabel: str) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
