"""Embedding throughput: sentences per second for all-MiniLM-L6-v2 through aserve's `/v1/embeddings`
(HTTP, a fresh `aserve --model all-minilm` server) against sentence-transformers' `encode` in-process,
in one run on this machine.

    python benchmarks/embeddings.py [--dtypes float32 bfloat16] [--repeats 3]

Inputs: 256 real short sentences, and 256 inputs of exactly 256 tokens (MiniLM's limit). Batch 1 sends
one input per request, one request at a time (c = 1; 64 requests); batch 256 sends all 256 inputs in
one request. sentence-transformers encodes the same texts with `batch_size` 1 or 256. Each case runs
--repeats times after a warm-up; the best is reported. text-embeddings-inference (a Rust server
shipped as binaries and containers, not on PyPI) cannot be installed here, so it is not compared.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import httpx

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE, os.path.dirname(_HERE)]  # peers.py (a script's module) and the repository
from peers import HOST, free_port, stop, wait_ready  # noqa: E402

BATCH1_REQUESTS = 64


def make_inputs(tokenizer, sentences: list[str]) -> dict[str, list[str]]:
    """'short': 256 real sentences; 'long': 256 texts of exactly 256 tokens with their special tokens."""
    short = (sentences * (256 // len(sentences) + 1))[:256]
    words = " ".join(sentences).split()
    long_texts = []
    for i in range(256):
        rotated = " ".join(words[i % len(words):] + words[:i % len(words)])
        ids = tokenizer(rotated, add_special_tokens=False)["input_ids"][:254]
        long_texts.append(tokenizer.decode(ids))
    return {"short": short, "long": long_texts}


def best_rate(run, count: int, repeats: int) -> float:
    run()  # warm-up
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = max(best, count / (time.perf_counter() - start))
    return best


def bench_server(dtype: str, inputs: dict[str, list[str]], repeats: int) -> dict[tuple[str, int], float]:
    port = free_port()
    cmd = [sys.executable, "-m", "aserve.server.cli", "--model", "all-minilm", "--dtype", dtype, "--host", HOST,
           "--port", str(port), "--max-num-batched-tokens", "8192", "--disable-log-requests"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://{HOST}:{port}"
    results = {}
    try:
        wait_ready(proc, f"{url}/health", time.perf_counter(), 300)
        with httpx.Client(base_url=url, timeout=600) as client:
            def post(batch: list[str]) -> None:
                r = client.post("/v1/embeddings", json={"model": "all-minilm", "input": batch,
                                                       "truncate_prompt_tokens": -1})
                r.raise_for_status()
                assert len(r.json()["data"]) == len(batch)

            for name, texts in inputs.items():
                results[(name, 1)] = best_rate(lambda t=texts: [post([x]) for x in t[:BATCH1_REQUESTS]],
                                               BATCH1_REQUESTS, repeats)
                results[(name, 256)] = best_rate(lambda t=texts: post(t), len(texts), repeats)
    finally:
        stop(proc, 10)
    return results


def bench_sentence_transformers(path: str, inputs: dict[str, list[str]], repeats: int) -> dict[tuple[str, int], float]:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(path, device="cpu")
    results = {}
    for name, texts in inputs.items():
        results[(name, 1)] = best_rate(lambda t=texts: st.encode(t[:BATCH1_REQUESTS], batch_size=1),
                                       BATCH1_REQUESTS, repeats)
        results[(name, 256)] = best_rate(lambda t=texts: st.encode(t, batch_size=256), len(texts), repeats)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from aserve.model_source import resolve_model
    from tests.support.sentences import SENTENCES

    path = resolve_model("all-minilm")
    inputs = make_inputs(AutoTokenizer.from_pretrained(path), SENTENCES)
    rows = {"sentence-transformers (in-process, fp32)": bench_sentence_transformers(path, inputs, args.repeats)}
    for dtype in args.dtypes:
        rows[f"aserve /v1/embeddings ({dtype})"] = bench_server(dtype, inputs, args.repeats)
    cases = [("short", 1), ("short", 256), ("long", 1), ("long", 256)]
    print("| system | " + " | ".join(f"{n} inputs, batch {b}" for n, b in cases) + " |")
    print("|---|" + "---:|" * len(cases))
    for name, res in rows.items():
        print(f"| {name} | " + " | ".join(f"{res[c]:.0f}" for c in cases) + " |")
    st = rows["sentence-transformers (in-process, fp32)"]
    for name, res in rows.items():
        if name.startswith("aserve"):
            print(f"{name}: {res[('short', 256)] / st[('short', 256)]:.2f}x (short) and "
                  f"{res[('long', 256)] / st[('long', 256)]:.2f}x (long) sentence-transformers at batch 256")


if __name__ == "__main__":
    main()
