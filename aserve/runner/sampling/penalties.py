"""Logit edits that precede temperature: logit_bias, allowed_token_ids, min_tokens stop masking,
then repetition / presence / frequency penalties. All in place on float32 `work [B, V]` (row i is
`rows[i]`), touching only the rows that ask and, for penalties, only the tokens that occurred."""

from __future__ import annotations

import torch

from aserve.runner.sampling.state import (
    FREQUENCY, PRESENCE, REPETITION, RequestSampling, StepParams, index_tensor)

_NEG_INF = float("-inf")


def apply_bias_and_masks(work: torch.Tensor, rows: list[RequestSampling]) -> None:
    """Adds logit_bias, keeps only allowed_token_ids, and masks the stop tokens of rows that have not
    reached min_tokens (unless the row's grammar is complete: then only stop tokens remain, and the
    grammar wins over min_tokens)."""
    device, vocab = work.device, work.shape[1]
    flat = work.view(-1)
    biased = [i for i, r in enumerate(rows) if r.bias_ids is not None]
    if biased:
        keys = torch.cat([rows[i].bias_ids + i * vocab for i in biased])
        flat.index_put_((keys,), torch.cat([rows[i].bias_values for i in biased]), accumulate=True)
    allowed = [i for i, r in enumerate(rows) if r.allowed_ids is not None]
    if allowed:
        keys = torch.cat([rows[i].allowed_ids + i * vocab for i in allowed])
        kept = flat[keys]
        work.index_fill_(0, index_tensor(allowed, device), _NEG_INF)
        flat[keys] = kept
    stop_keys = [i * vocab + t for i, r in enumerate(rows)
                 if r.min_tokens and r.num_output_tokens < r.min_tokens
                 and not (r.grammar is not None and r.grammar.is_completed())
                 for t in r.stop_token_ids_for_min_tokens]
    if stop_keys:
        flat[index_tensor(stop_keys, device)] = _NEG_INF


def apply_penalties(work: torch.Tensor, rows: list[RequestSampling], params: StepParams) -> None:
    """Repetition penalty once per distinct token of prompt + output (positive logits divided, negative
    multiplied), then `-frequency * count - presence` per distinct output token. `params` holds the
    rows' parameters in the same order."""
    if not any(r.repetition or r.presence_or_frequency for r in rows):
        return
    device, vocab = work.device, work.shape[1]
    flat = work.view(-1)
    rep = [i for i, r in enumerate(rows) if r.repetition]
    if rep:
        parts = [t for i in rep for t in (rows[i].prompt_ids(device) + i * vocab,
                                          rows[i].output_ids(device) + i * vocab)]
        keys = torch.unique(torch.cat(parts))
        if keys.numel():
            factors = params.column(REPETITION)[keys // vocab]
            vals = flat[keys]
            flat[keys] = torch.where(vals > 0, vals / factors, vals * factors)
    other = [i for i, r in enumerate(rows) if r.presence_or_frequency]
    if other:
        keys = torch.cat([rows[i].output_ids(device) + i * vocab for i in other])
        if keys.numel():
            row_of = keys // vocab
            freq, pres = params.column(FREQUENCY), params.column(PRESENCE)
            _, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
            # Summed over a token's occurrences: -frequency * count - presence.
            delta = -(freq[row_of] + pres[row_of] / counts[inverse].to(torch.float32))
            flat.index_add_(0, keys, delta)
