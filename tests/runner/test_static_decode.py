"""Decode batches padded to the fixed capture sizes return exactly the eager (unpadded) tokens."""

from __future__ import annotations

import random

from aserve import LLM, SamplingParams
from aserve.runner.cuda_graphs import capture_sizes, padded_size
from aserve.runner.model_runner import ModelRunner


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(10) == [1, 2, 4, 8, 10]
    assert capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    sizes = capture_sizes(32)
    assert [padded_size(sizes, n) for n in (1, 3, 5, 9, 17, 32)] == [1, 4, 8, 16, 24, 32]
    assert padded_size(sizes, 33) is None


def test_padding_never_changes_tokens(tiny_llama, llm_with_runner):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(3, 40))] for _ in range(10)]
    common = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=128, cpu_kvcache_space=0.02,
                  max_num_seqs=10)
    eager = LLM(tiny_llama, **common)
    padded, _ = llm_with_runner(tiny_llama, lambda config: ModelRunner(config, force_static_decode=True), **common)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, detokenize=False)
    # Every batch size 1..10 exercises every capture size (1, 2, 4, 8, 10) and padding inside each.
    for k in range(1, 11):
        batch = [{"prompt_token_ids": p} for p in prompts[:k]]
        a = [o.outputs[0].token_ids for o in eager.generate(batch, params, use_tqdm=False)]
        b = [o.outputs[0].token_ids for o in padded.generate(batch, params, use_tqdm=False)]
        assert a == b, f"batch of {k}"


def test_padded_verify_rows_never_change_tokens(tiny_llama, llm_with_runner):
    """Speculative verification is decode rows too (batch expansion): padded to a capture size, the
    tokens are the eager engine's without speculation."""
    span = [5, 17, 99, 42, 7, 300, 12]
    prompts = [span * 3, span[:4] * 4 + [8, 9], [200 + i for i in range(12)] + span]
    common = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=128, cpu_kvcache_space=0.02,
                  max_num_seqs=10)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    padded_sizes: list[int] = []

    class RecordingRunner(ModelRunner):
        def prepare(self, req_ids, num_tokens, spec_tokens):
            inputs = super().prepare(req_ids, num_tokens, spec_tokens)
            if spec_tokens and inputs.meta.num_decodes == inputs.meta.num_seqs:
                padded_sizes.append(inputs.meta.num_seqs)
            return inputs

    eager = LLM(tiny_llama, **common)
    padded, _ = llm_with_runner(tiny_llama, lambda config: RecordingRunner(config, force_static_decode=True),
                                speculative_config=spec, **common)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, detokenize=False)
    batch = [{"prompt_token_ids": p} for p in prompts]
    a = [o.outputs[0].token_ids for o in eager.generate(batch, params, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in padded.generate(batch, params, use_tqdm=False)]
    assert a == b
    assert padded_sizes and all(n in capture_sizes(10) for n in padded_sizes)
