"""`aserve bench serve`: vLLM's online serving benchmark against any OpenAI-compatible server.

Builds a seeded dataset (`--dataset-name random|sharegpt`), sends each request at its arrival time
(`--request-rate`, `--burstiness`), at most `--max-concurrency` in flight, and prints vLLM's result block.
`--max-concurrency 1,4,16` runs one pass per level over the same requests (a sweep); `--plot PNG` draws it.
`--save-result` writes one JSON per pass in vLLM's field names plus its run fields (date, backend,
model_id, tokenizer_id, num_prompts, request_rate, burstiness, max_concurrency). Exits 1 if a request
failed, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import time

import httpx
from tqdm import tqdm

from aserve.bench.client import RequestResult, RequestSpec, one_request, resolve_model
from aserve.bench.datasets import SampleRequest, random_requests, sharegpt_requests
from aserve.bench.metrics import PERCENTILE_METRICS, arrival_intervals, format_serve_metrics, serve_metrics


def _concurrency_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or a comma list N,M,..., got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"every level must be >= 1, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("openai", "openai-chat"), default="openai")
    p.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 (overrides host/port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None,
                   help="default: /v1/completions (openai), /v1/chat/completions (openai-chat)")
    p.add_argument("--model", default="", help="served model name (default: the first of GET /v1/models)")
    p.add_argument("--tokenizer", default=None, help="for the dataset's token counts (default: --model)")
    p.add_argument("--dataset-name", choices=("random", "sharegpt"), default="random")
    p.add_argument("--dataset-path", default=None, help="a ShareGPT JSON file (--dataset-name sharegpt)")
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--sharegpt-output-len", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier, > 1 steadier")
    p.add_argument("--max-concurrency", type=_concurrency_list, default=None,
                   help="requests in flight at most; a comma list (1,4,16) runs a sweep")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="of ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="99", help="comma list, e.g. 50,90,99")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="always generate the requested output length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=6 * 3600.0, help="seconds per request")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=".")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--plot", default=None, metavar="PNG", help="draw the concurrency sweep (needs matplotlib)")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fills the derived fields (endpoint, metrics tuples); p.error for a bad combination."""
    if args.num_prompts < 1:
        p.error("--num-prompts: must be >= 1")
    if not args.request_rate > 0 or not args.burstiness > 0:
        p.error("--request-rate and --burstiness: must be > 0")
    if args.dataset_name == "sharegpt" and not args.dataset_path:
        p.error("--dataset-name sharegpt needs --dataset-path (a ShareGPT JSON file)")
    args.endpoint = args.endpoint or ("/v1/chat/completions" if args.backend == "openai-chat"
                                      else "/v1/completions")
    args.percentile_metrics = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    if bad := [m for m in args.percentile_metrics if m not in PERCENTILE_METRICS]:
        p.error(f"--percentile-metrics: unknown {bad}; choose from {','.join(PERCENTILE_METRICS)}")
    try:
        args.metric_percentiles = tuple(float(x) for x in args.metric_percentiles.split(","))
    except ValueError:
        p.error(f"--metric-percentiles: numbers expected, got {args.metric_percentiles!r}")
    if not all(0 < q <= 100 for q in args.metric_percentiles):
        p.error("--metric-percentiles: each must be in (0, 100]")
    if args.plot:
        from aserve.bench.plot import require_matplotlib

        try:
            require_matplotlib()
        except RuntimeError as exc:
            p.error(str(exc))


def load_tokenizer(name: str):
    """A transformers tokenizer for `name`; the bundled model's served name resolves to its folder."""
    from transformers import AutoTokenizer

    from aserve.config import BUNDLED_MODEL_NAME

    if name in ("", BUNDLED_MODEL_NAME):
        from aserve.model_source import resolve_model as resolve_local

        name = resolve_local("", None, None, "auto")
    return AutoTokenizer.from_pretrained(name)


def build_requests(args: argparse.Namespace, tokenizer) -> list[SampleRequest]:
    if args.dataset_name == "sharegpt":
        return sharegpt_requests(args.dataset_path, tokenizer, args.num_prompts, args.sharegpt_output_len,
                                 args.seed)
    return random_requests(tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
                           args.random_range_ratio, args.seed)


async def run_pass(client: httpx.AsyncClient, spec: RequestSpec, model: str, requests: list[SampleRequest],
                   args: argparse.Namespace, max_concurrency: int | None) -> dict:
    """One pass over `requests`: vLLM's result dict (plus max_concurrency)."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), disable=args.disable_tqdm,
               desc=f"concurrency {max_concurrency or 'unlimited'}")

    async def send(req: SampleRequest) -> RequestResult:
        if semaphore is None:
            result = await one_request(client, spec, model, req.prompt, req.expected_output_len)
        else:
            async with semaphore:
                result = await one_request(client, spec, model, req.prompt, req.expected_output_len)
        bar.update(1)
        return result

    waits = arrival_intervals(len(requests), args.request_rate, args.burstiness, args.seed)
    start = time.perf_counter()
    tasks = []
    for req, wait in zip(requests, waits, strict=True):
        tasks.append(asyncio.ensure_future(send(req)))
        if wait:
            await asyncio.sleep(wait)
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    bar.close()
    result = serve_metrics(requests, list(results), duration, args.percentile_metrics, args.metric_percentiles)
    result["max_concurrency"] = max_concurrency
    return result


async def run(args: argparse.Namespace) -> list[dict]:
    """Every pass of the run (one per --max-concurrency level), each with vLLM's run fields."""
    base_url = args.base_url or f"http://{args.host}:{args.port}"
    api_key = os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    levels = args.max_concurrency or [None]
    # No client-side cap without --max-concurrency (a request waiting for a connection would count as TTFT).
    limits = httpx.Limits(max_connections=None if None in levels else max(levels), max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits,
                                 timeout=httpx.Timeout(args.timeout)) as client:
        model = await resolve_model(client, args.model)
        tokenizer_id = args.tokenizer or model
        tokenizer = await asyncio.to_thread(load_tokenizer, tokenizer_id)
        requests = build_requests(args, tokenizer)
        spec = RequestSpec(path=args.endpoint, chat=args.backend == "openai-chat", temperature=args.temperature,
                           ignore_eos=args.ignore_eos)
        passes = []
        for level in levels:
            result = await run_pass(client, spec, model, requests, args, level)
            result.update(date=datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), backend=args.backend,
                          model_id=model, tokenizer_id=tokenizer_id, num_prompts=args.num_prompts,
                          request_rate=args.request_rate if math.isfinite(args.request_rate) else "inf",
                          burstiness=args.burstiness)
            print(format_serve_metrics(result, args.percentile_metrics, args.metric_percentiles), flush=True)
            passes.append(result)
    return passes


def result_path(args: argparse.Namespace, result: dict, sweep: bool) -> str:
    """vLLM's default name `{backend}-{rate}qps[-concurrency{N}]-{model}-{date}.json` under --result-dir;
    a --result-filename gets `-concurrency{N}` before its extension in a sweep."""
    concurrency = result["max_concurrency"]
    if args.result_filename:
        name = args.result_filename
        if sweep:
            stem, ext = os.path.splitext(name)
            name = f"{stem}-concurrency{concurrency}{ext or '.json'}"
    else:
        suffix = f"-concurrency{concurrency}" if concurrency is not None else ""
        model = str(result["model_id"]).rstrip("/").split("/")[-1]
        name = f"{args.backend}-{result['request_rate']}qps{suffix}-{model}-{result['date']}.json"
    return os.path.join(args.result_dir or ".", name)


def main(args: argparse.Namespace) -> int:
    passes = asyncio.run(run(args))
    sweep = len(passes) > 1
    if args.save_result:
        os.makedirs(args.result_dir or ".", exist_ok=True)
        for result in passes:
            path = result_path(args, result, sweep)
            with open(path, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=2)
            print(f"result: {path}")
    if args.plot:
        from aserve.bench.plot import plot_sweep

        plot_sweep(passes, args.plot)
        print(f"plot: {args.plot}")
    return 0 if all(r["failed"] == 0 for r in passes) else 1
