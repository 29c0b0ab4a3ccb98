"""ngram speculative decoding through `aserve.LLM`: outputs identical to the same engine without
speculation (greedy and seeded), under chunked prefill, prefix caching, preemption, stop strings,
max_tokens hitting mid-draft, n > 1, logprobs and a JSON-schema grammar; drafts really get accepted
(the scheduler's spec_decoding stats). Tiny random-weight llamas; one test on the bundled SmolLM2."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from aserve import LLM, GuidedDecodingParams, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
MAX_NEW = 40

_rng = random.Random(3)
_span = [_rng.randrange(3, 500) for _ in range(12)]
_span2 = [_rng.randrange(3, 500) for _ in range(7)]
# Repeated spans (ngram lookups find them), a plain random prompt, and a long one for chunking.
PROMPTS = [
    _span * 3,
    [_rng.randrange(3, 500) for _ in range(20)],
    _span + _span[:5],
    _span2 * 6 + [_rng.randrange(3, 500) for _ in range(30)] + _span2,
    [7, 8, 9] * 4,
]


class SpecTotals:
    """A stat logger adding up the scheduler's speculative decoding counters and preemptions."""

    def __init__(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = self.num_preemptions = 0
        self.latest = None

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.latest = scheduler_stats
        self.num_preemptions += scheduler_stats.num_preemptions
        spec = scheduler_stats.spec_decoding
        if spec is not None:
            self.num_drafts += spec.num_drafts
            self.num_draft_tokens += spec.num_draft_tokens
            self.num_accepted_tokens += spec.num_accepted_tokens


def _llm(path: str, spec: bool, **kwargs) -> tuple[LLM, SpecTotals]:
    base = {"dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 256, "cpu_kvcache_space": 0.05}
    base.update(kwargs)
    if spec:
        base["speculative_config"] = dict(SPEC)
    llm = LLM(path, **base)
    totals = SpecTotals()
    llm.engine.stat_loggers.append(totals)
    return llm, totals


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _gen(llm: LLM, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, detokenize=False)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    llm, _ = _llm(tiny_llama, spec=False)
    return _ids(_gen(llm, PROMPTS, GREEDY))


@pytest.fixture(scope="module")
def spec_llm(tiny_llama):
    return _llm(tiny_llama, spec=True)


# -- greedy ------------------------------------------------------------------------------------------------
CASES = {
    "defaults": {},
    "chunked_prefill": {"enable_chunked_prefill": True, "max_num_batched_tokens": 16},
    "prefix_caching": {"enable_prefix_caching": True, "block_size": 8},
    "preemption": {"num_gpu_blocks_override": 20, "block_size": 8, "enable_prefix_caching": False,
                   "max_model_len": 128},
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_identical_with_ngram_speculation(case, tiny_llama, reference):
    llm, totals = _llm(tiny_llama, spec=True, **CASES[case])
    assert _ids(_gen(llm, PROMPTS, GREEDY)) == reference
    assert totals.num_drafts > 0 and totals.num_accepted_tokens > 0, "no draft was accepted: nothing was tested"
    assert totals.num_accepted_tokens <= totals.num_draft_tokens
    assert totals.latest.num_used_blocks == 0
    if case == "preemption":
        assert totals.num_preemptions > 0, "19 usable blocks of 8 cannot hold 5 requests of up to 106 tokens"
    if case == "prefix_caching":  # a second pass over the same prompts hits the cache and still matches
        assert _ids(_gen(llm, PROMPTS, GREEDY)) == reference


def test_one_request_at_a_time_matches_the_batch(spec_llm, reference):
    llm, _ = spec_llm
    for prompt, ref in zip(PROMPTS[:3], reference):
        assert _ids(_gen(llm, [prompt], GREEDY)) == [ref]


def test_max_tokens_hitting_mid_draft(spec_llm, reference):
    """Every max_tokens from 1 to 9 on the prompts whose drafts get accepted: exactly max_tokens
    tokens, the reference's prefix."""
    llm, totals = spec_llm
    before = totals.num_accepted_tokens
    prompts, params = [], []
    for i in (0, 2, 3, 4):
        for m in range(1, 10):
            prompts.append(PROMPTS[i])
            params.append(SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, detokenize=False))
    outs = _gen(llm, prompts, params)
    for out, prompt, p in zip(outs, prompts, params):
        ref = reference[PROMPTS.index(prompt)]
        assert out.outputs[0].token_ids == ref[:p.max_tokens]
        assert out.outputs[0].finish_reason == "length"
    assert totals.num_accepted_tokens > before


def test_eos_honoured_identical(tiny_llama, reference):
    """With EOS honoured, each output stops at the first EOS (id 2) exactly as without speculation."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, detokenize=False)
    base, _ = _llm(tiny_llama, spec=False)
    spec, _ = _llm(tiny_llama, spec=True)
    expected = _ids(_gen(base, PROMPTS, params))
    assert _ids(_gen(spec, PROMPTS, params)) == expected
    for ref, out in zip(reference, expected):
        assert out == (ref[:ref.index(2) + 1] if 2 in ref else ref)


# -- random sampling ------------------------------------------------------------------------------------
def test_seeded_random_identical_with_and_without_speculation(tiny_llama):
    params = [SamplingParams(temperature=0.8, seed=42, max_tokens=30, ignore_eos=True, detokenize=False),
              SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=30, ignore_eos=True, detokenize=False),
              SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=30, ignore_eos=True, detokenize=False,
                             n=2),
              SamplingParams(temperature=0.5, seed=11, max_tokens=30, ignore_eos=True, detokenize=False,
                             repetition_penalty=1.1)]
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[4], PROMPTS[3]]
    base, _ = _llm(tiny_llama, spec=False)
    spec, totals = _llm(tiny_llama, spec=True)
    expected = _gen(base, prompts, params)
    got = _gen(spec, prompts, params)
    for e, g in zip(expected, got):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in e.outputs]
    assert len(got[2].outputs) == 2
    assert totals.num_accepted_tokens > 0


# -- logprobs ---------------------------------------------------------------------------------------------
def test_logprobs_one_entry_per_token(tiny_llama, reference):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, detokenize=False, logprobs=2)
    base, _ = _llm(tiny_llama, spec=False)
    spec, totals = _llm(tiny_llama, spec=True)
    expected = _gen(base, PROMPTS, params)
    got = _gen(spec, PROMPTS, params)
    assert totals.num_accepted_tokens > 0
    for e, g, ref in zip(expected, got, reference):
        c = g.outputs[0]
        assert c.token_ids == ref[:20]
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids)
        for tok, entry, e_entry in zip(c.token_ids, c.logprobs, e.outputs[0].logprobs):
            assert tok in entry and len(entry) >= 2
            assert entry[tok].logprob == pytest.approx(e_entry[tok].logprob, abs=1e-3)
        assert c.cumulative_logprob == pytest.approx(e.outputs[0].cumulative_logprob, abs=1e-2)


# -- with a tokenizer: stop strings, a JSON-schema grammar ---------------------------------------------------
def _bundled_model_or_skip() -> str:
    """The bundled SmolLM2's folder; the test is skipped when its package is not installed."""
    import importlib.util

    from aserve.model_source import BUNDLED_PACKAGE, resolve_model

    if importlib.util.find_spec(BUNDLED_PACKAGE) is None:  # (importing it needs the `llm` CLI package)
        pytest.skip(f"the bundled model package {BUNDLED_PACKAGE} is not installed")
    return resolve_model("", None, None, "auto")


@pytest.fixture(scope="module")
def tiny_llama_with_tokenizer(tmp_path_factory):
    """A tiny random llama over SmolLM2's vocabulary, with SmolLM2's tokenizer files."""
    from tests.support.tiny_models import GREEDY_STABLE, save_tiny_hf

    src = _bundled_model_or_skip()
    path = tmp_path_factory.mktemp("tiny_llama_tok")
    save_tiny_hf(path, "llama", seed=99, perturb=False, tie_word_embeddings=True,
                 **{**GREEDY_STABLE, "vocab_size": 49152})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{src}/{name}", path / name)
    return str(path)


TEXT_PROMPTS = ["one two three one two three one two three one two",
                "The cat sat on the mat. The cat sat on the mat. The cat"]


def _text_llm(path: str, spec: bool, **kwargs) -> tuple[LLM, SpecTotals]:
    return _llm(path, spec, skip_tokenizer_init=False, **kwargs)


@pytest.mark.parametrize("method", ["ngram", "self_draft"])
def test_stop_strings_never_leak(method, tiny_llama_with_tokenizer):
    """Nothing after a stop string is kept: text, token ids, logprobs and the cumulative logprob are the
    engine's without speculation (a draft model drafting for itself brings 4 tokens a step)."""
    base, _ = _text_llm(tiny_llama_with_tokenizer, spec=False)
    extra = {} if method == "ngram" else {"speculative_config": {"model": tiny_llama_with_tokenizer,
                                                                 "num_speculative_tokens": 3}}
    spec, totals = _text_llm(tiny_llama_with_tokenizer, spec=method == "ngram", **extra)
    plain = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    free = [o.outputs[0] for o in base.generate(TEXT_PROMPTS, plain, use_tqdm=False)]
    assert [o.outputs[0].text for o in spec.generate(TEXT_PROMPTS, plain, use_tqdm=False)] == [c.text for c in free]
    params = []
    for c in free:
        text = c.text
        assert len(text) >= 12, text
        mid = len(text) // 2
        stop = text[mid:mid + 3]
        params.append((stop, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, stop=[stop], logprobs=0)))
    expected = base.generate(TEXT_PROMPTS, [p for _, p in params], use_tqdm=False)
    got = spec.generate(TEXT_PROMPTS, [p for _, p in params], use_tqdm=False)
    for (stop, _), e, g, c in zip(params, expected, got, free):
        out = g.outputs[0]
        assert out.text == e.outputs[0].text == c.text[:c.text.index(stop)]
        assert out.token_ids == e.outputs[0].token_ids and len(out.logprobs) == len(out.token_ids)
        assert out.cumulative_logprob == pytest.approx(e.outputs[0].cumulative_logprob, abs=1e-4)
        assert stop not in out.text
        assert out.finish_reason == "stop" and out.stop_reason == stop
    assert totals.num_drafts > 0


def json_schema_params() -> SamplingParams:
    """Greedy, 48 tokens, a small JSON schema without whitespace (shared with test_multi_step_decode.py)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "tags": {"type": "array", "items": {"enum": ["a", "b", "ab"]},
                                                        "maxItems": 6}},
              "required": ["name", "tags"], "additionalProperties": False}
    return SamplingParams(temperature=0.0, max_tokens=48,
                          guided_decoding=GuidedDecodingParams(json=schema, disable_any_whitespace=True))


def assert_same_outputs(want_llm: LLM, got_llm: LLM, prompts: list[str], params: SamplingParams) -> None:
    """Both engines give the same tokens, text and finish reason for every prompt."""
    want = want_llm.generate(prompts, params, use_tqdm=False)
    got = got_llm.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason


def test_json_schema_request_identical(tiny_llama_with_tokenizer):
    pytest.importorskip("xgrammar")
    params = json_schema_params()
    prompts = ["JSON: {\"name\": \"ab\", \"tags\": [\"a\", \"b\", \"a\", \"b\"]} JSON:", TEXT_PROMPTS[1]]
    base, _ = _text_llm(tiny_llama_with_tokenizer, spec=False)
    spec, totals = _text_llm(tiny_llama_with_tokenizer, spec=True)
    assert_same_outputs(base, spec, prompts, params)
    assert totals.num_drafts > 0


# -- the bundled SmolLM2 ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_greedy_identical_with_ngram():
    """Two copy-heavy chats (drafts accepted several positions deep; one ends on EOS) and a
    JSON-schema request copying a JSON object (drafts verified under the grammar), in one batch."""
    _bundled_model_or_skip()
    chats = ["Repeat this sentence exactly three times: the quick brown fox jumps over the lazy dog.",
             "Copy the list: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry.",
             'Copy this JSON exactly: {"name": "Ada Lovelace", "tags": ["red", "blue", "red", "blue", "green"]}']
    schema = {"type": "object",
              "properties": {"name": {"type": "string", "maxLength": 20},
                             "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 6}},
              "required": ["name", "tags"], "additionalProperties": False}
    greedy = SamplingParams(temperature=0.0, max_tokens=48)
    params = [greedy, greedy, SamplingParams(temperature=0.0, max_tokens=48, guided_decoding=GuidedDecodingParams(
        json=schema, disable_any_whitespace=True))]
    kwargs = {"dtype": "float32", "max_model_len": 256, "cpu_kvcache_space": 0.05}
    base = LLM("", **kwargs)
    tok = base.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for c in chats]
    expected = _gen(base, prompts, params)
    spec = LLM("", speculative_config=dict(SPEC), **kwargs)
    totals = SpecTotals()
    spec.engine.stat_loggers.append(totals)
    got = _gen(spec, prompts, params)
    assert _ids(got) == _ids(expected)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in expected]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in expected]
    assert json.loads(got[2].outputs[0].text)["name"]  # the grammar held
    assert totals.num_accepted_tokens > 0
    # max_tokens landing inside a run of accepted drafts: exactly max_tokens tokens, the same prefix.
    full = expected[1].outputs[0].token_ids
    outs = _gen(spec, [prompts[1]] * 8, [SamplingParams(temperature=0.0, max_tokens=m) for m in range(20, 28)])
    assert [o.outputs[0].token_ids for o in outs] == [full[:m] for m in range(20, 28)]
