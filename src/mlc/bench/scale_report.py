"""`bench scale`'s report: the ladder as a Markdown table with the issue's goals checked, and PNG plots against
model size (one line per engine and architecture)."""

from __future__ import annotations

from pathlib import Path

from mlc.bench.plots import finish_axes, pyplot

ENGINES = ("mlc", "llama.cpp")
GOALS = {"c1": 1.1, "c8": 1.5, "c32": 1.5, "roofline": 0.8, "prefill": 1.5, "rss": 1.1, "moe": 0.8,
         "background": 0.03}


def _ratio(a, b) -> float | None:
    return a / b if a and b else None


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v is not None else "-"


def _pct(v: float | None) -> str:
    return f"{100 * v:.0f}%" if v is not None else "-"


def _get(d: dict, key):
    """A dict keyed by ints in memory and by strings once read back from JSON."""
    return d.get(key, d.get(str(key)))


def background_cost(srv: dict) -> float | None:
    b = srv.get("background")
    return 1 - b["loaded_tok_s"] / b["quiet_tok_s"] if b and b["quiet_tok_s"] else None


def moe_efficiency(result: dict, rung: str, engine: str) -> float | None:
    """A MoE rung's tok/s at c=1 against what a dense rung of the same engine reading the same bytes per token
    would give (the dense rung closest in bytes per token, scaled by bytes): 1.0 means the MoE reads only the
    experts it routes to, as fast as dense weights."""
    rows = result["rungs"]
    moe = rows[rung]
    dense = [r for r in rows.values() if r["active_params"] == r["params"] and _get(r["servers"][engine]["tok_s"], 1)]
    tok = _get(moe["servers"][engine]["tok_s"], 1)
    if not dense or not tok:
        return None
    near = min(dense, key=lambda r: abs(r["bytes_per_token"] - moe["bytes_per_token"]))
    expected = _get(near["servers"][engine]["tok_s"], 1) * near["bytes_per_token"] / moe["bytes_per_token"]
    return tok / expected


def markdown(result: dict) -> str:
    m = result["machine"]
    cfg = result["config"]
    levels = cfg["concurrency"]
    prefills = cfg["prefill_tokens"]
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores ({', '.join(m['flags'])}); {m['time']}.", "",
             *[f"- {n}" for n in result["notes"]], ""]
    head = ("| rung | like | params (read/token) | matrices | " +
            " | ".join(f"c={c} tok/s mlc / llama.cpp" for c in levels) +
            " | roofline c=1 mlc / llama.cpp | " + " | ".join(f"prefill {n}" for n in prefills) +
            " | peak RSS GB mlc / llama.cpp | " + f"{100 * cfg['background_load']:.0f}% load: c=1 cost mlc / "
            "llama.cpp |")
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for rung, r in result["rungs"].items():
        ours, peer = r["servers"]["mlc"], r["servers"]["llama.cpp"]
        params = f"{r['params'] / 1e9:.2f}B ({r['bytes_per_token'] / 1e9:.2f} GB)"
        cells = []
        for c in levels:
            a, b = _get(ours["tok_s"], c), _get(peer["tok_s"], c)
            cells.append(f"{_x(_ratio(a, b))} ({a or 0:.1f} / {b or 0:.1f})")
        pre = [_x(_ratio(_get(ours["prefill_tok_s"], n), _get(peer["prefill_tok_s"], n))) for n in prefills]
        rss = [s["peak_rss_bytes"] / 1e9 if s["peak_rss_bytes"] else 0.0 for s in (ours, peer)]
        lines.append(f"| {rung} | {r['like']} | {params} | {r['types'].split(' (')[0]} | " + " | ".join(cells) +
                     f" | {_pct(ours['roofline'])} / {_pct(peer['roofline'])} of {r['read_gb_s']:.1f} GB/s | " +
                     " | ".join(pre) + f" | {rss[0]:.2f} / {rss[1]:.2f} | "
                     f"{_pct(background_cost(ours))} / {_pct(background_cost(peer))} |")
    lines += ["", "Ratios are mlc / llama.cpp. Roofline: the weight bytes a decode step reads (bench/gguf_source."
              "bytes_per_token: every matrix, the embedding only as a tied head, of MoE experts the routed share) x "
              "tok/s at c=1 / the read bandwidth measured before the rung. Background load: 1 - tok/s at c=1 beside "
              "a process spinning that share of one core / tok/s at c=1 without it, back to back.", ""]
    lines += ["### Goals", "", *goals(result), ""]
    lines += ["Plots: " + ", ".join(Path(p).name for p in result.get("plots", [])), ""]
    return "\n".join(lines)


def goals(result: dict) -> list[str]:
    """One line per goal of the size ladder: met where, missed where."""
    cfg = result["config"]
    out = []
    dense = {k: r for k, r in result["rungs"].items() if r["active_params"] == r["params"]}

    def verdict(name: str, checks: dict[str, bool | None]) -> str:
        missed = [k for k, ok in checks.items() if ok is False]
        unmeasured = [k for k, ok in checks.items() if ok is None]
        if not checks or len(unmeasured) == len(checks):
            return f"- {name}: no rung measured it"
        tail = f" ({', '.join(unmeasured)} not measured)" if unmeasured else ""
        return f"- {name}: " + (f"met on {', '.join(k for k, ok in checks.items() if ok)}" if not missed
                                else f"missed on {', '.join(missed)}") + tail

    for c, key in ((1, "c1"), (8, "c8"), (32, "c32")):
        if c in cfg["concurrency"]:
            checks = {}
            for k, r in dense.items():
                v = _ratio(_get(r["servers"]["mlc"]["tok_s"], c), _get(r["servers"]["llama.cpp"]["tok_s"], c))
                checks[k] = None if v is None else v >= GOALS[key]
            out.append(verdict(f"c={c} >= {GOALS[key]}x llama.cpp (dense)", checks))
    out.append(verdict("c=1 at >= 80% of the memory roofline from 1.5B up",
                       {k: r["servers"]["mlc"]["roofline"] >= GOALS["roofline"]
                        for k, r in dense.items() if r["params"] >= 1.4e9 and r["servers"]["mlc"]["roofline"]}))
    longest = max(cfg["prefill_tokens"])
    out.append(verdict(f"{longest}-token prefill >= 1.5x llama.cpp", {
        k: (v >= GOALS["prefill"]) if (v := _ratio(_get(r["servers"]["mlc"]["prefill_tok_s"], longest),
                                                   _get(r["servers"]["llama.cpp"]["prefill_tok_s"], longest)))
        else None for k, r in result["rungs"].items()}))
    out.append(verdict("peak RSS at most 10% above llama.cpp's", {
        k: (v <= GOALS["rss"]) if (v := _ratio(r["servers"]["mlc"]["peak_rss_bytes"],
                                               r["servers"]["llama.cpp"]["peak_rss_bytes"])) else None
        for k, r in result["rungs"].items()}))
    for k, r in result["rungs"].items():
        if r["active_params"] < r["params"]:
            eff = {e: moe_efficiency(result, k, e) for e in ENGINES}
            out.append(f"- MoE {k} c=1 against a dense rung reading the same bytes per token: mlc {_x(eff['mlc'])}, "
                       f"llama.cpp {_x(eff['llama.cpp'])} (goal: mlc >= {GOALS['moe']}x)")
    if cfg["background_load"] > 0:
        out.append(verdict(f"{100 * cfg['background_load']:.0f}% of a core in the background costs c=1 at most 3%", {
            k: (v <= GOALS["background"]) if (v := background_cost(r["servers"]["mlc"])) is not None else None
            for k, r in result["rungs"].items()}))
    return out


def _series(result: dict, value) -> dict[str, list[tuple[float, float]]]:
    """{"<engine> <arch>": [(params read per token in B, value), ...]} over the rungs."""
    out: dict[str, list[tuple[float, float]]] = {}
    for r in result["rungs"].values():
        for engine in ENGINES:
            v = value(r, r["servers"][engine])
            if v is not None:
                out.setdefault(f"{engine} {r['arch']}", []).append((r["active_params"] / 1e9, v))
    return out


def _plot(series: dict[str, list[tuple[float, float]]], path: Path, title: str, ylabel: str) -> Path:
    """A colour per architecture, solid for mlc and dashed for llama.cpp; x ticks at the rungs' sizes."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    colours: dict[str, str] = {}
    for label, points in sorted(series.items(), key=lambda kv: (kv[0].split()[-1], kv[0])):
        arch = label.split()[-1]
        colour = colours.setdefault(arch, f"C{len(colours)}")
        xs, ys = zip(*sorted(points))
        mine = label.startswith("mlc")
        ax.plot(xs, ys, marker="o" if mine else "s", ls="-" if mine else "--", color=colour, label=label)
    ax.set_xscale("log")
    sizes: list[float] = []
    for x in sorted({x for points in series.values() for x, _ in points}):
        if not sizes or x > sizes[-1] * 1.15:  # 3.2B beside 3.3B: one label, not two printed over each other
            sizes.append(x)
    ax.set_xticks(sizes, [f"{x:.2g}" for x in sizes])
    ax.minorticks_off()
    return finish_axes(plt, fig, ax, path, title, "parameters read per token (billions, log scale)", ylabel)


def write_plots(result: dict, out_dir: Path) -> list[Path]:
    cfg = result["config"]
    paths = [_plot(_series(result, lambda r, s, c=c: _get(s["tok_s"], c)), out_dir / f"scale-c{c}.png",
                   f"output tokens/s at concurrency {c}, same GGUF ({cfg['quant']})", "output tokens / s")
             for c in cfg["concurrency"]]
    paths.append(_plot(_series(result, lambda r, s: 100 * s["roofline"] if s["roofline"] else None),
                       out_dir / "scale-roofline.png", "c=1 share of the measured memory read bandwidth",
                       "% of the roofline"))
    n = max(cfg["prefill_tokens"])
    paths.append(_plot(_series(result, lambda r, s: _get(s["prefill_tok_s"], n)), out_dir / "scale-prefill.png",
                       f"prefill of a {n}-token prompt", "prompt tokens / s"))
    paths.append(_plot(_series(result, lambda r, s: s["peak_rss_bytes"] / 1e9 if s["peak_rss_bytes"] else None),
                       out_dir / "scale-rss.png", "peak RSS of the server", "GB"))
    return paths
