"""In-process A/B of the greedy LM head (model/layers/greedy_head.py): decode steps with the 8-bit screen
against the full bf16 logits and the sampler's argmax, alternated in one process (this VM's speed drifts too
much between runs to show a few percent).

    python benchmarks/greedy_head.py --rows 1 --prompt-len 300

The bundled SmolLM2 (or --model) in bf16; `--rows` sequences of `--prompt-len` tokens, 128 greedy tokens each
(no logprobs: the screen's case), `--rounds` generate calls per side, the order alternating. Prints the median
decode step (ms, the engine's stat logger) and the runner's `sample` (the head and the token) per round and
overall, and whether both sides gave the same tokens (they must: the screen's token is the full head's argmax).
By hand, not CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from _decode_steps import ab_workload  # (benchmarks/, the script's folder)

from aserve import LLM


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.expanduser("~/.cache/aserve/models/SmolLM2-135M-Instruct"))
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--rounds", type=int, default=6)
    args = p.parse_args()
    llm = LLM(args.model, dtype="bfloat16", enable_prefix_caching=False)
    runner = llm.engine.core._executor.runner
    head = runner.model.lm_head
    screen = head.greedy_screen
    sample_ms: list[float] = []
    sample = runner.sample

    def timed_sample(*a):
        start = time.perf_counter()
        out = sample(*a)
        sample_ms.append((time.perf_counter() - start) * 1e3)
        return out

    runner.sample = timed_sample
    if screen is None:
        raise SystemExit("this model or CPU has no greedy screen (needs the C kernels' 8-bit products)")
    steps, prompts, params = ab_workload(llm, args.rows, args.prompt_len)
    times: dict[str, list[float]] = {"full logits": [], "screen": []}
    samples: dict[str, list[float]] = {"full logits": [], "screen": []}
    tokens: dict[str, list] = {}
    for r in range(args.rounds):
        for name in ("full logits", "screen") if r % 2 == 0 else ("screen", "full logits"):
            head.greedy_screen, steps.times, sample_ms[:] = (screen if name == "screen" else None), [], []
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens.setdefault(name, [o.outputs[0].token_ids for o in outs])
            times[name].append(statistics.median(steps.times) * 1e3)
            samples[name].append(statistics.median(sample_ms))
        print(f"round {r + 1}: " + ", ".join(f"{n} step {t[-1]:.2f} ms (sample {samples[n][-1]:.2f})"
                                             for n, t in times.items()), flush=True)
    print(", ".join(f"{n}: step {statistics.median(t):.2f} ms, sample {statistics.median(samples[n]):.2f} ms"
                    for n, t in times.items()) + f"; same tokens: {tokens['screen'] == tokens['full logits']}")


if __name__ == "__main__":
    main()
