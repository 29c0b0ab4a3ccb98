"""GET /dashboard (a live status page) and GET /dashboard/data (the JSON it polls).

`DashboardStats` is a StatLogger the app registers with the engine (as it does the Prometheus one):
it keeps one bucket per second of the last `window_s` seconds (tokens, latency observations, the
scheduler's gauges), and `snapshot` turns them into the page's data. Totals (tokens, preemptions,
prefix-cache queries and hits) are read from the app's Prometheus registry, so the page's counters
are the very values `/metrics` exports.

The page is package data (`static/dashboard.html`: HTML, JS and inline SVG; no build step, no CDN).
Both routes need the API key when one is set; a browser cannot send the Authorization header on
navigation, so GET /dashboard also takes the key as `?key=` (app.py's gate) and the page then sends
it as a Bearer header on each poll of /dashboard/data.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from aserve.engine.stats import IterationStats, SchedulerStats
from aserve.server.metrics import PrometheusStatLogger
from aserve.server.protocol import encoder
from aserve.server.state import get_state

MAX_SAMPLES_PER_BUCKET = 1000  # TTFT / ITL observations kept per second (a uniform reservoir beyond)
PERCENTILES = (50, 90, 99)


@dataclass
class _Bucket:
    """What the engine reported during one second (`second`: int(monotonic clock))."""

    second: int
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    num_ttft_seen: int = 0
    num_itl_seen: int = 0
    gauges: SchedulerStats = field(default_factory=SchedulerStats)


def percentile(values: list[float], pct: float) -> float | None:
    """The nearest-rank `pct` percentile of `values` (None when empty)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(math.ceil(pct / 100 * len(ordered)), 1)
    return ordered[rank - 1]


class DashboardStats:
    """A StatLogger keeping per-second buckets of the last `window_s` seconds (a bounded deque);
    `clock` is monotonic seconds, `wall` the wall clock (request ages). Called on the event loop only."""

    def __init__(self, window_s: int = 300, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time):
        self.window_s = window_s
        self._clock = clock
        self._wall = wall
        self._buckets: deque[_Bucket] = deque(maxlen=window_s)
        self._rng = random.Random(0)

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        second = int(self._clock())
        if not self._buckets or self._buckets[-1].second != second:
            self._buckets.append(_Bucket(second))
        b = self._buckets[-1]
        s, it = scheduler_stats, iteration_stats
        b.gauges = s
        b.prompt_tokens += it.num_prompt_tokens
        b.generation_tokens += it.num_generation_tokens
        b.preemptions += s.num_preemptions
        b.prefix_queries += s.prefix_cache_queries
        b.prefix_hits += s.prefix_cache_hits
        for value in it.time_to_first_tokens:
            b.num_ttft_seen += 1
            self._keep(b.ttfts, value, b.num_ttft_seen)
        for value in it.inter_token_latencies:
            b.num_itl_seen += 1
            self._keep(b.itls, value, b.num_itl_seen)

    def _keep(self, samples: list[float], value: float, num_seen: int) -> None:
        if len(samples) < MAX_SAMPLES_PER_BUCKET:
            samples.append(value)
        else:
            slot = self._rng.randrange(num_seen)
            if slot < MAX_SAMPLES_PER_BUCKET:
                samples[slot] = value

    def series(self) -> list[dict[str, Any]]:
        """One point per second that saw engine steps, oldest first; `t` is seconds before now
        (<= 0). Latency and hit-rate fields are None in a second without observations."""
        now = self._clock()
        out = []
        for b in self._buckets:
            if now - b.second > self.window_s:
                continue
            g = b.gauges
            used, total, cached = g.num_used_blocks, g.num_total_blocks, g.num_cached_free_blocks
            out.append({
                "t": round(b.second - now, 3),
                "prompt_tps": b.prompt_tokens, "generation_tps": b.generation_tokens,
                "running": g.num_running_reqs, "waiting": g.num_waiting_reqs, "swapped": g.num_swapped_reqs,
                "used_blocks": used, "cached_blocks": cached, "free_blocks": max(total - used - cached, 0),
                "ttft_p50": percentile(b.ttfts, 50), "ttft_p99": percentile(b.ttfts, 99),
                "itl_p50": percentile(b.itls, 50), "itl_p99": percentile(b.itls, 99),
                "prefix_hit_rate": b.prefix_hits / b.prefix_queries if b.prefix_queries else None,
                "preemptions": b.preemptions,
            })
        return out

    def latency(self) -> dict[str, dict[str, Any]]:
        """TTFT and ITL percentiles (seconds) over the window: `{"ttft": {"p50": .., "p90": .., "p99":
        .., "count": n}, "itl": {...}}`; percentiles None without observations."""
        now = self._clock()
        recent = [b for b in self._buckets if now - b.second <= self.window_s]
        out = {}
        for name, values, seen in (("ttft", [v for b in recent for v in b.ttfts], sum(b.num_ttft_seen for b in recent)),
                                   ("itl", [v for b in recent for v in b.itls], sum(b.num_itl_seen for b in recent))):
            out[name] = {f"p{p}": percentile(values, p) for p in PERCENTILES} | {"count": seen}
        return out

    def snapshot(self, live: SchedulerStats, metrics: PrometheusStatLogger, inflight: list[Any]) -> dict[str, Any]:
        """The /dashboard/data document: `live` scheduler gauges now, `metrics`' totals (the values
        /metrics exports), the window's latency percentiles and series, and `inflight` requests
        (InflightRequest: id, state, token counts and age in seconds; never prompt text)."""
        total, used, cached = live.num_total_blocks, live.num_used_blocks, live.num_cached_free_blocks
        totals = prometheus_totals(metrics)
        queries, hits = totals["prefix_cache_queries"], totals["prefix_cache_hits"]
        wall = self._wall()
        return {
            "model": metrics.model_name,
            "window_s": self.window_s,
            "kv": {"num_total_blocks": total, "num_used_blocks": used, "num_cached_blocks": cached,
                   "num_free_blocks": max(total - used - cached, 0), "usage": live.kv_cache_usage},
            "queues": {"running": live.num_running_reqs, "waiting": live.num_waiting_reqs,
                       "swapped": live.num_swapped_reqs},
            "totals": totals | {"prefix_cache_hit_rate": hits / queries if queries else None},
            "latency": self.latency(),
            "series": self.series(),
            "requests": [{"id": r.request_id, "state": r.state, "prompt_tokens": r.num_prompt_tokens,
                          "output_tokens": r.num_output_tokens, "age_s": round(max(wall - r.arrival_time, 0.0), 3)}
                         for r in inflight],
        }


# Prometheus series behind the page's counters: field -> name after the prefix's colon
_TOTALS = {
    "prompt_tokens": "prompt_tokens_total",
    "generation_tokens": "generation_tokens_total",
    "num_preemptions": "num_preemptions_total",
    "prefix_cache_queries": "prefix_cache_queries_total",
    "prefix_cache_hits": "prefix_cache_hits_total",
    "requests_received": "request_total",
    "requests_succeeded": "request_process_success_total",
    "requests_failed": "request_process_fail_total",
}


def prometheus_totals(metrics: PrometheusStatLogger) -> dict[str, int]:
    """The counters `/metrics` exports now for `metrics.model_name`, summed over the `engine` label
    (data-parallel replicas), as ints (0 when absent)."""
    keys = {f"{metrics.prefix}:{name}": key for key, name in _TOTALS.items()}
    out = dict.fromkeys(_TOTALS, 0)
    for family in metrics.registry.collect():
        for sample in family.samples:
            key = keys.get(sample.name)
            if (key is not None and sample.labels.get("model_name") == metrics.model_name
                    and sample.labels.keys() <= {"model_name", "engine"}):
                out[key] += int(sample.value)
    return out


def page_html() -> str:
    """The page (package data)."""
    return resources.files("aserve.server").joinpath("static/dashboard.html").read_text(encoding="utf-8")


async def dashboard_page(request: Request) -> Response:
    """The live page; it polls /dashboard/data about once a second."""
    return HTMLResponse(page_html(), headers={"Cache-Control": "no-store", "Referrer-Policy": "no-referrer"})


async def dashboard_data(request: Request) -> Response:
    """The page's data (DashboardStats.snapshot)."""
    state = get_state(request)
    stats: DashboardStats = request.app.state.dashboard
    doc = stats.snapshot(state.engine.get_scheduler_stats(), state.metrics, state.engine.inflight_requests())
    return Response(encoder.encode(doc), media_type="application/json", headers={"Cache-Control": "no-store"})
