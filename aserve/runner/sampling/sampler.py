"""Batched sampling: one call per step over the rows that sample; this module only orchestrates.

Per row, in order (each step touches only the rows that need it): logit_bias -> allowed_token_ids ->
min_tokens stop masking -> logits processors -> repetition penalty -> presence / frequency penalties
-> the grammar's token bitmask (guided rows) -> temperature (0 = greedy argmax) -> top_k -> top_p ->
min_p -> draw (`draw.py`).

Rows filtered by top-k / top-p draw among a candidate set sorted by logit (a partial selection, not a
sort, whenever it provably holds the nucleus: `topk_topp.py`); the others draw over the whole
vocabulary. Parameters come from the persistent per-request table (`state.py`), gathered once per
step. A row whose logits processor fails is left out and reported; the other rows sample exactly as
they would without it. The host sees the results once, in the final `.tolist()` (the CPU-only top-p
shortcut also syncs, which is free there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from aserve.core.batch import TokenLogprobs
from aserve.runner.sampling.draw import draw
from aserve.runner.sampling.logprobs import sampled_with_logprobs
from aserve.runner.sampling.penalties import apply_bias_and_masks, apply_penalties
from aserve.runner.sampling.processors import apply_processors
from aserve.runner.sampling.state import (
    MIN_P, TEMPERATURE, TOP_K, TOP_P, RequestSampling, SamplingStates, StepParams, index_tensor,
    make_generator)
from aserve.runner.sampling.topk_topp import argmax, mask_candidates, nucleus_fits, topk

# Top-p (on CPU) looks for the nucleus among the 64, then this many most likely tokens before sorting.
_TOP_P_CANDIDATES = 1024


@dataclass
class SamplerResult:
    """`sampled_token_ids` / `logprobs`: one entry per row not in `failed`, in row order."""

    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where the row did not ask for logprobs
    failed: dict[int, str] = field(default_factory=dict)  # row position -> why (its logits processor failed)


class Sampler:
    """Samples one token per row from `logits [B, V]`; see the module docstring. `states` holds the
    live requests' sampling state: `states.add(...)` when a request arrives, `states.remove` when it
    leaves."""

    def __init__(self, vocab_size: int, device: torch.device | str, seed: int = 0):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.states = SamplingStates(vocab_size, self.device)
        self.generator = make_generator(seed, self.device)  # shared by the unseeded rows
        # Largest candidate set tried before a full sort (top-p on CPU; top-k up to this k uses topk).
        self.top_p_candidates = _TOP_P_CANDIDATES
        # The noise draw needs no sort and no sync (accelerators); on CPU one uniform per row is far cheaper.
        self.use_exponential_noise = self.device.type != "cpu"

    def sample(self, logits: torch.Tensor, rows: list[RequestSampling],
               grammar_mask: tuple[torch.Tensor, list[int]] | None = None) -> SamplerResult:
        """One token per row. `logits` is `[len(rows), vocab_size]`, any float dtype; it is not modified.
        `grammar_mask` = (bitmask, row positions): the guided rows' allowed tokens (runner/structured.py)."""
        if not rows:
            return SamplerResult([], [])
        work, failed = None, {}
        if grammar_mask is not None or any(r.modifies_logits for r in rows):
            work = logits.to(torch.float32, copy=True)
            apply_bias_and_masks(work, rows)
            if any(r.processors for r in rows):
                failed = apply_processors(work, rows)
            if failed:
                keep = [i for i in range(len(rows)) if i not in failed]
                if not keep:
                    return SamplerResult([], [], failed)
                sel = index_tensor(keep, logits.device)
                logits, work, rows = logits[sel], work[sel], [rows[i] for i in keep]
                if grammar_mask is not None:
                    grammar_mask = _remap_mask(grammar_mask, keep)
        num_rows = len(rows)
        lp_rows = [i for i, r in enumerate(rows) if r.num_logprobs is not None]
        raw_logprobs = None
        if lp_rows:
            raw = logits if len(lp_rows) == num_rows else logits[index_tensor(lp_rows, logits.device)]
            raw_logprobs = torch.log_softmax(raw.float(), dim=-1)

        if work is None and all(r.greedy for r in rows):
            sampled = argmax(logits)
        else:
            if work is None:
                work = logits.to(torch.float32, copy=True)
            sampled = self._sample_general(work, rows, grammar_mask)

        if raw_logprobs is None:
            return SamplerResult(sampled.tolist(), [None] * num_rows, failed)
        nums = [rows[i].num_logprobs for i in lp_rows]
        ids, logprobs = sampled_with_logprobs(sampled, raw_logprobs, lp_rows, nums)
        return SamplerResult(ids, logprobs, failed)

    # -- the general path ------------------------------------------------------------------------
    def _sample_general(self, work: torch.Tensor, rows: list[RequestSampling],
                        grammar_mask: tuple[torch.Tensor, list[int]] | None = None) -> torch.Tensor:
        """Penalties, the grammar mask, then greedy rows take the argmax and the others go to
        `_sample_random`."""
        device = work.device
        random_rows = [i for i, r in enumerate(rows) if not r.greedy]
        params = None
        if random_rows or any(r.repetition or r.presence_or_frequency for r in rows):
            params = self.states.gather(rows)
            apply_penalties(work, rows, params)
        if grammar_mask is not None and grammar_mask[1]:
            from aserve.structured_outputs.bitmask import apply_bitmask  # imports xgrammar: only when guided

            apply_bitmask(work, *grammar_mask)
        if not random_rows:
            return argmax(work)
        sel = _positions(random_rows, len(rows), device)
        rand = work if sel is None else work[sel]
        rand_rows, rand_params = [rows[i] for i in random_rows], params.rows(sel)
        if any(r.scales_temperature for r in rand_rows):
            rand.div_(rand_params.column(TEMPERATURE).unsqueeze(1))
        rand_tokens = self._sample_random(rand, rand_rows, rand_params)
        if sel is None:
            return rand_tokens
        greedy_rows = index_tensor([i for i, r in enumerate(rows) if r.greedy], device)
        tokens = torch.empty(len(rows), dtype=torch.int64, device=device)
        tokens[greedy_rows] = argmax(work[greedy_rows])
        tokens[sel] = rand_tokens
        return tokens

    def _sample_random(self, logits: torch.Tensor, rows: list[RequestSampling],
                       params: StepParams) -> torch.Tensor:
        """Rows with temperature > 0 (already applied): top-k / top-p / min-p, then the draw."""
        n, vocab = logits.shape
        device = logits.device
        cap = min(self.top_p_candidates, vocab)
        plain, by_topk, by_top_p, by_sort = [], [], [], []
        for j, r in enumerate(rows):
            if r.top_k:
                (by_topk if r.top_k <= cap else by_sort).append(j)
            else:
                (by_top_p if r.top_p < 1.0 else plain).append(j)
        tokens = torch.empty(n, dtype=torch.int64, device=device)
        if plain:
            sel = _positions(plain, n, device)
            sub = logits if sel is None else logits[sel]
            _put(tokens, sel, self._draw(sub, [rows[j] for j in plain], params.rows(sel)))
        if by_topk:
            sel = _positions(by_topk, n, device)
            sub = logits if sel is None else logits[sel]
            group = [rows[j] for j in by_topk]
            vals, ids = topk(sub, max(r.top_k for r in group))
            _put(tokens, sel, self._draw_candidates(vals, ids, group, params.rows(sel), use_top_k=True))
        if by_top_p:
            if device.type == "cpu" and 2 * cap <= vocab:
                by_sort += self._top_p_by_candidates(logits, tokens, by_top_p, rows, params, cap)
            else:
                by_sort += by_top_p
        if by_sort:
            by_sort.sort()
            sel = _positions(by_sort, n, device)
            sub = logits if sel is None else logits[sel]
            vals, ids = sub.sort(dim=-1, descending=True)
            group = [rows[j] for j in by_sort]
            _put(tokens, sel, self._draw_candidates(vals, ids, group, params.rows(sel), use_top_k=True))
        return tokens

    def _top_p_by_candidates(self, logits: torch.Tensor, tokens: torch.Tensor, group: list[int],
                             rows: list[RequestSampling], params: StepParams, cap: int) -> list[int]:
        """Top-p rows whose nucleus lies among the 64 (then `cap`) most likely tokens are drawn there;
        returns the rows left for the full sort. Exact: the candidates' mass is checked against top_p."""
        device = logits.device
        sel = _positions(group, logits.shape[0], device)
        sub = logits if sel is None else logits[sel]
        group_params = params.rows(sel)
        log_z = torch.logsumexp(sub, dim=-1)
        top_p = group_params.column(TOP_P)
        left = list(range(len(group)))  # positions in `group`
        for k in sorted({min(64, cap), cap}):
            part_sel = _positions(left, len(group), device)
            part, z, p = ((sub, log_z, top_p) if part_sel is None
                          else (sub[part_sel], log_z[part_sel], top_p[part_sel]))
            vals, ids, fits = nucleus_fits(part, z, p, k)
            ok = [i for i, f in enumerate(fits) if f]
            if ok:
                keep = _positions(ok, len(left), device)
                if keep is not None:
                    vals, ids, z = vals[keep], ids[keep], z[keep]
                members = [group[left[i]] for i in ok]
                member_params = group_params.rows(index_tensor([left[i] for i in ok], device))
                drawn = self._draw_candidates(vals, ids, [rows[j] for j in members], member_params,
                                              use_top_k=False, log_z=z)
                _put(tokens, _positions(members, tokens.shape[0], device), drawn)
            left = [left[i] for i, f in enumerate(fits) if not f]
            if not left:
                break
        return [group[i] for i in left]

    def _draw_candidates(self, vals: torch.Tensor, ids: torch.Tensor, rows: list[RequestSampling],
                         params: StepParams, use_top_k: bool,
                         log_z: torch.Tensor | None = None) -> torch.Tensor:
        """Draws among candidates sorted by descending logit (`ids` their token ids), after the rows'
        top-k (`use_top_k`) and top-p. `log_z`: each row's normalizer over the whole vocabulary (None:
        over the kept candidates)."""
        widths = None
        if use_top_k:
            ks = [r.top_k or self.vocab_size for r in rows]
            if any(k < vals.shape[1] for k in ks):
                widths = ks
        top_k = params.column(TOP_K) if widths is not None else None
        top_p = params.column(TOP_P) if any(r.top_p < 1.0 for r in rows) else None
        mask_candidates(vals, top_k, top_p, log_z)
        picked = self._draw(vals, rows, params, widths)
        return ids.gather(1, picked.unsqueeze(1)).squeeze(1)

    def _draw(self, logits: torch.Tensor, rows: list[RequestSampling], params: StepParams,
              widths: list[int] | None = None) -> torch.Tensor:
        min_p = params.column(MIN_P) if any(r.min_p > 0.0 for r in rows) else None
        generators = [r.generator for r in rows]
        return draw(logits, generators, self.generator, min_p, self.use_exponential_noise, widths)


def _remap_mask(grammar_mask: tuple[torch.Tensor, list[int]], keep: list[int]) -> tuple[torch.Tensor, list[int]]:
    """The mask for the kept rows: bitmask rows moved to the kept rows' new positions."""
    bitmask, rows = grammar_mask
    new_pos = {old: new for new, old in enumerate(keep)}
    kept = [r for r in rows if r in new_pos]
    moved = bitmask.clone()
    for r in kept:
        moved[new_pos[r]] = bitmask[r]
    return moved, [new_pos[r] for r in kept]


def _positions(values: list[int], total: int, device: torch.device) -> torch.Tensor | None:
    """An index for `values` among `total` rows; None when it is all of them in order."""
    return None if len(values) == total else index_tensor(values, device)


def _put(tokens: torch.Tensor, where: torch.Tensor | None, values: torch.Tensor) -> None:
    if where is None:
        tokens.copy_(values)
    else:
        tokens[where] = values
