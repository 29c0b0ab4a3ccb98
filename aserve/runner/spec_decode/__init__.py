"""Speculative decoding in the runner: draft proposers (`ngram.py`, `draft_model.py`); verification
lives in `runner/step_sampling.py`, scheduling in `core/spec_decoding.py`.

A proposer has `propose(req_ids, states, inputs) -> {req_id: drafts}`, called after a step's sampling
for the requests that sampled (their states' `token_ids` already hold this step's tokens).
"""

from __future__ import annotations

from typing import Any

from aserve.config import AserveConfig
from aserve.config.speculative import SpeculativeConfig
from aserve.runner.step_sampling import TypicalAcceptance


def make_proposer(config: AserveConfig, backend: Any, device: Any):
    """The configured proposer, or None with speculation off. A draft model is loaded here."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "ngram":
        from aserve.runner.spec_decode.ngram import NgramProposer

        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    from aserve.runner.spec_decode.draft_model import DraftModelProposer

    return DraftModelProposer(config, backend, device)


def make_typical_acceptance(spec: SpeculativeConfig | None) -> TypicalAcceptance | None:
    """The typical-acceptance rule when configured, else None (exact rejection sampling)."""
    if spec is None or spec.acceptance_method != "typical_acceptance_sampler":
        return None
    return TypicalAcceptance(spec.posterior_threshold, spec.posterior_alpha)
