"""Fairness across API keys (issue 33's goal): a quiet key's p99 TTFT alone, then beside a key that floods at 10x its
requests-per-minute limit; the goal is the second within 25% of the first.

    mlc-cli keys hash quiet --key quiet-key > keys.yaml
    mlc-cli keys hash flood --key flood-key --requests-per-minute 60 >> keys.yaml
    mlc-cli serve --api-key-file keys.yaml &
    python -m mlc.bench.key_fairness --url http://127.0.0.1:8080 --quiet-key quiet-key --flood-key flood-key \\
        --flood-limit 60 --seconds 20

The quiet key sends one streaming request at a time (`--quiet-rps` a second at most); the flood key sends
`10 x --flood-limit` requests a minute, each in its own task, and its 429s are counted, not retried.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import httpx


def p99(values: list[float]) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))] if xs else float("nan")


async def ttft(client: httpx.AsyncClient, url: str, key: str, max_tokens: int) -> float | None:
    body = {"prompt": "Write a short note about the sea.", "max_tokens": max_tokens, "stream": True}
    start = time.monotonic()
    async with client.stream("POST", url + "/v1/completions", json=body,
                             headers={"Authorization": f"Bearer {key}"}) as r:
        if r.status_code != 200:
            await r.aread()
            return None
        first = None
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: ") and '"text"' in line:
                first = time.monotonic() - start
        return first


async def quiet_run(client, args, stop: float) -> list[float]:
    out: list[float] = []
    while time.monotonic() < stop:
        t0 = time.monotonic()
        t = await ttft(client, args.url, args.quiet_key, args.max_tokens)
        if t is not None:
            out.append(t)
        await asyncio.sleep(max(0.0, 1.0 / args.quiet_rps - (time.monotonic() - t0)))
    return out


async def flood_run(client, args, stop: float, counts: dict[str, int]) -> None:
    gap = 60.0 / (10 * args.flood_limit)
    tasks = []

    async def one() -> None:
        r = await client.post(args.url + "/v1/completions", headers={"Authorization": f"Bearer {args.flood_key}"},
                              json={"prompt": "Tell me everything about rivers.", "max_tokens": args.max_tokens})
        counts[str(r.status_code)] = counts.get(str(r.status_code), 0) + 1

    while time.monotonic() < stop:
        tasks.append(asyncio.ensure_future(one()))
        await asyncio.sleep(gap)
    await asyncio.gather(*tasks, return_exceptions=True)


async def main(args) -> dict:
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=1000)) as client:
        await ttft(client, args.url, args.quiet_key, args.max_tokens)  # warm-up, not counted
        alone = await quiet_run(client, args, time.monotonic() + args.seconds)
        counts: dict[str, int] = {}
        stop = time.monotonic() + args.seconds
        flooded, _ = await asyncio.gather(quiet_run(client, args, stop), flood_run(client, args, stop, counts))
    ratio = p99(flooded) / p99(alone)
    return {"quiet_alone": {"n": len(alone), "p99_ttft_s": round(p99(alone), 4)},
            "quiet_with_flood": {"n": len(flooded), "p99_ttft_s": round(p99(flooded), 4)},
            "flood_statuses": counts, "p99_ratio": round(ratio, 3), "goal_met": ratio <= 1.25}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--quiet-key", required=True)
    ap.add_argument("--flood-key", required=True)
    ap.add_argument("--flood-limit", type=int, default=60, help="the flood key's requests_per_minute")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    ap.add_argument("--quiet-rps", type=float, default=2.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    print(json.dumps(asyncio.run(main(ap.parse_args())), indent=2))
