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
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

_WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word "
    "business issue side kind head house service friend father power hour game line end member law car "
    "city community name president team minute idea kid body information back parent face others level "
    "office door health person art war history party result change morning reason research girl guy "
    "moment air teacher force education"
).split()


def make_dataset(num_prompts: int, words_per_prompt: int, seed: int) -> list[str]:
    """Deterministic synthetic prompts: the same seed gives the same prompts."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num_prompts):
        n = max(1, int(rng.gauss(words_per_prompt, words_per_prompt * 0.1)))
        body = " ".join(rng.choice(_WORDS) for _ in range(n))
        prompts.append(f"Request {i}. Summarize the following notes in one paragraph: {body}")
    return prompts


@dataclass
class RequestResult:
    ok: bool
    start: float = 0.0
    ttft: float | None = None
    e2e: float = 0.0
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# --guided-json: an open-ended list of records, so guided outputs, like unguided ones, tend to run to
# --max-tokens (output tok/s is compared, so an early stop costs batch occupancy, not the metric)
GUIDED_SCHEMA = {
    "type": "object",
    "properties": {"records": {"type": "array", "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "score": {"type": "integer"},
                       "level": {"enum": ["low", "mid", "high"]}},
        "required": ["name", "score", "level"]}}},
    "required": ["records"],
}


def _body(args: argparse.Namespace, model: str, prompt: str) -> dict:
    body: dict = {
        "model": model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.guided_json:
        if args.endpoint == "chat":
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "records", "schema": GUIDED_SCHEMA}}
        else:
            body["guided_json"] = GUIDED_SCHEMA
    return body


def _content(chunk: dict, endpoint: str) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def one_request(
    client: httpx.AsyncClient, args: argparse.Namespace, model: str, prompt: str
) -> RequestResult:
    path = "/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"
    result = RequestResult(ok=False, start=time.perf_counter())
    chunks = 0
    usage_tokens = None
    finished = False  # some servers (transformers serve) end the stream without data: [DONE]
    try:
        async with client.stream("POST", path, json=_body(args, model, prompt)) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                if not line:
                    continue
                if not line.startswith("data: "):
                    result.error = f"bad SSE line {line[:80]!r}"
                    return result
                payload = line[len("data: ") :]
                if payload == "[DONE]":
                    result.ok = True
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message"))
                    return result
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                if any(c.get("finish_reason") for c in chunk.get("choices") or ()):
                    finished = True
                if _content(chunk, args.endpoint):
                    now = time.perf_counter()
                    if result.ttft is None:
                        result.ttft = now - result.start
                    result.chunk_times.append(now)
                    chunks += 1
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    finally:
        result.e2e = time.perf_counter() - result.start
    result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    if not result.ok and not result.error:
        if finished:
            result.ok = True
        else:
            result.error = "the stream ended without a finish_reason or data: [DONE]"
    return result


async def resolve_model(client: httpx.AsyncClient, model: str) -> str:
    if model:
        return model
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def run(args: argparse.Namespace) -> dict:
    prompts = make_dataset(args.num_prompts, args.prompt_words, args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency or 1000, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout)
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=headers, limits=limits, timeout=timeout
    ) as client:
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


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pct(p: float) -> float:
        k = (len(ordered) - 1) * p / 100.0
        lo, hi = math.floor(k), math.ceil(k)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": statistics.fmean(ordered), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def summarize(results: list[RequestResult], duration: float, model: str, args: argparse.Namespace) -> dict:
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    return {
        "model": model,
        "endpoint": args.endpoint,
        "guided_json": args.guided_json,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "max_concurrency": args.max_concurrency,
        "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_output_tokens": output_tokens,
        "ttft_s": _percentiles([r.ttft for r in ok if r.ttft is not None]),
        "tpot_s": _percentiles([t for r in ok if (t := r.tpot) is not None]),
        "itl_s": _percentiles([g for r in ok for g in r.itls]),
        "e2e_s": _percentiles([r.e2e for r in ok]),
    }


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
