"""`bench soak`: hours of mixed traffic at a steady rate, watching what creeps.

It starts `mlc-cli serve` on its defaults (or loads a running server, `url`), measures the mix's saturation in a
short closed loop unless a rate is given, then sends the mix (bench/soak_mix.py) as Poisson arrivals at `load` of
that for `duration_s`, and every `sample_s` samples the server: RSS (the process and its children, from /proc when
it started the server; /metrics' process_resident_memory_bytes otherwise), KV pages in use, running and waiting
requests, open fds, threads and asyncio tasks (/metrics), and the latency of the requests finished since the last
sample. After the traffic it waits for the server to drain, then checks the invariants (bench/soak_report.py),
writes soak.json, soak.md and soak.png, and returns whether they all held.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from mlc.bench import peers
from mlc.bench.soak_clients import Crowd
from mlc.bench.soak_mix import MixContext, Outcome, closed_loop, send

DRAIN_S = 30.0


@dataclass
class SoakConfig:
    out_dir: Path
    duration_s: float = 3600.0
    url: str | None = None  # a running server; default: start `mlc-cli serve` with `server_args`
    model: str | None = None
    server_args: list[str] = field(default_factory=list)
    rate: float | None = None  # requests/s; None: `load` x the saturation measured first
    load: float = 0.7
    sample_s: float = 5.0
    warmup_s: float | None = None  # default: a tenth of the run, at most 5 minutes
    lora: str | None = None  # an adapter the server serves, added to the mix
    max_rss_growth: float = 0.05
    max_latency_drift: float = 0.2
    idle_connections: int = 0  # held open beside the mix (reopened when the server cuts them)
    slow_readers: int = 0  # long streams read a byte a second
    crowd_after_s: float = 0.0  # when the crowd joins: 0 from the start; later, the mix's p99 before it is the baseline
    max_crowd_slowdown: float = 0.2  # allowed rise of the mix's p99 TTFT and TPOT once the crowd is there
    seed: int = 0

    @property
    def warmup(self) -> float:
        return self.warmup_s if self.warmup_s is not None else min(300.0, self.duration_s / 10)


def _proc_rss(pid: int) -> int | None:
    """VmRSS of `pid` and its live descendants (a tensor-parallel worker), bytes."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(ln.split()[1]) * 1024 for ln in status.splitlines() if ln.startswith("VmRSS:"))
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration, ValueError):
            if p == pid:
                return None
    return total


def _metrics(text: str) -> dict[str, float]:
    """Unlabelled-or-first-labelled sample per metric name."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out.setdefault(name.split("{")[0], float(value))
    return out


async def _health_ms(client: httpx.AsyncClient, url: str) -> float | None:
    start = time.monotonic()
    try:
        ok = (await client.get(url + "/health", timeout=30)).status_code == 200
    except httpx.HTTPError:
        ok = False
    return 1000 * (time.monotonic() - start) if ok else None


async def _sample(client: httpx.AsyncClient, url: str, pid: int | None, t0: float, finished: list[Outcome],
                  since: int, crowd: Crowd | None = None) -> dict:
    health = [await _health_ms(client, url) for _ in range(3)]
    m = _metrics((await client.get(url + "/metrics", timeout=30)).text)
    rss = _proc_rss(pid) if pid is not None else None
    window = [o for o in finished[since:] if o.status == 200 and not o.injected]
    return {"t": time.monotonic() - t0, "rss_bytes": rss or m.get("process_resident_memory_bytes"),
            "kv_usage": m.get("mlc:kv_cache_usage_perc"), "running": m.get("mlc:num_requests_running"),
            "waiting": m.get("mlc:num_requests_waiting"), "open_fds": m.get("process_open_fds"),
            "threads": m.get("mlc:server_threads"), "asyncio_tasks": m.get("mlc:server_asyncio_tasks"),
            "finished": len(finished) - since,
            "ttft_s": [o.ttft for o in window if o.ttft is not None], "tpot_s": [o.tpot for o in window if o.tpot],
            "health_ms": [h for h in health if h is not None], "health_failed": health.count(None),
            **(crowd.stats() if crowd is not None else {})}


async def _context(client: httpx.AsyncClient, url: str, cfg: SoakConfig) -> MixContext:
    from mlc.bench.compare import long_text

    info = (await client.get(url + "/v1/models", timeout=30)).json()["data"][0]
    context = int(info.get("max_model_len") or 2048)
    text = long_text()
    words = text.split()
    # about 0.7 tokens a word in English prose: a prompt of ~90% of the context, leaving room for the answer
    long_prompt = " ".join(words[: int(context * 0.9 * 0.7)])
    return MixContext(model=cfg.model or info["id"], context=context, shared_system=" ".join(words[:700]),
                      long_text=long_prompt, lora=cfg.lora)


def _done(task: asyncio.Task, tasks: set[asyncio.Task], finished: list[Outcome], t0: float) -> None:
    tasks.discard(task)
    if task.cancelled() or task.exception() is not None:  # a bug on the client's side: kept, never silent
        finished.append(Outcome("client_error", time.monotonic() - t0, 0, 0.0, error=repr(task.exception())))
    else:
        finished.append(task.result())


async def _traffic(cfg: SoakConfig, url: str, pid: int | None, started: float | None, progress) -> dict:
    rng = random.Random(cfg.seed)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=512), timeout=600) as client:
        ctx = await _context(client, url, cfg)
        rate = cfg.rate
        saturation = None
        if rate is None:
            progress("measuring the mix's saturation: 16 clients back to back for 60 s")
            saturation = await closed_loop(url, ctx, 16, 60.0, cfg.seed)
            rate = max(0.05, cfg.load * saturation)
        progress(f"soak: {cfg.duration_s:.0f} s at {rate:.2f} requests/s"
                 + (f" ({cfg.load:.0%} of {saturation:.2f} measured)" if saturation else ""))
        crowd, crowd_started = None, None
        if cfg.idle_connections or cfg.slow_readers:
            where = httpx.URL(url)
            crowd = Crowd(where.host, where.port or 80, ctx.model, cfg.idle_connections, cfg.slow_readers)
        finished: list[Outcome] = []
        samples: list[dict] = []
        tasks: set[asyncio.Task] = set()
        t0 = time.monotonic()
        next_sample, since = 0.0, 0
        arrival = 0.0
        while time.monotonic() - t0 < cfg.duration_s:
            now = time.monotonic() - t0
            if crowd is not None and crowd_started is None and now >= cfg.crowd_after_s:
                crowd.start()
                crowd_started = now
                progress(f"{now:6.0f} s: holding {cfg.idle_connections} idle connections and {cfg.slow_readers} "
                         "slow readers from now on")
            if now >= next_sample:
                samples.append(await _sample(client, url, pid, t0, finished, since,
                                             crowd if crowd_started is not None else None))
                since = len(finished)
                next_sample += cfg.sample_s
                s = samples[-1]
                progress(f"{now:6.0f} s: RSS {(s['rss_bytes'] or 0) / 2**20:.0f} MiB, KV "
                         f"{100 * (s['kv_usage'] or 0):.1f}%, {s['running'] or 0:.0f} running, "
                         f"{s['waiting'] or 0:.0f} waiting, {len(finished)} done")
            if now >= arrival:
                task = asyncio.create_task(send(client, url, ctx.choose(rng), ctx, rng, t0))
                tasks.add(task)
                task.add_done_callback(lambda t: _done(t, tasks, finished, t0))
                arrival += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, min(arrival, next_sample) - (time.monotonic() - t0)))
        if tasks:
            await asyncio.wait(tasks, timeout=600)
        if crowd is not None and crowd_started is not None:
            await crowd.stop()
        drained = time.monotonic()
        while time.monotonic() - drained < DRAIN_S:  # the server ends aborted requests and frees their pages
            end = await _sample(client, url, pid, t0, finished, since)
            if not end["running"] and not end["waiting"] and not end["kv_usage"]:
                break
            await asyncio.sleep(1.0)
        return {"rate": rate, "saturation": saturation, "t0": t0, "server_started": started,
                "crowd_started": crowd_started if cfg.crowd_after_s > 0 else None,  # set when it joined mid-run
                "samples": samples, "end": end, "outcomes": [asdict(o) for o in finished]}


def run_soak(cfg: SoakConfig, progress=print) -> tuple[dict, bool]:
    from mlc.bench.compare_run import machine
    from mlc.bench.soak_report import check, markdown, plot

    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        pid, started, url = None, None, cfg.url
        if url is None:
            spec = peers.ours(cfg.model or "smollm2-135m-instruct", cfg.out_dir, cfg.server_args)
            progress(f"starting {spec.label}")
            server = stack.enter_context(peers.RunningServer(spec))
            pid, url = server.proc.pid if server.proc else None, spec.url
            started = time.monotonic() - server.startup_s
        result = asyncio.run(_traffic(cfg, url, pid, started, progress))
    result["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
    result["machine"] = machine()
    result["invariants"] = check(result, cfg)
    ok = all(inv["ok"] is not False for inv in result["invariants"])
    result["plot"] = str(plot(result, cfg.out_dir / "soak.png"))
    (cfg.out_dir / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    (cfg.out_dir / "soak.md").write_text(markdown(result))
    return result, ok
