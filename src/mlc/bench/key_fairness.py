"""`bench fairness`: fairness across API keys (issue 33's goal). A quiet key's p99 TTFT alone, then beside a key that
floods at 10x its requests-per-minute limit; the goal is the second within 25% of the first.

It starts `mlc-cli serve` on its defaults with a key file of its own (a quiet key without limits, and one flood key
a round, each with `flood_limit` requests a minute: a fresh key finds its rolling minute empty, so every round's
flood is the same), or loads a running server (`url`) with keys the caller gives. Each round is `seconds` of the
quiet key alone, then `seconds` of both. The quiet key sends one streaming request at a time (`quiet_rps` a second
at most); the flood key sends `10 x flood_limit` non-streaming requests a minute, each in its own task, and its 429s
are counted, not retried. The verdict pools the rounds' TTFTs.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import yaml

from mlc.bench import peers

GOAL = 1.25


@dataclass
class FairnessConfig:
    out_dir: Path
    url: str | None = None  # a running server; default: start `mlc-cli serve` with its own key file
    model: str | None = None
    server_args: list[str] = field(default_factory=list)
    quiet_key: str | None = None  # with `url`: the keys the server knows
    flood_keys: list[str] = field(default_factory=list)  # one a round (reused round-robin when fewer)
    flood_limit: int = 60  # the flood key's requests_per_minute
    rounds: int = 3
    seconds: float = 20.0
    quiet_rps: float = 2.0
    max_tokens: int = 16


def quantile(values: list[float], q: float) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def p99(values: list[float]) -> float:
    return quantile(values, 0.99)


def write_key_file(path: Path, rounds: int, flood_limit: int) -> tuple[str, list[str]]:
    """A key file (`serve --api-key-file`: names and SHA-256 hashes) with a quiet key and `rounds` flood keys;
    (the quiet key, the flood keys)."""
    quiet, floods = _new_key(), [_new_key() for _ in range(rounds)]
    entries: list[dict[str, str | int]] = [{"name": "quiet", "key_sha256": hashlib.sha256(quiet.encode()).hexdigest()}]
    entries += [{"name": f"flood{i}", "key_sha256": hashlib.sha256(k.encode()).hexdigest(),
                 "requests_per_minute": flood_limit} for i, k in enumerate(floods)]
    path.write_text(yaml.safe_dump({"keys": entries}, sort_keys=False))
    path.chmod(0o600)
    return quiet, floods


def _new_key() -> str:
    return "mlc-bench-" + secrets.token_urlsafe(24)


async def ttft(client: httpx.AsyncClient, url: str, key: str, max_tokens: int) -> float | None:
    body = {"prompt": "Write a short note about the sea.", "max_tokens": max_tokens, "stream": True}
    start = time.monotonic()
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"the quiet key's request got {r.status_code}: {r.text[:300]}")
        first = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: ") and '"text"' in line:
                first = time.monotonic() - start
        return first


async def quiet_run(client: httpx.AsyncClient, url: str, key: str, cfg: FairnessConfig, stop: float) -> list[float]:
    out: list[float] = []
    while time.monotonic() < stop:
        t0 = time.monotonic()
        t = await ttft(client, url, key, cfg.max_tokens)
        if t is not None:
            out.append(t)
        await asyncio.sleep(max(0.0, 1.0 / cfg.quiet_rps - (time.monotonic() - t0)))
    return out


async def flood_run(client: httpx.AsyncClient, url: str, key: str, cfg: FairnessConfig, stop: float,
                    counts: dict[str, int]) -> None:
    gap = 60.0 / (10 * cfg.flood_limit)
    tasks = []

    async def one() -> None:
        r = await client.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                              json={"prompt": "Tell me everything about rivers.", "max_tokens": cfg.max_tokens})
        counts[str(r.status_code)] = counts.get(str(r.status_code), 0) + 1

    while time.monotonic() < stop:
        tasks.append(asyncio.ensure_future(one()))
        await asyncio.sleep(gap)
    await asyncio.gather(*tasks, return_exceptions=True)


async def _rounds(url: str, quiet: str, floods: list[str], cfg: FairnessConfig, progress) -> dict:
    rounds: list[dict] = []
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=1000)) as client:
        await ttft(client, url, quiet, cfg.max_tokens)  # warm-up, not counted
        for i in range(cfg.rounds):
            alone = await quiet_run(client, url, quiet, cfg, time.monotonic() + cfg.seconds)
            counts: dict[str, int] = {}
            stop = time.monotonic() + cfg.seconds
            flooded, _ = await asyncio.gather(quiet_run(client, url, quiet, cfg, stop),
                                              flood_run(client, url, floods[i % len(floods)], cfg, stop, counts))
            rounds.append({"alone_s": alone, "flooded_s": flooded, "flood_statuses": counts,
                           "p99_ratio": round(p99(flooded) / p99(alone), 3)})
            progress(f"round {i + 1}: quiet p99 TTFT {1000 * p99(alone):.1f} ms alone, {1000 * p99(flooded):.1f} ms "
                     f"beside the flood ({rounds[-1]['p99_ratio']:.2f}x); flood statuses {counts}")
    alone = [t for r in rounds for t in r["alone_s"]]
    flooded = [t for r in rounds for t in r["flooded_s"]]
    ratio = p99(flooded) / p99(alone)
    return {"quiet_alone": {"n": len(alone), "p50_ttft_s": round(quantile(alone, 0.5), 4),
                            "p99_ttft_s": round(p99(alone), 4)},
            "quiet_with_flood": {"n": len(flooded), "p50_ttft_s": round(quantile(flooded, 0.5), 4),
                                 "p99_ttft_s": round(p99(flooded), 4)},
            "rounds": rounds, "p99_ratio": round(ratio, 3), "goal": GOAL, "goal_met": ratio <= GOAL}


def run_fairness(cfg: FairnessConfig, progress=print) -> dict:
    from mlc.bench.compare_run import machine

    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        url, quiet, floods = cfg.url, cfg.quiet_key, cfg.flood_keys
        if url is None:
            quiet, floods = write_key_file(cfg.out_dir / "keys.yaml", cfg.rounds, cfg.flood_limit)
            spec = peers.ours(cfg.model or "smollm2-135m-instruct", cfg.out_dir,
                              ["--api-key-file", str(cfg.out_dir / "keys.yaml"), *cfg.server_args])
            progress(f"starting {spec.label}")
            url = stack.enter_context(peers.RunningServer(spec)).spec.url
        if quiet is None or not floods:
            raise ValueError("bench fairness against a running server needs its quiet key and a flood key")
        result = asyncio.run(_rounds(url, quiet, floods, cfg, progress))
    config = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()
              if k not in ("quiet_key", "flood_keys")}  # never the keys
    return {**result, "config": config, "machine": machine()}
