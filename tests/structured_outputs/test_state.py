"""GrammarState: rebuild after preemption, rollback, stop-only once complete, bitmask rows."""

from __future__ import annotations

import pytest

from aserve.structured_outputs.bitmask import BitmaskBuilder, accept_tokens, apply_bitmask
from aserve.structured_outputs.params import GuidedDecodingParams
from aserve.structured_outputs.state import GrammarStateError

torch = pytest.importorskip("torch")

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "n": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
          "required": ["name", "n"]}


def _mask_of(state, vocab_size: int) -> torch.Tensor:
    builder = BitmaskBuilder(vocab_size, 1)
    return builder.fill([0], [state])[0].clone()


@pytest.fixture
def json_params():
    return GuidedDecodingParams(json=SCHEMA, disable_any_whitespace=True)


def test_rebuild_after_preemption_matches_uninterrupted(compiler, sample, json_params):
    """A preempted request loses its runner state; replaying its outputs into a fresh state must
    give the same masks as the state that never stopped, at every cut point."""
    tokens = sample(json_params, n=1, seed=21)[0].token_ids
    assert len(tokens) > 5
    compiled = compiler.compile(json_params)
    uninterrupted = compiler.new_state(compiled)
    for cut, token_id in enumerate(tokens):
        resumed = compiler.state_for(json_params, tokens[:cut])
        assert resumed.num_accepted == uninterrupted.num_accepted == cut
        assert torch.equal(_mask_of(resumed, compiler.vocab_size), _mask_of(uninterrupted, compiler.vocab_size))
        assert uninterrupted.accept_token(token_id)
    assert uninterrupted.is_completed()
    assert compiler.state_for(json_params, tokens).is_completed()


def test_rebuild_rejects_foreign_tokens(compiler, smol_tokenizer, json_params):
    state = compiler.new_state(compiler.compile(json_params))
    with pytest.raises(GrammarStateError, match="output token 0"):
        state.rebuild(smol_tokenizer.encode("hello", add_special_tokens=False))
    assert state.num_accepted == 0  # left reset


def test_rollback_restores_the_mask(compiler, sample, json_params):
    tokens = sample(json_params, n=1, seed=4)[0].token_ids
    half = len(tokens) // 2
    state = compiler.new_state(compiler.compile(json_params))
    assert state.accept_tokens(tokens[:half]) == half
    before = _mask_of(state, compiler.vocab_size)
    assert state.accept_tokens(tokens[half:]) == len(tokens) - half
    assert not torch.equal(before, _mask_of(state, compiler.vocab_size))  # complete: stop only
    state.rollback(len(tokens) - half)
    assert state.num_accepted == half
    assert torch.equal(before, _mask_of(state, compiler.vocab_size))
    with pytest.raises(ValueError):
        state.rollback(state.num_accepted + 1)


def test_completed_grammar_allows_only_stop_tokens(compiler, smol_tokenizer, eos_token_id):
    state = compiler.new_state(compiler.compile(GuidedDecodingParams(choice=["yes", "no"])))
    assert not state.accept_token(eos_token_id)  # not allowed before the grammar is complete
    ids = smol_tokenizer.encode("yes", add_special_tokens=False)
    assert state.accept_tokens(ids) == len(ids) and state.is_completed() and not state.is_terminated()
    for terminated in (False, True):
        logits = torch.zeros(1, compiler.vocab_size)
        apply_bitmask(logits, _mask_of(state, compiler.vocab_size).unsqueeze(0), [0])
        assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [eos_token_id]
        if not terminated:
            assert state.accept_token(eos_token_id) and state.is_terminated()
    assert not state.accept_token(ids[0])  # nothing after the stop token


def test_fill_only_touches_listed_rows_and_apply_only_those_rows(compiler, json_params):
    states = [compiler.new_state(compiler.compile(json_params)) for _ in range(2)]
    builder = BitmaskBuilder(compiler.vocab_size, 4)
    builder.bitmask.fill_(-1)
    mask = builder.fill([1, 3], states)
    assert bool((mask[0] == -1).all()) and bool((mask[2] == -1).all())
    logits = torch.zeros(4, compiler.vocab_size)
    apply_bitmask(logits, mask, [1, 3])
    assert bool(torch.isfinite(logits[0]).all()) and bool(torch.isfinite(logits[2]).all())
    allowed = torch.isfinite(logits[1])
    assert 0 < int(allowed.sum()) < compiler.vocab_size
    assert torch.equal(allowed, torch.isfinite(logits[3]))


def test_batched_accept_reports_rejections(compiler, smol_tokenizer):
    compiled = compiler.compile(GuidedDecodingParams(choice=["yes", "no"]))
    states = [compiler.new_state(compiled) for _ in range(2)]
    yes = smol_tokenizer.encode("yes", add_special_tokens=False)[0]
    bad = smol_tokenizer.encode("{", add_special_tokens=False)[0]
    assert accept_tokens(states, [yes, bad]) == [True, False]
    assert [s.num_accepted for s in states] == [1, 0]
    with pytest.raises(ValueError):
        accept_tokens(states, [yes])
