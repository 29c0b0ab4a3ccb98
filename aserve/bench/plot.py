"""The concurrency-sweep PNG: output throughput, then TTFT and ITL p50/p99, against max concurrency.

Reads the raw per-request `ttfts` / `itls` of each pass (so the plot does not depend on
--metric-percentiles). matplotlib is the optional `bench` extra: `require_matplotlib` raises RuntimeError
with the install line when it is missing.
"""

from __future__ import annotations

import importlib.util

import numpy as np


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise RuntimeError("--plot needs matplotlib: pip install 'aserve[bench]' (or pip install matplotlib)")


def sweep_points(passes: list[dict]) -> dict[str, list[float]]:
    """Per pass: concurrency, output tok/s, and TTFT / ITL p50 and p99 in ms (0 when empty)."""

    def pct(values: list[float], p: float) -> float:
        return float(np.percentile(np.asarray(values or [0.0]) * 1000.0, p))

    points: dict[str, list[float]] = {k: [] for k in ("concurrency", "output_throughput", "ttft_p50",
                                                      "ttft_p99", "itl_p50", "itl_p99")}
    for r in passes:
        ok = [i for i, e in enumerate(r["errors"]) if not e]
        ttfts = [r["ttfts"][i] for i in ok]
        itls = [g for i in ok for g in r["itls"][i]]
        points["concurrency"].append(r["max_concurrency"] or r["num_prompts"])
        points["output_throughput"].append(r["output_throughput"])
        points["ttft_p50"].append(pct(ttfts, 50))
        points["ttft_p99"].append(pct(ttfts, 99))
        points["itl_p50"].append(pct(itls, 50))
        points["itl_p99"].append(pct(itls, 99))
    return points


def plot_sweep(passes: list[dict], path: str) -> None:
    """Write the sweep of `passes` (bench serve results) as a PNG at `path`."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = sweep_points(passes)
    x = pts["concurrency"]
    first = passes[0]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    axes[0].plot(x, pts["output_throughput"], "o-")
    axes[0].set_title("output throughput")
    axes[0].set_ylabel("tokens/s")
    for ax, name in ((axes[1], "ttft"), (axes[2], "itl")):
        ax.plot(x, pts[f"{name}_p50"], "o-", label="p50")
        ax.plot(x, pts[f"{name}_p99"], "s--", label="p99")
        ax.set_title(name.upper())
        ax.set_ylabel("ms")
        ax.legend()
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(int(c)) for c in x])
        ax.set_xlabel("max concurrency")
        ax.grid(True, alpha=0.3)
    mean_in = np.mean(first["input_lens"]) if first["input_lens"] else 0
    fig.suptitle(f"aserve bench serve: {first['model_id']}, {first['num_prompts']} prompts, "
                 f"~{mean_in:.0f} in / {max(first['output_lens'] or [0])} out tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
