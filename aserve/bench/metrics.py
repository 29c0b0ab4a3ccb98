"""Arrival times and the numbers a run reports, in vLLM's `bench serve` names.

`arrival_intervals`: the wait before each request; 0 for an infinite rate, else gamma-distributed with
shape `burstiness` and scale 1 / (rate * burstiness): mean 1 / rate, coefficient of variation
1 / sqrt(burstiness) (1.0 is a Poisson process, as in vLLM).
`serve_metrics`: vLLM's result fields (`completed`, `total_input_tokens`, `request_throughput`,
`mean_ttft_ms`, `median_itl_ms`, `p99_e2el_ms`, ...); percentiles are numpy's linear interpolation, std the
population std, and an empty metric reports 0 (as vLLM). `summarize`: the compact report
benchmarks/peers.py and spec_decode.py tabulate (seconds, p50/p90/p99, None when empty).
"""

from __future__ import annotations

import math
import statistics

import numpy as np

from aserve.bench.client import RequestResult
from aserve.bench.datasets import SampleRequest

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


def arrival_intervals(num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds to wait before sending each of `num` requests (see the module docstring)."""
    if not request_rate > 0 or not burstiness > 0:
        raise ValueError("--request-rate and --burstiness: must be > 0")
    if math.isinf(request_rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness)
    return [float(x) for x in rng.gamma(shape=burstiness, scale=theta, size=num)]


def percentile_word(p: float) -> str:
    """vLLM's key spelling: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def _metric_values(results: list[RequestResult]) -> dict[str, list[float]]:
    ok = [r for r in results if r.ok]
    return {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [g for r in ok for g in r.itls],
        "e2el": [r.e2e for r in ok],
    }


def serve_metrics(requests: list[SampleRequest], results: list[RequestResult], duration: float,
                  percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl"),
                  metric_percentiles: tuple[float, ...] = (99.0,)) -> dict:
    """vLLM's result dict for one run: `results[i]` answers `requests[i]`."""
    ok = [(q, r) for q, r in zip(requests, results, strict=True) if r.ok]
    total_input = sum(r.prompt_tokens if r.prompt_tokens is not None else q.prompt_len for q, r in ok)
    output_lens = [r.output_tokens if r.ok else 0 for r in results]
    total_output = sum(output_lens)
    result: dict = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "request_goodput": None,
        "output_throughput": total_output / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_input + total_output) / duration if duration > 0 else 0.0,
    }
    values = _metric_values(results)
    for name in percentile_metrics:
        ms = np.asarray(values[name] or [0.0]) * 1000.0
        result[f"mean_{name}_ms"] = float(np.mean(ms))
        result[f"median_{name}_ms"] = float(np.median(ms))
        result[f"std_{name}_ms"] = float(np.std(ms))
        for p in metric_percentiles:
            result[f"p{percentile_word(p)}_{name}_ms"] = float(np.percentile(ms, p))
    result["input_lens"] = [q.prompt_len for q in requests]
    result["output_lens"] = output_lens
    result["ttfts"] = [r.ttft or 0.0 for r in results]
    result["itls"] = [r.itls for r in results]
    result["generated_texts"] = [r.generated_text for r in results]
    result["errors"] = [r.error for r in results]
    return result


def format_serve_metrics(result: dict, percentile_metrics: tuple[str, ...],
                         metric_percentiles: tuple[float, ...]) -> str:
    """vLLM's printed "Serving Benchmark Result" block."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]

    def row(label: str, value) -> None:
        lines.append(f"{label:<40}{value:<10.2f}" if isinstance(value, float) else f"{label:<40}{value:<10}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total Token throughput (tok/s):", result["total_token_throughput"])
    titles = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
              "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}
    for name in percentile_metrics:
        title, short = titles[name]
        lines.append("{s:{c}^50}".format(s=title, c="-"))
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", result[f"median_{name}_ms"])
        for p in metric_percentiles:
            row(f"P{percentile_word(p)} {short} (ms):", result[f"p{percentile_word(p)}_{name}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)


def percentile_summary(values: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 (linear interpolation) of `values` in their own unit; None when empty."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pct(p: float) -> float:
        k = (len(ordered) - 1) * p / 100.0
        lo, hi = math.floor(k), math.ceil(k)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {"mean": statistics.fmean(ordered), "p50": pct(50), "p90": pct(90), "p99": pct(99)}


def summarize(results: list[RequestResult], duration: float, model: str, *, endpoint: str,
              guided_json: bool = False, max_concurrency: int | None = None,
              request_rate: float = math.inf) -> dict:
    """The compact report (seconds): counts, throughputs and `ttft_s`/`tpot_s`/`itl_s`/`e2e_s` summaries."""
    ok = [r for r in results if r.ok]
    output_tokens = sum(r.output_tokens for r in ok)
    values = _metric_values(results)
    return {
        "model": model,
        "endpoint": endpoint,
        "guided_json": guided_json,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "max_concurrency": max_concurrency,
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_output_tokens": output_tokens,
        "ttft_s": percentile_summary(values["ttft"]),
        "tpot_s": percentile_summary(values["tpot"]),
        "itl_s": percentile_summary(values["itl"]),
        "e2e_s": percentile_summary(values["e2el"]),
    }
