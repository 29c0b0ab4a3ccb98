"""Seeded benchmark workloads: the same arguments and seed always give the same requests.

`random_requests` follows vLLM's random dataset: each prompt is a run of consecutive token ids from a
random offset (special tokens skipped), decoded to text and re-encoded so `prompt_len` is the prompt's real
token count; input and output lengths are drawn from [len*(1-range_ratio), len*(1+range_ratio)].
`sharegpt_requests` reads a ShareGPT JSON (a list of {"conversations": [{"from", "value"}, ...]}): the first
turn is the prompt, the second's token count the output length (vLLM's filters: both >= 4 tokens, prompt
<= 1024, prompt + output <= 2048, unless the output length is fixed).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import numpy as np

WORDS = (  # noqa: SIM905
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word "
    "business issue side kind head house service friend father power hour game line end member law car "
    "city community name president team minute idea kid body information back parent face others level "
    "office door health person art war history party result change morning reason research girl guy "
    "moment air teacher force education"
).split()


@dataclass(frozen=True)
class SampleRequest:
    """One benchmark request: the prompt text, its token count and the output tokens to ask for."""

    prompt: str
    prompt_len: int
    expected_output_len: int


def _lengths(rng: np.random.Generator, mean: int, range_ratio: float, num: int) -> list[int]:
    low = max(1, int(mean * (1 - range_ratio)))
    high = max(low, int(mean * (1 + range_ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=num)]


def random_requests(tokenizer, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, seed: int = 0) -> list[SampleRequest]:
    """vLLM's random dataset over `tokenizer` (a transformers tokenizer); see the module docstring."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio: must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    input_lens = _lengths(rng, input_len, range_ratio, num_prompts)
    output_lens = _lengths(rng, output_len, range_ratio, num_prompts)
    offsets = rng.integers(0, len(vocab), size=num_prompts)
    requests = []
    for i in range(num_prompts):
        ids = [vocab[(int(offsets[i]) + i + j) % len(vocab)] for j in range(input_lens[i])]
        text = tokenizer.decode(ids)
        # decode/encode is not an identity: trim (or pad by repeating) to the wanted count, then re-count
        ids = tokenizer.encode(text, add_special_tokens=False)
        while len(ids) < input_lens[i]:
            ids = ids + ids[: input_lens[i] - len(ids)]
        text = tokenizer.decode(ids[: input_lens[i]])
        prompt_len = len(tokenizer.encode(text, add_special_tokens=False))
        requests.append(SampleRequest(text, prompt_len, output_lens[i]))
    return requests


def sharegpt_requests(path: str, tokenizer, num_prompts: int, output_len: int | None = None,
                      seed: int = 0) -> list[SampleRequest]:
    """`num_prompts` conversations from a ShareGPT JSON file, shuffled by `seed`; ValueError if too few."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"])
             for c in data if len(c.get("conversations") or ()) >= 2]
    random.Random(seed).shuffle(pairs)
    requests: list[SampleRequest] = []
    for prompt, completion in pairs:
        if len(requests) == num_prompts:
            break
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        out_len = output_len or len(tokenizer.encode(completion, add_special_tokens=False))
        # vLLM's validity rule (the minimum output length only applies to the conversation's own reply)
        if (prompt_len < 4 or (output_len is None and out_len < 4) or prompt_len > 1024
                or prompt_len + out_len > 2048):
            continue
        requests.append(SampleRequest(prompt, prompt_len, out_len))
    if len(requests) < num_prompts:
        raise ValueError(f"--dataset-path {path}: only {len(requests)} usable conversations, "
                         f"--num-prompts asks for {num_prompts}")
    return requests


def make_dataset(num_prompts: int, words_per_prompt: int, seed: int) -> list[str]:
    """Synthetic word prompts (~`words_per_prompt` words, no tokenizer needed); seeded."""
    rng = random.Random(seed)
    prompts = []
    for i in range(num_prompts):
        n = max(1, int(rng.gauss(words_per_prompt, words_per_prompt * 0.1)))
        body = " ".join(rng.choice(WORDS) for _ in range(n))
        prompts.append(f"Request {i}. Summarize the following notes in one paragraph: {body}")
    return prompts


def make_prompt_token_ids(tokenizer, num: int, input_len: int, seed: int) -> list[list[int]]:
    """`num` prompts of exactly `input_len` token ids (word text, encoded and cut); seeded."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num):
        text = " ".join(rng.choice(WORDS) for _ in range(input_len * 2))
        prompts.append(tokenizer.encode(text, add_special_tokens=False)[:input_len])
    return prompts
