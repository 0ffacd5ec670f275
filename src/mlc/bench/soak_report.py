"""`bench soak`'s verdict: the invariants checked on a run's samples and outcomes, the table, and the plot."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from mlc.bench.plots import pyplot

FD_SLACK, THREAD_SLACK, TASK_SLACK = 16, 4, 32  # what "flat" allows between the warm-up's end and the drained end
DRIFT_WINDOW_S = 600.0  # the goal compares the first and last ten minutes of an hour
CROWD_SETTLE_S = 60.0  # after the crowd joins: its slow readers' streams are generated, its sockets all open


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _inv(name: str, ok: bool | None, detail: str) -> dict:
    return {"name": name, "ok": ok, "detail": detail}


def check(result: dict, cfg) -> list[dict]:
    """Each invariant: ok True, False (violated) or None (the run cannot tell, e.g. too few requests)."""
    out = []
    outcomes = result["outcomes"]
    real = [o for o in outcomes if not o["injected"]]
    bad = [o for o in real if o["status"] >= 500 or o["status"] == 0]
    out.append(_inv("no 5xx or dropped connection outside the injected faults", not bad,
                    f"{len(bad)} of {len(real)}" + (f"; first: {bad[0]['kind']} {bad[0]['status']} "
                                                    f"{bad[0]['error']}" if bad else "")))
    malformed = [o for o in outcomes if o["kind"] == "malformed"]
    wrong = [o for o in malformed if not 400 <= o["status"] < 500]
    out.append(_inv("malformed requests answered 4xx", not wrong if malformed else None,
                    f"{len(malformed) - len(wrong)} of {len(malformed)}"))
    end = result["end"]
    leaked = bool(end["kv_usage"]) or bool(end["running"]) or bool(end["waiting"])
    out.append(_inv("no KV page or request left once the traffic stops", not leaked,
                    f"KV in use {100 * (end['kv_usage'] or 0):.2f}%, running {end['running']}, waiting "
                    f"{end['waiting']}"))
    warm = [s for s in result["samples"] if s["t"] >= cfg.warmup and s["rss_bytes"]]
    if warm:
        base, peak = warm[0]["rss_bytes"], max(s["rss_bytes"] for s in warm)
        growth = peak / base - 1
        out.append(_inv(f"RSS growth after warm-up <= {cfg.max_rss_growth:.0%}", growth <= cfg.max_rss_growth,
                        f"{base / 2**20:.0f} -> peak {peak / 2**20:.0f} MiB ({growth:+.1%})"))
    else:
        out.append(_inv("RSS growth after warm-up", None, "no sample after the warm-up"))
    every = [s["rss_bytes"] for s in result["samples"] if s["rss_bytes"]]
    if every and result.get("server_started") is not None:
        first = result["samples"][0]
        since_start = result["t0"] + first["t"] - result["server_started"]
        share = first["rss_bytes"] / max(every)
        out.append(_inv("RSS at the first sample (a minute or more after start) within 10% of the peak",
                        share >= 0.9 if since_start >= 60 else None,
                        f"{first['rss_bytes'] / 2**20:.0f} MiB at {since_start:.0f} s after start, peak "
                        f"{max(every) / 2**20:.0f} MiB ({share:.0%})"))
    if warm:
        for key, slack in (("open_fds", FD_SLACK), ("threads", THREAD_SLACK), ("asyncio_tasks", TASK_SLACK)):
            a, b = warm[0].get(key), end.get(key)
            ok = None if a is None or b is None else b <= a + slack
            out.append(_inv(f"{key} flat (drained end <= warm-up end + {slack})", ok, f"{a} -> {b}"))
    health = [h for s in result["samples"] for h in s.get("health_ms", [])]
    failed = sum(s.get("health_failed", 0) for s in result["samples"])
    p99 = pct(health, 0.99)
    crowd = result["samples"][-1].get("idle_cuts") is not None if result["samples"] else False
    out.append(_inv("/health p99 under 100 ms" + (", beside the idle and slow clients" if crowd else ""),
                    None if p99 is None else p99 < 100 and not failed,
                    f"p99 {p99 or 0:.1f} ms over {len(health)} probes, {failed} failed"))
    joined = result.get("crowd_started")  # a crowd that joined mid-run: drift is judged beside it, once it settled
    out += _drift([s for s in warm if s["t"] > joined + CROWD_SETTLE_S] if joined else warm, cfg,
                  "after the crowd settled" if joined else "after warm-up")
    out += _crowd_effect(result, cfg)
    return out


def _crowd_effect(result: dict, cfg) -> list[dict]:
    """With a crowd that joined mid-run (`crowd_after_s`): the mix's p99 TTFT and TPOT beside it, from a minute after
    it joined, against the same server's before it (after the warm-up)."""
    joined = result.get("crowd_started")
    if not joined:
        return []
    before = [s for s in result["samples"] if cfg.warmup <= s["t"] <= joined]
    # a sample holds the requests finished since the one before it
    after = [s for s in result["samples"] if s["t"] - cfg.sample_s >= joined + CROWD_SETTLE_S]
    return _p99_rise(before, after, cfg.max_crowd_slowdown, "beside the crowd", "of before it", ("before", "beside"))


def drift_window(span: float) -> float:
    """Seconds compared at each end of the run after warm-up: a fifth of it, at most ten minutes."""
    return min(DRIFT_WINDOW_S, span / 5)


def _drift(warm: list[dict], cfg, since: str) -> list[dict]:
    """p99 TTFT and TPOT in the last window of the run after warm-up against the first (`drift_window`)."""
    if len(warm) < 4:
        return [_inv("latency drift", None, f"too few samples {since}")]
    window = drift_window(warm[-1]["t"] - warm[0]["t"])
    first = [s for s in warm if s["t"] <= warm[0]["t"] + window]
    last = [s for s in warm if s["t"] >= warm[-1]["t"] - window]
    return _p99_rise(first, last, cfg.max_latency_drift, "in the last window", "of the first", ("first", "last"),
                     f"windows of {window / 60:.1f} min {since}, ")


def _p99_rise(base: list[dict], then: list[dict], allowed: float, where: str, than: str, labels: tuple[str, str],
              detail: str = "") -> list[dict]:
    """p99 TTFT and TPOT of the requests finished in samples `then` at most `allowed` above those in `base`."""
    out = []
    for key in ("ttft_s", "tpot_s"):
        a = [v for s in base for v in s[key]]
        b = [v for s in then for v in s[key]]
        pa, pb = pct(a, 0.99), pct(b, 0.99)
        name = f"p99 {key[:-2].upper()} {where} within {allowed:.0%} {than}"
        if len(a) < 20 or len(b) < 20 or not pa or not pb:
            out.append(_inv(name, None, f"too few requests ({len(a)} {labels[0]}, {len(b)} {labels[1]})"))
            continue
        out.append(_inv(name, pb <= pa * (1 + allowed), f"{1000 * pa:.0f} -> {1000 * pb:.0f} ms ({pb / pa - 1:+.0%}; "
                        f"{detail}{len(a)} and {len(b)} requests)"))
    return out


def markdown(result: dict) -> str:
    cfg = result["config"]
    m = result["machine"]
    kinds = Counter((o["kind"], o["status"]) for o in result["outcomes"])
    lines = [f"Machine: {m['cpu']}, {m['cores']} cores; {m['time']}.", "",
             f"{cfg['duration_s']:.0f} s at {result['rate']:.2f} requests/s"
             + (f" ({cfg['load']:.0%} of the {result['saturation']:.2f} requests/s measured)"
                if result.get("saturation") else "") + f", {len(result['outcomes'])} requests.", "",
             "| invariant | held | detail |", "|---|---|---|"]
    for inv in result["invariants"]:
        held = {True: "yes", False: "**no**", None: "-"}[inv["ok"]]
        lines.append(f"| {inv['name']} | {held} | {inv['detail']} |")
    lines += ["", "| request kind | status | count |", "|---|---|---|"]
    lines += [f"| {k} | {s or 'no response'} | {n} |" for (k, s), n in sorted(kinds.items(), key=lambda kv: kv[0])]
    lines += ["", f"Plot: {Path(result.get('plot', 'soak.png')).name}", ""]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path:
    plt = pyplot()
    samples = result["samples"]
    t = [s["t"] / 60 for s in samples]
    fig, axes = plt.subplots(3, 1, figsize=(7.5, 8), dpi=110, sharex=True)
    axes[0].plot(t, [(s["rss_bytes"] or 0) / 2**20 for s in samples], color="C0")
    axes[0].set_ylabel("server RSS (MiB)")
    axes[1].plot(t, [100 * (s["kv_usage"] or 0) for s in samples], color="C1", label="KV pages in use (%)")
    axes[1].plot(t, [s["running"] or 0 for s in samples], color="C2", label="running requests")
    axes[1].legend(fontsize=8)
    for key, colour in (("ttft_s", "C3"), ("tpot_s", "C4")):
        for q, style in ((0.5, "-"), (0.99, "--")):
            ys = [1000 * v if (v := pct(s[key], q)) else float("nan") for s in samples]
            axes[2].plot(t, ys, ls=style, color=colour, label=f"{key[:-2].upper()} p{int(q * 100)}")
    axes[2].set_yscale("log")
    axes[2].set_ylabel("latency (ms)")
    axes[2].legend(fontsize=8, ncol=2)
    axes[2].set_xlabel("minutes")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"soak: {result['rate']:.2f} requests/s, {len(result['outcomes'])} requests", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
