"""Serving benchmark for any OpenAI-compatible server (a black-box client: imports nothing from aserve).

    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --num-prompts 64 --max-concurrency 8 \
        --max-tokens 64 --ignore-eos

Sends a seeded dataset of synthetic prompts (~200 words each) as streaming requests, limited by
`--max-concurrency` and/or paced by a Poisson process of `--request-rate` requests/s, and reports
request and output-token throughput plus p50/p90/p99 of time to first token (TTFT), time per
output token after the first (TPOT), inter-token latency (ITL, every gap between content chunks)
and end-to-end latency. `--json-out` writes the numbers as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # aserve from a checkout
from aserve.bench import client as _client
from aserve.bench.client import GUIDED_SCHEMA, RequestResult, RequestSpec, resolve_model  # noqa: F401
from aserve.bench.datasets import make_dataset
from aserve.bench.metrics import percentile_summary as _percentiles  # noqa: F401


def request_spec(args: argparse.Namespace) -> RequestSpec:
    chat = args.endpoint == "chat"
    return RequestSpec(path="/v1/chat/completions" if chat else "/v1/completions", chat=chat,
                       max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos,
                       guided_json=args.guided_json)


def _body(args: argparse.Namespace, model: str, prompt: str) -> dict:
    return _client.build_body(request_spec(args), model, prompt)


async def one_request(client: httpx.AsyncClient, args: argparse.Namespace, model: str, prompt: str
                      ) -> RequestResult:
    return await _client.one_request(client, request_spec(args), model, prompt)


async def run(args: argparse.Namespace) -> dict:
    prompts = make_dataset(args.num_prompts, args.prompt_words, args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or 1000, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout)) as client:
        model = await resolve_model(client, args.model)
        semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        arrival_rng = random.Random(args.seed + 1)

        async def limited(prompt: str) -> RequestResult:
            if semaphore is None:
                return await one_request(client, args, model, prompt)
            async with semaphore:
                return await one_request(client, args, model, prompt)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(limited(prompt)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(arrival_rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, model, args)


def summarize(results: list[RequestResult], duration: float, model: str, args: argparse.Namespace) -> dict:
    from aserve.bench.metrics import summarize as _summarize

    return _summarize(results, duration, model, endpoint=args.endpoint, guided_json=args.guided_json,
                      max_concurrency=args.max_concurrency, request_rate=args.request_rate)


def format_report(report: dict) -> str:
    path = "chat/completions" if report["endpoint"] == "chat" else "completions"
    concurrency = report["max_concurrency"] or "unlimited"
    lines = [
        f"model {report['model']} via /v1/{path}" + (" (json_schema-guided)" if report.get("guided_json") else ""),
        f"requests: {report['completed']} completed, {report['failed']} failed "
        f"in {report['duration_s']:.2f} s (max concurrency {concurrency}, "
        f"rate {report['request_rate']} req/s)",
        f"request throughput: {report['request_throughput']:.2f} req/s",
        f"output token throughput: {report['output_throughput']:.1f} tok/s "
        f"({report['total_output_tokens']} tokens)",
        f"{'metric (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for key, label in (("ttft_s", "TTFT"), ("tpot_s", "TPOT"), ("itl_s", "ITL"), ("e2e_s", "E2E")):
        stats = report[key]
        cells = "".join(
            f"{(stats[k] * 1000 if stats[k] is not None else float('nan')):>10.1f}"
            for k in ("mean", "p50", "p90", "p99")
        )
        lines.append(f"{label:<12}{cells}")
    for error in report["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--model", default="", help="model name (default: the first from GET /v1/models)")
    p.add_argument("--api-key", default="")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--prompt-words", type=int, default=200, help="mean words per synthetic prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--guided-json", action="store_true",
                   help="constrain every output to a JSON schema (response_format json_schema on chat, "
                        "guided_json on completions); compare with a run without it on the same prompts")
    p.add_argument("--ignore-eos", action="store_true", help="vLLM extension: always generate --max-tokens")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals at this many requests/s (default: all at once)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--json-out", default=None, help="also write the report as JSON to this file")
    args = p.parse_args(argv)
    if args.num_prompts < 1:
        p.error("--num-prompts: must be >= 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        p.error("--max-concurrency: must be >= 1")
    if not args.request_rate > 0:
        p.error("--request-rate: must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(run(args))
    print(format_report(report))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
