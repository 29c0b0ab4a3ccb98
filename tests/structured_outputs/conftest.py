"""A grammar compiler over SmolLM2's real tokenizer, and a batched sampling loop over random logits."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("xgrammar")


@pytest.fixture(scope="session")
def model_vocab_size(bundled_model_path) -> int:
    with open(f"{bundled_model_path}/config.json") as f:
        return json.load(f)["vocab_size"]


@pytest.fixture(scope="session")
def eos_token_id(smol_tokenizer) -> int:
    return smol_tokenizer.eos_token_id


@pytest.fixture(scope="session")
def compilers(smol_tokenizer, model_vocab_size, eos_token_id):
    from aserve.structured_outputs.registry import StructuredOutputCompilers

    return StructuredOutputCompilers(smol_tokenizer, model_vocab_size, stop_token_ids=[eos_token_id])


@pytest.fixture(scope="session", params=["xgrammar", "guidance"])
def compiler(request, compilers):
    """Each backend's compiler (GrammarCompiler / GuidanceCompiler share one contract)."""
    if request.param == "guidance":
        pytest.importorskip("llguidance")
    return compilers.compiler(request.param)


@pytest.fixture(scope="session")
def logit_bias(smol_tokenizer, model_vocab_size):
    """Random logits alone wander (whitespace runs, endless strings); this bias makes structural
    characters likely and whitespace-only tokens unlikely, so outputs finish within a few hundred
    steps. It only reweights: the grammar mask still decides what is possible."""
    bias = torch.zeros(model_vocab_size)
    for token_id in range(len(smol_tokenizer)):
        text = smol_tokenizer.decode([token_id])
        if any(ch in text for ch in '"}],'):
            bias[token_id] = 4.0
        elif text and not text.strip():
            bias[token_id] = -8.0
    return bias


class Sampled:
    def __init__(self, token_ids: list[int], terminated: bool, text: str):
        self.token_ids, self.terminated, self.text = token_ids, terminated, text


@pytest.fixture(scope="session")
def sample(compiler, smol_tokenizer, logit_bias):
    """sample(params, n, seed, max_steps) -> list[Sampled]: n rows decoded together, argmax over
    masked random logits, one batched bitmask fill per step, the stop token excluded from text."""
    from aserve.structured_outputs.bitmask import BitmaskBuilder, accept_tokens, apply_bitmask

    def run(params, n: int = 6, seed: int = 0, max_steps: int = 300) -> list[Sampled]:
        compiled = compiler.compile(params)
        states = [compiler.new_state(compiled) for _ in range(n)]
        builder = BitmaskBuilder(compiler.vocab_size, n)
        gen = torch.Generator().manual_seed(seed)
        outputs: list[list[int]] = [[] for _ in range(n)]
        for _ in range(max_steps):
            rows = [i for i in range(n) if not states[i].is_terminated()]
            if not rows:
                break
            logits = torch.randn(n, compiler.vocab_size, generator=gen) + logit_bias
            apply_bitmask(logits, builder.fill(rows, [states[i] for i in rows]), rows)
            sampled = logits.argmax(dim=-1).tolist()
            assert all(accept_tokens([states[i] for i in rows], [sampled[i] for i in rows]))
            for i in rows:
                if not states[i].is_terminated():
                    outputs[i].append(sampled[i])
        return [Sampled(ids, s.is_terminated(), smol_tokenizer.decode(ids))
                for ids, s in zip(outputs, states)]

    return run
