"""Logprobs of the raw model distribution (`log_softmax` of the logits as given, in float32): the
chosen token's logprob and rank, then the top N, for sampled tokens and for prompt positions."""

from __future__ import annotations

import torch

from aserve.core.batch import TokenLogprobs


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                    num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the given token, then the top `num_top` -> (ids, logprobs, ranks), each `[n, 1 + k]`.
    rank = 1 + the number of tokens with a strictly greater logprob."""
    token_ids = token_ids.to(torch.int64).unsqueeze(1)
    chosen = logprobs.gather(1, token_ids)
    chosen_rank = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1
    if num_top <= 0:
        return token_ids, chosen, chosen_rank
    top_vals, top_ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)
    # All values greater than a top value precede it in the (descending) top list.
    top_ranks = (top_vals.unsqueeze(1) > top_vals.unsqueeze(2)).sum(dim=-1) + 1
    return (torch.cat([token_ids, top_ids], dim=1), torch.cat([chosen, top_vals], dim=1),
            torch.cat([chosen_rank, top_ranks], dim=1))


def sampled_with_logprobs(sampled: torch.Tensor, raw_logprobs: torch.Tensor, lp_rows: list[int],
                          nums: list[int]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """The sampled ids as a list and, for rows `lp_rows` (whose `log_softmax` rows are `raw_logprobs`),
    each with `nums[j]` top entries, their TokenLogprobs (None elsewhere). The ints cross to the host
    in one transfer, the floats in another."""
    num_rows, vocab = sampled.shape[0], raw_logprobs.shape[1]
    lp_sampled = sampled if len(lp_rows) == num_rows else sampled[torch.tensor(lp_rows).to(sampled.device)]
    max_top = min(max(nums), vocab)
    ids, vals, ranks = gather_logprobs(raw_logprobs, lp_sampled, max_top)
    ints = torch.cat([sampled, ids.flatten(), ranks.flatten()]).tolist()
    floats = vals.flatten().tolist()
    width = 1 + max_top
    ids_list = ints[num_rows:num_rows + len(lp_rows) * width]
    ranks_list = ints[num_rows + len(lp_rows) * width:]
    out: list[TokenLogprobs | None] = [None] * num_rows
    for j, (i, num) in enumerate(zip(lp_rows, nums)):
        s, n = j * width, 1 + min(num, vocab)
        out[i] = TokenLogprobs(token_ids=ids_list[s:s + n], logprobs=floats[s:s + n],
                               ranks=ranks_list[s:s + n])
    return ints[:num_rows], out


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor,
                            num_top: int) -> list[TokenLogprobs]:
    """One entry per row of `logits [n, V]`: logprob and rank of `target_token_ids[i]` (the next prompt
    token), then the top `num_top`; all from `log_softmax(logits)` in float32."""
    if logits.shape[0] == 0:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids, vals, ranks = gather_logprobs(logprobs, target_token_ids.to(logits.device),
                                       min(num_top, logits.shape[1]))
    return [TokenLogprobs(token_ids=i, logprobs=v, ranks=r)
            for i, v, r in zip(ids.tolist(), vals.tolist(), ranks.tolist())]
