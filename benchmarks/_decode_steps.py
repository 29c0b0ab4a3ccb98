"""Shared by the step benchmarks: the median decode-step time of a config.json built with random
weights (`--load-format dummy`), measured inside `LLM.generate` by a stat logger."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any


class DecodeSteps:
    """A stat logger keeping the time of every step that produced tokens but computed no prompt."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def record(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        if iteration_stats.num_generation_tokens and not iteration_stats.num_prompt_tokens:
            self.times.append(iteration_stats.step_time)


def decode_step_ms(config: dict, batch: int, dtype: str, folder: Path, **llm_kwargs: Any) -> float:
    """Median decode step (ms) of `config` at `batch` sequences of 32 prompt tokens, 64 greedy
    tokens each (after a warm-up request), in `folder` (config.json is written there)."""
    from aserve import LLM, SamplingParams

    (folder / "config.json").write_text(json.dumps(config))
    llm = LLM(str(folder), load_format="dummy", skip_tokenizer_init=True, dtype=dtype, max_model_len=256,
              enable_prefix_caching=False, **llm_kwargs)
    steps = DecodeSteps()
    llm.engine.stat_loggers.append(steps)
    prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 1000 for j in range(32)]} for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, detokenize=False), use_tqdm=False)  # warm-up
    steps.times.clear()
    llm.generate(prompts, params, use_tqdm=False)
    llm.engine.shutdown()
    return statistics.median(steps.times) * 1000


def ab_workload(llm: Any, rows: int, prompt_len: int) -> tuple[DecodeSteps, list[dict], Any]:
    """The in-process A/B scripts' workload (step_ab.py, greedy_head.py): a DecodeSteps logger attached to
    `llm`, `rows` prompts of `prompt_len` token ids, and their parameters (128 greedy tokens, EOS ignored,
    no detokenizing)."""
    from aserve import SamplingParams

    steps = DecodeSteps()
    llm.engine.stat_loggers.append(steps)
    prompts = [{"prompt_token_ids": [1000 + (7 * i + j) % 3000 for j in range(prompt_len)]} for i in range(rows)]
    return steps, prompts, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True, detokenize=False)
