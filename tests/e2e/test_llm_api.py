"""The offline LLM API on the bundled SmolLM2: n / best_of, seeds, logprobs vs HF, stop, chat, processors."""

from __future__ import annotations

import math

import pytest

from aserve import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(bundled_model_path):
    return LLM("", dtype="float32", max_model_len=256, cpu_kvcache_space=0.1, max_num_seqs=16)


def test_output_shape_like_vllm(llm):
    outs = llm.generate(["The capital of France is", "1, 2, 3,"], SamplingParams(temperature=0, max_tokens=8),
                        use_tqdm=False)
    assert [o.prompt for o in outs] == ["The capital of France is", "1, 2, 3,"]
    for o in outs:
        c = o.outputs[0]
        assert o.finished and o.prompt_token_ids and len(c.token_ids) <= 8
        assert c.finish_reason in ("stop", "length") and isinstance(c.text, str)
        assert o.metrics.first_token_time >= o.metrics.arrival_time
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 8


def test_n_samples_differ_and_seed_reproduces(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=42)
    a = llm.generate("Tell me a story about a dragon.", params, use_tqdm=False)[0]
    assert [c.index for c in a.outputs] == [0, 1, 2]
    texts = [c.text for c in a.outputs]
    assert len(set(texts)) > 1, "three seeded samples should not all be equal"
    # Same seed, different batch company: same texts.
    others = [SamplingParams(temperature=0.7, max_tokens=5, seed=s) for s in range(3)]
    batch = llm.generate(["Tell me a story about a dragon.", "hi", "yo", "ok"], [params] + others, use_tqdm=False)
    assert [c.text for c in batch[0].outputs] == texts


def test_best_of_returns_highest_cumulative_logprob(llm):
    out = llm.generate("Once upon a time", SamplingParams(n=2, best_of=4, temperature=1.0, max_tokens=6, seed=3,
                                                          logprobs=0), use_tqdm=False)[0]
    assert len(out.outputs) == 2
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob


def test_logprobs_match_hf(llm, bundled_model_path):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = "The quick brown fox"
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2),
                       use_tqdm=False)[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(bundled_model_path, dtype=torch.float32)
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    n_prompt = len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n_prompt
    for pos in range(1, n_prompt):
        entry = out.prompt_logprobs[pos]
        tok = ids[pos]
        assert math.isclose(entry[tok].logprob, ref[pos - 1, tok].item(), abs_tol=1e-3)
        assert len(entry) <= 3  # the actual token plus the top-2
    for i, tok in enumerate(out.outputs[0].token_ids):
        entry = out.outputs[0].logprobs[i]
        assert math.isclose(entry[tok].logprob, ref[n_prompt - 1 + i, tok].item(), abs_tol=1e-3)
        assert entry[tok].rank == 1  # greedy picked the most likely token
        top = sorted(entry.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in top][:3] == [1, 2, 3] or len(entry) == 3
    assert math.isclose(out.outputs[0].cumulative_logprob,
                        sum(out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(out.outputs[0].token_ids)),
                        abs_tol=1e-4)


def test_stop_strings_and_stop_tokens(llm):
    base = llm.generate("Count: 1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    text = base.outputs[0].text
    assert "8" in text
    stop_str = text[text.index("8") - 1:text.index("8") + 1]  # spans the tokens around "8"
    out = llm.generate("Count: 1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=20, stop=[stop_str]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_str
    assert out.text == text[:text.index(stop_str)]
    base_ids = base.outputs[0].token_ids
    tok = base_ids[3]
    first = base_ids.index(tok)
    out = llm.generate("Count: 1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == tok and out.token_ids == base_ids[:first + 1]


def test_ignore_eos_min_tokens(llm):
    chat = [{"role": "user", "content": "What is 2+2?"}]  # greedy answer ends with <|im_end|> after ~12 tokens
    short = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] == 2  # <|im_end|>
    longer = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64, min_tokens=len(short.token_ids) + 3),
                      use_tqdm=False)[0].outputs[0]
    assert len(longer.token_ids) >= len(short.token_ids) + 3
    forced = llm.chat(chat, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    assert len(forced.outputs[0].token_ids) == 30 and forced.outputs[0].finish_reason == "length"


def test_logits_processor_and_bias(llm):
    tok = llm.get_tokenizer()
    target = tok.encode(" banana", add_special_tokens=False)[0]

    def force(output_ids, logits):
        logits[:] = -1e9
        logits[target] = 0.0
        return logits

    out = llm.generate("I like", SamplingParams(temperature=0, max_tokens=3, logits_processors=[force]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [target] * 3
    biased = llm.generate("I like", SamplingParams(temperature=0, max_tokens=2, logit_bias={target: 100}),
                          use_tqdm=False)[0].outputs[0]
    assert biased.token_ids == [target] * 2
    allowed = llm.generate("I like", SamplingParams(temperature=1.0, max_tokens=4, allowed_token_ids=[target, 11]),
                           use_tqdm=False)[0].outputs[0]
    assert set(allowed.token_ids) <= {target, 11}


def test_chat_batch_and_truncation(llm):
    convs = [[{"role": "user", "content": "Hi!"}], [{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": "What is 2+2?"}]]
    outs = llm.chat(convs, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    assert len(outs) == 2 and all(o.outputs[0].text for o in outs)
    assert "<|im_start|>" in outs[1].prompt
    t = llm.generate("a b c d e f g h i j", SamplingParams(max_tokens=1, truncate_prompt_tokens=3), use_tqdm=False)[0]
    assert len(t.prompt_token_ids) == 3


def test_errors_name_the_field(llm):
    from aserve.sampling_params import SamplingParamsError

    with pytest.raises(SamplingParamsError, match="max_tokens"):
        llm.generate("hi", SamplingParams(max_tokens=10_000), use_tqdm=False)
    with pytest.raises(SamplingParamsError, match="logprobs"):
        llm.generate("hi", SamplingParams(logprobs=50), use_tqdm=False)
    with pytest.raises(SamplingParamsError, match="prompt"):
        llm.generate("hi " * 300, SamplingParams(max_tokens=1), use_tqdm=False)
    # The engine is still healthy afterwards.
    assert llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
