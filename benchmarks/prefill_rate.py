"""Prefill speed against llama.cpp (issue 27): prompt tokens per second for one 512-token prompt, aserve's
offline `LLM.generate` (one output token, no prefix cache) against llama.cpp's server (`/completion`,
`cache_prompt: false`, its own `timings.prompt_per_second`), in one run; bf16 and the bundled Q4_1 file
(`--quantization gguf` for aserve). 5 prompts, the first a warm-up, the median of the other 4 (by
hand, not CI). aserve's time is the whole `generate` call (scheduling, one output token); llama.cpp's
is its own prompt timing, so the comparison leans against aserve.

    python benchmarks/prefill_rate.py --llama-server PATH [--prompt-tokens 512]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

import httpx
from peers import default_bf16_gguf, free_port, locate_weights

PROMPTS = 5


def prompt(j: int, n: int) -> list[int]:
    return [(i * 37 + j * 11) % 40000 + 100 for i in range(n)]


def aserve_rate(n: int, quantization: str | None) -> float:
    from aserve import LLM, SamplingParams

    llm = LLM(dtype="bfloat16", max_model_len=max(2048, n + 16), enable_prefix_caching=False,
              **({"quantization": quantization} if quantization else {}))
    params = SamplingParams(temperature=0, max_tokens=1)
    times = []
    for j in range(PROMPTS):
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt(j, n)}], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    llm.engine.shutdown()
    return n / statistics.median(times[1:])


def llama_rate(server: str, gguf: str, n: int) -> float:
    port = free_port()
    proc = subprocess.Popen([server, "-m", gguf, "-t", "2", "-c", str(max(4096, 2 * n)), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(120):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        rates = [httpx.post(url + "/completion", json={"prompt": prompt(j, n), "n_predict": 1, "cache_prompt": False},
                            timeout=300).json()["timings"]["prompt_per_second"] for j in range(PROMPTS)]
        return statistics.median(rates[1:])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    args = parser.parse_args()
    hf_folder, q4_gguf, _ = locate_weights("")
    n = args.prompt_tokens
    rows = [("bf16", aserve_rate(n, None), llama_rate(args.llama_server, default_bf16_gguf(hf_folder), n)),
            ("Q4_1 GGUF", aserve_rate(n, "gguf"), llama_rate(args.llama_server, q4_gguf, n))]
    print(f"| prompt tokens/s, {n}-token prompt | aserve | llama.cpp |")
    print("|---|---:|---:|")
    for name, ours, theirs in rows:
        print(f"| {name} | {ours:.0f} | {theirs:.0f} |")


if __name__ == "__main__":
    main()
