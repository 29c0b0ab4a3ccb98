"""Tokenizer pool benchmark (issue 25): 64 concurrent ~4k-token prompts sent to `/tokenize` and rendered
through the chat template (`/tokenize` with `messages`), against `aserve --tokenizer-pool-size N` for each
N in `--sizes`, each a freshly started server (the bundled SmolLM2 unless `--model`). Prints wall time and
per-request latency p50 / p99. Not part of CI.

    python benchmarks/tokenizer_pool.py --sizes 0,2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time

import httpx

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__))]
import peers  # noqa: E402  (benchmarks/ is not a package)

WORDS = ("model server token cache batch prompt stream latency kernel memory throughput request "
         "schedule prefix decode sample vector matrix thread queue").split()


def make_texts(num: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"Document {i}. " + " ".join(rng.choice(WORDS) for _ in range(words)) for i in range(num)]


async def run_pass(url: str, model: str, texts: list[str], chat: bool) -> tuple[float, list[float]]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(text: str) -> float:
            body = {"model": model, "messages": [{"role": "user", "content": text}]} if chat \
                else {"model": model, "prompt": text}
            start = time.perf_counter()
            r = await client.post("/tokenize", json=body)
            r.raise_for_status()
            return time.perf_counter() - start

        start = time.perf_counter()
        latencies = await asyncio.gather(*(one(t) for t in texts))
        return time.perf_counter() - start, sorted(latencies)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="0,2", help="--tokenizer-pool-size values, one server each: %(default)s")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--words", type=int, default=4000, help="words per prompt (~1 token each): %(default)s")
    p.add_argument("--model", default="")
    args = p.parse_args()
    texts = make_texts(args.num_prompts, args.words)
    print(f"cpu: {peers.cpu_summary(peers._read_cpuinfo())}\ncommand: {' '.join(sys.argv)}\n")
    print("| pool size | kind | wall s | p50 ms | p99 ms |\n|---:|---|---:|---:|---:|")
    for size in [int(s) for s in args.sizes.split(",")]:
        port = peers.free_port()
        cmd = ["aserve", "--port", str(port), "--host", peers.HOST, "--disable-log-requests",
               "--tokenizer-pool-size", str(size)] + (["--model", args.model] if args.model else [])
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            url = f"http://{peers.HOST}:{port}"
            peers.wait_ready(proc, f"{url}/health", time.perf_counter(), 300)
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            asyncio.run(run_pass(url, model, texts[:2], chat=False))  # warm-up
            for chat in (False, True):
                wall, lat = asyncio.run(run_pass(url, model, texts, chat))
                print(f"| {size} | {'chat template' if chat else 'prompt'} | {wall:.2f} | "
                      f"{1000 * lat[len(lat) // 2]:.0f} | {1000 * lat[int(0.99 * (len(lat) - 1))]:.0f} |")
        finally:
            peers.stop(proc, 10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
