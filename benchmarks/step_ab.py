"""In-process A/B of the CPU native decode step: this tree's C kernels against another checkout's, alternated
in one process (this VM's speed drifts too much between runs for run-to-run comparisons to show 5-10%).

    git worktree add /tmp/old HEAD~1
    python benchmarks/step_ab.py --old-tree /tmp/old --rows 1 --prompt-len 300 [--quantization gguf]

The bundled SmolLM2 (or --model) in bf16; `--rows` sequences of `--prompt-len` tokens, 128 greedy tokens each,
`--rounds` generate calls per build, the order alternating. The step's native call is switched between the
two libraries' `decode_layers_bf16` (their Layer structs must agree: compare builds that share cpu_decode.h's
layout). Prints the median decode step (ms, timed by the engine's stat logger) per round and overall, and
whether the two builds gave the same tokens (a changed order of sums may flip a late token). By hand, not CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path

from _decode_steps import ab_workload  # (benchmarks/, the script's folder)

from aserve import LLM
from aserve.kernels import cpu_ops
from aserve.kernels.c_build import compile_library
from aserve.runner.cpu_decode_step import _ARGTYPES


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old-tree", required=True, help="a checkout whose aserve/kernels are the A side")
    p.add_argument("--model", default=os.path.expanduser("~/.cache/aserve/models/SmolLM2-135M-Instruct"))
    p.add_argument("--quantization", default=None)
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--rounds", type=int, default=4)
    args = p.parse_args()
    old = Path(args.old_tree) / "aserve" / "kernels"
    sources = [old / s.name for s in cpu_ops._SOURCES if (old / s.name).exists()]
    headers = [old / h.name for h in cpu_ops._HEADERS if (old / h.name).exists()]
    old_step = compile_library("cpu_ops_ab_old", sources, headers, "native").decode_layers_bf16
    old_step.argtypes = _ARGTYPES
    llm = LLM(args.model, dtype="bfloat16", quantization=args.quantization, enable_prefix_caching=False)
    step = llm.engine.core._executor.runner.cpu_step
    if step is None:
        raise SystemExit("this model or CPU does not run the native decode step")
    builds = {"old": old_step, "new": step._fn}
    steps, prompts, params = ab_workload(llm, args.rows, args.prompt_len)
    times: dict[str, list[float]] = {"old": [], "new": []}
    tokens: dict[str, list] = {}
    for r in range(args.rounds):
        for name in ("old", "new") if r % 2 == 0 else ("new", "old"):
            step._fn, steps.times = builds[name], []
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens.setdefault(name, [o.outputs[0].token_ids for o in outs])
            times[name].append(statistics.median(steps.times) * 1e3)
    llm.engine.shutdown()
    for name in ("old", "new"):
        print(f"{name}: " + " ".join(f"{t:.2f}" for t in times[name]) + f" ms; median {statistics.median(times[name]):.2f}")
    print(f"same tokens: {tokens['old'] == tokens['new']}")


if __name__ == "__main__":
    main()
