"""Soak test for a live OpenAI-compatible server (a black-box client: imports nothing from aserve).

    python benchmarks/soak.py --base-url http://127.0.0.1:8000 --server-pid PID --minutes 10 \
        --concurrency 32 --max-tokens 64

Keeps `--concurrency` clients busy (saturation) for `--minutes`: each request is, at random, a valid
stream read to its end, a stream the client drops after its first chunk (`--disconnect-frac`, 10%),
or bad input the server must refuse with a 4xx (`--bad-frac`, 5%: malformed JSON, an out-of-range
field, an unknown field). It reports valid requests completed and failed (a failure is any valid
request that did not end in `finish_reason` + `[DONE]`; a 429 from an admission cap is counted as
refused, not failed), bad inputs answered 4xx (and any that were not), KV-cache usage once the load
stops (`aserve:kv_cache_usage_perc`, expected 0), and the server's RSS growth from the end of the
warm-up to the end (`--server-pid`, summed over its child processes; expected < 5%).

Fair-share mode: `--flood-key A --probe-key B` sends every client's requests with key A and, beside
them, one probe request a second with key B, and reports the probes' time to first token (TTFT)
under A's flood (start the server with `--api-key A --api-key B`). Exit status: 0 when no valid
request failed, every bad input got a 4xx, KV usage returned to 0 and RSS grew < 5%; else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

_BAD_BODIES = (
    b'{"prompt": "hello", "max_tokens": ',  # malformed JSON
    b'{"prompt": "hello", "max_tokens": 8, "temperature": -3}',  # out of range
    b'{"prompt": "hello", "max_tokens": 8, "no_such_field": 1}',  # unknown field
)


_WORDS = ("alpha", "beta", "gamma", "delta", "omega")


def auth_headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


@dataclass
class Tally:
    completed: int = 0
    failed: int = 0
    refused_429: int = 0
    disconnected: int = 0
    bad_rejected: int = 0
    bad_accepted: int = 0
    failures: list[str] = field(default_factory=list)
    probe_ttfts: list[float] = field(default_factory=list)


def rss_bytes(pid: int) -> int:
    """Resident memory of `pid` and its child processes (Linux /proc)."""
    total = 0
    pids = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        pids += [int(c) for c in (task / "children").read_text().split()]
    for p in pids:
        match = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{p}/status").read_text(), re.MULTILINE)
        total += int(match.group(1)) * 1024 if match else 0
    return total


async def kv_usage(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    match = re.search(r"^(?:vllm|aserve):kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else float("nan")


async def valid_stream(
    client: httpx.AsyncClient, body: dict, tally: Tally, drop: bool, headers: dict
) -> float | None:
    """One streaming request; returns its TTFT (None if it did not complete)."""
    start = time.perf_counter()
    ttft = None
    try:
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
            if r.status_code == 429:
                tally.refused_429 += 1
                return None
            if r.status_code != 200:
                tally.failed += 1
                tally.failures.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return None
            finished, done = False, False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if ttft is None:
                    ttft = time.perf_counter() - start
                if drop:
                    tally.disconnected += 1
                    return None  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    tally.failures.append(f"error event: {chunk['error']}")
                    break
                finished = finished or any(c.get("finish_reason") for c in chunk.get("choices", []))
            if finished and done:
                tally.completed += 1
                return ttft
            tally.failed += 1
    except httpx.HTTPError as exc:
        tally.failed += 1
        tally.failures.append(f"{type(exc).__name__}: {exc}")
    return None


async def bad_input(client: httpx.AsyncClient, tally: Tally, rng: random.Random, headers: dict) -> None:
    body = rng.choice(_BAD_BODIES)
    r = await client.post("/v1/completions", content=body,
                          headers={**headers, "content-type": "application/json"})
    if 400 <= r.status_code < 500 and r.status_code != 429:
        tally.bad_rejected += 1
    elif r.status_code != 429:
        tally.bad_accepted += 1
        tally.failures.append(f"bad input got HTTP {r.status_code}")


async def worker(
    client: httpx.AsyncClient, args: argparse.Namespace, tally: Tally, stop_at: float, seed: int
) -> None:
    rng = random.Random(seed)
    headers = auth_headers(args.flood_key or args.api_key)
    while time.monotonic() < stop_at:
        roll = rng.random()
        if roll < args.bad_frac:
            await bad_input(client, tally, rng, headers)
            continue
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, args.max_prompt_words)))
        body = {"prompt": words, "max_tokens": rng.randint(1, args.max_tokens), "stream": True,
                "ignore_eos": True, "temperature": rng.choice((0.0, 0.8))}
        await valid_stream(client, body, tally, roll < args.bad_frac + args.disconnect_frac, headers)


async def prober(client: httpx.AsyncClient, args: argparse.Namespace, tally: Tally, stop_at: float) -> None:
    headers = {"Authorization": f"Bearer {args.probe_key}"}
    while time.monotonic() < stop_at:
        body = {"prompt": "probe alpha beta", "max_tokens": 4, "stream": True, "ignore_eos": True}
        ttft = await valid_stream(client, body, tally, False, headers)
        if ttft is not None:
            tally.probe_ttfts.append(ttft)
        await asyncio.sleep(1.0)


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(int(q * len(values)), len(values) - 1)] if values else float("nan")


async def main(args: argparse.Namespace) -> int:
    tally = Tally()
    limits = httpx.Limits(max_connections=args.concurrency + 8)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits) as client:
        start = time.monotonic()
        stop_at = start + args.minutes * 60
        rss_warm: list[int] = []

        async def sample_rss_after_warmup() -> None:
            await asyncio.sleep(min(args.warmup_s, args.minutes * 60 / 2))
            if args.server_pid:
                rss_warm.append(rss_bytes(args.server_pid))

        tasks = [worker(client, args, tally, stop_at, args.seed + i) for i in range(args.concurrency)]
        if args.probe_key:
            tasks.append(prober(client, args, tally, stop_at))
        await asyncio.gather(sample_rss_after_warmup(), *tasks)
        elapsed = time.monotonic() - start
        await asyncio.sleep(1.0)
        headers = auth_headers(args.flood_key or args.api_key)
        # One more request, so that the gauges are those of a step taken after every client left.
        await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers)
        usage = await kv_usage(client)
    rss_end = rss_bytes(args.server_pid) if args.server_pid else 0
    growth = (rss_end - rss_warm[0]) / rss_warm[0] if rss_warm else None
    report = {
        "seconds": round(elapsed, 1), "concurrency": args.concurrency,
        "valid_completed": tally.completed, "valid_failed": tally.failed, "refused_429": tally.refused_429,
        "disconnected_mid_stream": tally.disconnected, "bad_input_rejected_4xx": tally.bad_rejected,
        "bad_input_not_rejected": tally.bad_accepted, "kv_cache_usage_at_end": usage,
        "rss_after_warmup_mib": round(rss_warm[0] / 2**20, 1) if rss_warm else None,
        "rss_at_end_mib": round(rss_end / 2**20, 1) if rss_end else None,
        "rss_growth": round(growth, 4) if growth is not None else None,
        "first_failures": tally.failures[:10],
    }
    if args.probe_key:
        ttfts = tally.probe_ttfts
        report["probe_ttft_s"] = {"n": len(ttfts), "p50": pct(ttfts, 0.5), "p99": pct(ttfts, 0.99),
                                  "mean": statistics.fmean(ttfts) if ttfts else None}
    print(json.dumps(report, indent=2))
    ok = (tally.failed == 0 and tally.bad_accepted == 0 and usage == 0.0
          and (growth is None or growth < 0.05))
    return 0 if ok else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--server-pid", type=int, default=0, help="the server's pid, to measure its RSS")
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=60.0, help="RSS is measured from the end of the warm-up")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-prompt-words", type=int, default=60, help="valid prompts have 1 .. this many words")
    p.add_argument("--disconnect-frac", type=float, default=0.10)
    p.add_argument("--bad-frac", type=float, default=0.05)
    p.add_argument("--api-key", default="")
    p.add_argument("--flood-key", default="", help="fair-share mode: every client's key")
    p.add_argument("--probe-key", default="", help="fair-share mode: the probe's key (TTFT reported)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse_args())))
