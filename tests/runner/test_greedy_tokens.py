"""ModelRunner.sample's greedy path: a step whose requests all take the argmax and read nothing else of the
logits gets its tokens from the LM head's greedy screen (LMHead.greedy, model/layers/greedy_head.py) instead
of the full logits, and they are the tokens the full logits give; a step with any request that reads the
logits (logprobs, penalties, sampling) computes them."""

from __future__ import annotations

import pytest

from aserve import LLM, SamplingParams
from aserve.kernels import cpu_ops
from tests.support.tiny_models import GREEDY_STABLE, save_tiny_hf

kernels = cpu_ops.load()
pytestmark = pytest.mark.skipif(kernels is None or not kernels.packed_matmuls or not kernels.q8_products,
                                reason="needs the C kernels with packed bf16 and 8-bit products")

PROMPTS = [[(5 * i + 2) % 400 + 3 for i in range(n)] for n in (4, 23, 11)]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("greedy_tokens")
    save_tiny_hf(path, "llama", **GREEDY_STABLE)  # (a vocabulary of 512: the screen needs multiples of 32)
    return LLM(str(path), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=128, cpu_kvcache_space=0.02)


def test_plain_greedy_steps_take_the_heads_screen_and_its_tokens_are_the_logits_argmax(llm):
    head = llm.engine.core._executor.runner.model.lm_head
    assert head.greedy_screen is not None
    screened = [0]
    greedy = head.greedy

    def counted(hidden):
        tokens = greedy(hidden)
        screened[0] += tokens is not None
        return tokens

    head.greedy = counted

    def run(**params) -> list[list[int]]:
        screened[0] = 0
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, detokenize=False, **params),
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    tokens = run()
    assert screened[0] >= 24  # every step (prefill's first token included)
    assert run(logprobs=1) == tokens and screened[0] == 0  # the logits, for the logprobs
    assert run(repetition_penalty=1.0) == tokens and screened[0] >= 24  # (a penalty of 1 edits nothing)
    screen = head.greedy_screen
    head.greedy_screen = None  # the full logits and the sampler's argmax
    try:
        assert run() == tokens and screened[0] == 0
    finally:
        head.greedy_screen, head.greedy = screen, greedy
    assert tokens != [tokens[0]] * len(tokens)  # (prompts that lead apart)


def test_a_step_with_one_request_reading_its_logits_computes_them(llm):
    head = llm.engine.core._executor.runner.model.lm_head
    assert head.greedy_screen is not None
    greedy = head.greedy
    calls = []
    head.greedy = lambda hidden: calls.append(hidden.shape[0]) or greedy(hidden)
    try:
        plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False)
        penalized = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False,
                                   presence_penalty=0.5)
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], [plain, penalized], use_tqdm=False)
    finally:
        head.greedy = greedy
    assert calls == []
