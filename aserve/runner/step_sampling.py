"""One step's sampling: a token per sampling request, or with speculative decoding the verification
of its drafts (rejection sampling), over the logits rows the model produced.

Verification samples the target's own distribution position by position and accepts a draft while
the sampled token equals it; the first token that differs (or the one after the last draft) ends
the request's step. Drafts are deterministic proposals (n-gram lookups, a draft model's argmax), so
this is exactly the standard rejection rule with a point-mass draft distribution: a draft d is
accepted with probability p(d), and after a rejection the token is drawn from p without d,
renormalised. The output distribution is therefore the target's, and more: each position sees
exactly the history it would see without speculation (its accepted drafts are appended to the
request's tokens before the next position is sampled), so penalties, min_tokens, logits processors
and grammars apply unchanged, and a seeded request draws one random number per output token in the
same order as without speculation. Greedy requests with no history-dependent parameters take one
batched argmax over all their rows.

`typical_acceptance_sampler` (vLLM's name): a draft d is accepted when p(d) > min(threshold,
alpha * exp(-H(p))), p the row's distribution after temperature; the first draft that fails is
replaced by p's most likely token. It trades exactness for acceptance (as in vLLM); greedy and guided
requests, requests asking for logprobs and requests whose logits are edited (bias, allowed tokens,
min_tokens, penalties, logits processors) keep the exact rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from aserve.core.batch import TokenLogprobs
from aserve.runner.input_batch import CachedRequestState
from aserve.runner.sampling import RequestSampling, Sampler
from aserve.runner.sampling.topk_topp import argmax
from aserve.runner.structured import StructuredOutputs


@dataclass
class TypicalAcceptance:
    """vLLM's typical-acceptance rule (see the module docstring)."""

    posterior_threshold: float
    posterior_alpha: float

    def accepts(self, logits: torch.Tensor, temperature: float, draft: int) -> bool:
        """Whether the typical-acceptance rule accepts `draft` under one row's `logits`."""
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        entropy = -(logp.exp() * logp).nan_to_num().sum()
        p_draft = logp[draft].exp()
        return bool(p_draft > min(self.posterior_threshold, self.posterior_alpha * float(torch.exp(-entropy))))


@dataclass
class StepSamples:
    """What the sampling requests produced, in order (failed requests are only in `failed`). The tokens
    are already appended to each request's token list; `num_rejected[req_id]`: drafts rejected."""

    req_ids: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[TokenLogprobs]] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    num_rejected: dict[str, int] = field(default_factory=dict)

    def add(self, req_id: str, tokens: list[int], logprobs: list[TokenLogprobs]) -> None:
        """Records one request's tokens (and their logprobs, or []) for this step."""
        self.req_ids.append(req_id)
        self.token_ids.append(tokens)
        self.logprobs.append(logprobs)


class StepSampler:
    """Samples (and verifies drafts) for the runner; holds no per-request state of its own."""

    def __init__(self, sampler: Sampler, structured: StructuredOutputs, typical: TypicalAcceptance | None = None):
        self.sampler = sampler
        self.structured = structured
        self.typical = typical

    def sample(self, logits: torch.Tensor, req_ids: list[str], states: dict[str, CachedRequestState],
               drafts: dict[str, list[int]], fill) -> StepSamples:
        """`logits` holds 1 + len(drafts[r]) consecutive rows per request of `req_ids` (drafts absent: one
        row). `fill`: the bitmask fill started for `req_ids` (StructuredOutputs.start_fill)."""
        verifying = [drafts.get(r, ()) for r in req_ids] if drafts else None
        if verifying is None or not any(verifying):
            return self._sample_one(logits, req_ids, states, fill)
        rows = [states[r].sampling for r in req_ids]
        if all(r.greedy and not r.modifies_logits and r.num_logprobs is None and r.grammar is None for r in rows):
            return self._verify_greedy(logits, req_ids, states, verifying)
        return self._verify(logits, req_ids, states, verifying, fill)

    @staticmethod
    def plain_greedy(req_ids: list[str], states: dict[str, CachedRequestState]) -> bool:
        """Whether every request's token is its logits' argmax and nothing else reads the logits (greedy, no
        logprobs, penalties, bias, allowed tokens, min_tokens, processors or grammar): then `take_greedy`
        can record tokens chosen without the logits (the LM head's greedy screen, LMHead.greedy)."""
        for req_id in req_ids:
            r = states[req_id].sampling
            if not r.greedy or r.modifies_logits or r.num_logprobs is not None or r.grammar is not None:
                return False
        return True

    def take_greedy(self, token_ids: list[int], req_ids: list[str], states: dict[str, CachedRequestState]
                    ) -> StepSamples:
        """Records the argmax tokens of `plain_greedy` requests, as `sample` would have chosen them."""
        return self._record(req_ids, token_ids, [None] * len(req_ids), {}, states)

    # -- one token per request ---------------------------------------------------------------------
    def _sample_one(self, logits, req_ids, states, fill) -> StepSamples:
        result = self.sampler.sample(logits, [states[r].sampling for r in req_ids], self.structured.finish_fill(fill))
        kept = [r for i, r in enumerate(req_ids) if i not in result.failed]
        failed = {req_ids[i]: m for i, m in result.failed.items()}
        return self._record(kept, result.sampled_token_ids, result.logprobs, failed, states)

    def _record(self, req_ids, token_ids, logprobs, failed, states) -> StepSamples:
        out = StepSamples()
        out.failed = failed
        out.failed.update(self.structured.accept(req_ids, token_ids))
        for req_id, token, lp in zip(req_ids, token_ids, logprobs):
            if req_id not in out.failed:
                states[req_id].token_ids.append(token)
                out.add(req_id, [token], [lp] if lp is not None else [])
        return out

    # -- verification ------------------------------------------------------------------------------
    def _verify_greedy(self, logits, req_ids, states, verifying) -> StepSamples:
        """Every request greedy, unguided, with no history-dependent parameter: one argmax over all rows."""
        best = argmax(logits).tolist()
        out = StepSamples()
        row = 0
        for req_id, draft in zip(req_ids, verifying):
            tokens = [best[row]]
            stops = states[req_id].sampling.stop_token_ids_for_min_tokens
            for j, d in enumerate(draft):
                if tokens[j] != d or d in stops:
                    break
                tokens.append(best[row + j + 1])
            row += len(draft) + 1
            states[req_id].token_ids.extend(tokens)
            out.num_rejected[req_id] = len(draft) + 1 - len(tokens)
            out.add(req_id, tokens, [])
        return out

    def _verify(self, logits, req_ids, states, verifying, fill) -> StepSamples:
        """Position by position over the requests still accepting (see the module docstring)."""
        offsets, row = [], 0
        for draft in verifying:
            offsets.append(row)
            row += len(draft) + 1
        tokens: list[list[int]] = [[] for _ in req_ids]
        logprobs: list[list[TokenLogprobs]] = [[] for _ in req_ids]
        failed: dict[str, str] = {}
        active = list(range(len(req_ids)))
        first_mask = self.structured.finish_fill(fill)  # rows = all requests, for position 0
        pos = 0
        while active:
            sample_now, advanced = self._typical_pass(logits, offsets, pos, active, req_ids, states, verifying,
                                                      tokens)
            next_active = advanced
            if sample_now:
                if pos == 0 and len(sample_now) == len(req_ids):
                    mask = first_mask
                elif fill_needed(self.structured, req_ids, sample_now):
                    mask = self.structured.finish_fill(self.structured.start_fill([req_ids[i] for i in sample_now]))
                else:
                    mask = None
                next_active += self._sample_position(logits, offsets, pos, sample_now, req_ids, states, verifying,
                                                     mask, tokens, logprobs, failed)
            active = sorted(next_active)
            pos += 1
        out = StepSamples(failed=failed)
        for i, req_id in enumerate(req_ids):
            if req_id not in failed:
                out.num_rejected[req_id] = len(verifying[i]) + 1 - len(tokens[i])
                out.add(req_id, tokens[i], logprobs[i])
        return out

    def _sample_position(self, logits, offsets, pos, group, req_ids, states, verifying, mask, tokens, logprobs,
                         failed) -> list[int]:
        """Samples position `pos` of the requests in `group` (one batched sampler call); returns those
        whose draft at `pos` equals the sampled token (they go on to `pos + 1`)."""
        rows = [states[req_ids[i]].sampling for i in group]
        sel = torch.tensor([offsets[i] + pos for i in group], dtype=torch.int64, device=logits.device)
        result = self.sampler.sample(logits.index_select(0, sel), rows, mask)
        kept = [(i, rows[j]) for j, i in enumerate(group) if j not in result.failed]
        failed.update({req_ids[group[j]]: m for j, m in result.failed.items()})
        failed.update(self.structured.accept([req_ids[i] for i, _ in kept], result.sampled_token_ids))
        go_on = []
        for (i, row), token, lp in zip(kept, result.sampled_token_ids, result.logprobs):
            req_id = req_ids[i]
            if req_id in failed:
                continue
            states[req_id].token_ids.append(token)
            tokens[i].append(token)
            if lp is not None:
                logprobs[i].append(lp)
            draft = verifying[i]
            if pos < len(draft) and token == draft[pos] and token not in row.stop_token_ids_for_min_tokens:
                go_on.append(i)
        return go_on

    def _typical_pass(self, logits, offsets, pos, active, req_ids, states, verifying, tokens):
        """Typical acceptance at `pos` for the eligible requests (random, unguided, no logprobs, a draft
        at `pos`). Returns (requests to sample at `pos`, requests whose draft was accepted: they go on to
        `pos + 1`); a rejected draft is replaced by p's most likely token and ends the request's step."""
        if self.typical is None:
            return active, []
        sample_now, advanced = [], []
        for i in active:
            state, draft = states[req_ids[i]], verifying[i]
            sampling: RequestSampling = state.sampling
            if (pos >= len(draft) or sampling.greedy or sampling.grammar is not None or sampling.num_logprobs is not None
                    or sampling.modifies_logits):
                sample_now.append(i)
                continue
            row = logits[offsets[i] + pos]
            token = draft[pos] if self.typical.accepts(row, float(state.params.temperature), draft[pos]) \
                else int(row.argmax())
            state.token_ids.append(token)
            tokens[i].append(token)
            if token == draft[pos] and token not in sampling.stop_token_ids_for_min_tokens:
                advanced.append(i)
        return sample_now, advanced


def fill_needed(structured: StructuredOutputs, req_ids: list[str], group: list[int]) -> bool:
    """Whether any request of `group` has a grammar (its bitmask must be filled for this position)."""
    return bool(structured.requests) and any(req_ids[i] in structured.requests for i in group)
