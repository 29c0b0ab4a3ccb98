"""Batched sampling on tensors: one call per step over the rows that sample.

Order of operations per row (each applied only to the rows that need it):
logit_bias -> allowed_token_ids -> min_tokens stop masking -> logits processors -> repetition penalty
-> presence / frequency penalties -> temperature (0 = greedy) -> top_k -> top_p -> min_p -> sample.

Sampling is `argmax(probs / E)` with `E ~ Exp(1)` (equivalent to drawing from `probs`), batched for all
random rows; a seeded row draws its noise from its own generator, so its samples do not depend on the
rest of the batch. Logprobs are those of the raw model distribution (`log_softmax` of the logits as
given), computed only when some row asks for them. Host syncs happen once, in the final `.tolist()`,
except for the CPU-only top-p shortcut (a sync is free there).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from aserve.core.batch import TokenLogprobs
from aserve.sampling_params import SamplingParams

# Top-p on CPU first looks for the nucleus among this many most likely tokens (a partial selection is
# much cheaper than a full sort); rows whose nucleus is larger fall back to the full sort.
_TOP_P_CANDIDATES = 1024


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request (its noise stream is independent of the batch)."""
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(int(seed))
    return gen


@dataclass
class _RowPlan:
    """What a row needs, derived once from its (immutable) params."""

    greedy: bool
    temperature: float
    top_k: int  # 0 = off
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: tuple[list[int], list[float]] | None
    allowed_token_ids: list[int] | None
    min_tokens: int
    processors: list[tuple[Callable[..., Any], int]]  # (callable, number of positional args: 2 or 3)
    num_logprobs: int | None

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def modifies_logits(self) -> bool:
        return bool(self.needs_penalties or self.logit_bias or self.allowed_token_ids is not None
                    or self.min_tokens > 0 or self.processors)


def _processor_arity(fn: Callable[..., Any]) -> int:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ValueError(f"logits_processors: cannot inspect the signature of {fn!r}") from e
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params = [p for p in sig.parameters.values() if p.kind in kinds]
    required = [p for p in params if p.default is inspect.Parameter.empty]
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in sig.parameters.values()):
        return 3
    for n in (len(required), len(params)):
        if n in (2, 3):
            return n
    raise ValueError(f"logits_processors: {fn!r} must take (output_token_ids, logits) or "
                     f"(prompt_token_ids, output_token_ids, logits), got {len(params)} positional parameters")


def _make_plan(params: SamplingParams, vocab_size: int) -> _RowPlan:
    greedy = params.sampling_type_greedy
    top_k = params.top_k if 0 < params.top_k < vocab_size else 0
    bias = None
    if params.logit_bias:
        bias = (list(params.logit_bias.keys()), list(params.logit_bias.values()))
    return _RowPlan(
        greedy=greedy,
        temperature=1.0 if greedy else float(params.temperature),
        top_k=0 if greedy else top_k,
        top_p=1.0 if greedy else float(params.top_p),
        min_p=0.0 if greedy else float(params.min_p),
        repetition_penalty=float(params.repetition_penalty),
        presence_penalty=float(params.presence_penalty),
        frequency_penalty=float(params.frequency_penalty),
        logit_bias=bias,
        allowed_token_ids=list(params.allowed_token_ids) if params.allowed_token_ids is not None else None,
        min_tokens=params.min_tokens,
        processors=[(f, _processor_arity(f)) for f in params.logits_processors or ()],
        num_logprobs=params.logprobs,
    )


@dataclass
class RowSamplingState:
    """One request as the sampler sees it; built once and kept by the runner for the request's life.

    `output_token_ids` is the runner's own list: it appends each sampled token to this same object.
    `generator` must be set (by `make_generator(params.seed, device)`) when `params.seed` is set.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    stop_token_ids_for_min_tokens: list[int]
    # Derived once, lazily, by the sampler: the row plan and the prompt ids as a tensor.
    _plan: _RowPlan | None = field(default=None, init=False, repr=False, compare=False)
    _prompt_ids_tensor: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)

    def plan(self, vocab_size: int) -> _RowPlan:
        if self._plan is None:
            if self.params.seed is not None and self.generator is None and not self.params.sampling_type_greedy:
                raise ValueError("generator: a request with a seed needs its own generator (make_generator)")
            self._plan = _make_plan(self.params, vocab_size)
        return self._plan

    def prompt_ids_tensor(self, device: torch.device) -> torch.Tensor:
        t = self._prompt_ids_tensor
        if t is None or t.device != device:
            t = torch.tensor(self.prompt_token_ids, dtype=torch.int64, device=device)
            self._prompt_ids_tensor = t
        return t


@dataclass
class SamplerResult:
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where the row did not ask for logprobs


class Sampler:
    """Samples one token per row from `logits [B, V]`; see the module docstring for the order of steps."""

    def __init__(self, vocab_size: int, device: torch.device | str, seed: int = 0):
        if vocab_size <= 0:
            raise ValueError(f"vocab_size: must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = make_generator(seed, self.device)  # shared by the unseeded rows
        self.top_p_candidates = _TOP_P_CANDIDATES

    # -- the step --------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, rows: list[RowSamplingState]) -> SamplerResult:
        """One token per row. `logits` is `[len(rows), vocab_size]`, any float dtype; it is not modified."""
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits: expected shape [{len(rows)}, {self.vocab_size}], got {tuple(logits.shape)}")
        num_rows = len(rows)
        if num_rows == 0:
            return SamplerResult([], [])
        vocab = self.vocab_size
        plans = [r.plan(vocab) for r in rows]

        lp_rows = [i for i, p in enumerate(plans) if p.num_logprobs is not None]
        lp_tensors = None
        if lp_rows:
            raw = logits if len(lp_rows) == num_rows else logits[_index(lp_rows, logits.device)]
            lp_tensors = torch.log_softmax(raw.float(), dim=-1)

        if all(p.greedy and not p.modifies_logits for p in plans):
            sampled = logits.argmax(dim=-1)
        else:
            sampled = self._sample_general(logits, rows, plans)

        if lp_tensors is None:
            return SamplerResult(sampled.tolist(), [None] * num_rows)
        lp_sampled = sampled if len(lp_rows) == num_rows else sampled[_index(lp_rows, sampled.device)]
        max_top = min(max(plans[i].num_logprobs for i in lp_rows), vocab)
        ids, vals, ranks = _gather_logprobs(lp_tensors, lp_sampled, max_top)
        # One host transfer for the ints, one for the floats.
        ints = torch.cat([sampled, ids.flatten(), ranks.flatten()]).tolist()
        floats = vals.flatten().tolist()
        sampled_list = ints[:num_rows]
        width = 1 + max_top
        ids_list = ints[num_rows:num_rows + len(lp_rows) * width]
        ranks_list = ints[num_rows + len(lp_rows) * width:]
        out: list[TokenLogprobs | None] = [None] * num_rows
        for j, i in enumerate(lp_rows):
            n = 1 + min(plans[i].num_logprobs, vocab)
            s = j * width
            out[i] = TokenLogprobs(token_ids=ids_list[s:s + n], logprobs=floats[s:s + n], ranks=ranks_list[s:s + n])
        return SamplerResult(sampled_list, out)

    def _sample_general(self, logits: torch.Tensor, rows: list[RowSamplingState],
                        plans: list[_RowPlan]) -> torch.Tensor:
        device = logits.device
        work = logits.to(torch.float32, copy=True)
        if any(p.modifies_logits for p in plans):
            self._apply_masks_and_bias(work, rows, plans)
            self._apply_processors(work, rows, plans)
            self._apply_penalties(work, rows, plans)

        random_rows = [i for i, p in enumerate(plans) if not p.greedy]
        if not random_rows:
            return work.argmax(dim=-1)
        if len(random_rows) == len(plans):
            rand = work
        else:
            rand = work[_index(random_rows, device)]
        rplans = [plans[i] for i in random_rows]
        temps = [p.temperature for p in rplans]
        if any(t != 1.0 for t in temps):
            rand.div_(torch.tensor(temps, dtype=torch.float32, device=device).unsqueeze(1))
        self._apply_top_k_top_p(rand, rplans)
        _apply_min_p(rand, rplans)
        noise = self._exponential_noise(rand.shape, [rows[i] for i in random_rows], device)
        rand_tokens = _sample_with_noise(rand, noise)
        if rand is work:
            return rand_tokens
        tokens = work.argmax(dim=-1)
        tokens[_index(random_rows, device)] = rand_tokens
        return tokens

    # -- pieces ----------------------------------------------------------------------------------
    @staticmethod
    def _apply_masks_and_bias(work: torch.Tensor, rows: list[RowSamplingState], plans: list[_RowPlan]) -> None:
        device = work.device
        # logit_bias: one accumulate-scatter for all rows.
        b_rows: list[int] = []
        b_cols: list[int] = []
        b_vals: list[float] = []
        for i, p in enumerate(plans):
            if p.logit_bias:
                cols, vals = p.logit_bias
                b_rows.extend([i] * len(cols))
                b_cols.extend(cols)
                b_vals.extend(vals)
        if b_rows:
            work.index_put_((_index(b_rows, device), _index(b_cols, device)),
                            torch.tensor(b_vals, dtype=torch.float32, device=device), accumulate=True)
        # allowed_token_ids: everything else -> -inf.
        a_idx = [i for i, p in enumerate(plans) if p.allowed_token_ids is not None]
        if a_idx:
            keep = torch.zeros(len(a_idx), work.shape[1], dtype=torch.bool, device=device)
            k_rows = [j for j, i in enumerate(a_idx) for _ in plans[i].allowed_token_ids]
            k_cols = [t for i in a_idx for t in plans[i].allowed_token_ids]
            keep[_index(k_rows, device), _index(k_cols, device)] = True
            a_t = _index(a_idx, device)
            work[a_t] = work[a_t].masked_fill_(~keep, float("-inf"))
        # min_tokens: mask EOS / stop tokens while too few outputs.
        m_rows: list[int] = []
        m_cols: list[int] = []
        for i, p in enumerate(plans):
            if p.min_tokens and len(rows[i].output_token_ids) < p.min_tokens:
                stops = rows[i].stop_token_ids_for_min_tokens
                m_rows.extend([i] * len(stops))
                m_cols.extend(stops)
        if m_rows:
            work[_index(m_rows, device), _index(m_cols, device)] = float("-inf")

    @staticmethod
    def _apply_processors(work: torch.Tensor, rows: list[RowSamplingState], plans: list[_RowPlan]) -> None:
        for i, p in enumerate(plans):
            row = rows[i]
            for fn, arity in p.processors:
                view = work[i]
                if arity == 2:
                    new = fn(row.output_token_ids, view)
                else:
                    new = fn(row.prompt_token_ids, row.output_token_ids, view)
                if not isinstance(new, torch.Tensor) or new.shape != view.shape:
                    raise ValueError(f"logits_processors: {fn!r} must return a logits row of shape "
                                     f"{tuple(view.shape)}, got {type(new).__name__}")
                if new.data_ptr() != view.data_ptr():
                    view.copy_(new)

    @staticmethod
    def _apply_penalties(work: torch.Tensor, rows: list[RowSamplingState], plans: list[_RowPlan]) -> None:
        idx = [i for i, p in enumerate(plans) if p.needs_penalties]
        if not idx:
            return
        device, vocab = work.device, work.shape[1]
        n = len(idx)
        sub = work if n == len(plans) else work[_index(idx, device)]

        # Output token counts [n, V] from one flat scatter.
        out_lists = [rows[i].output_token_ids for i in idx]
        out_lens = [len(o) for o in out_lists]
        counts = torch.zeros(n, vocab, dtype=torch.float32, device=device)
        if sum(out_lens):
            flat = torch.tensor([t for o in out_lists for t in o], dtype=torch.int64, device=device)
            row_of = torch.repeat_interleave(torch.arange(n, device=device),
                                             torch.tensor(out_lens, device=device))
            counts.index_put_((row_of, flat), torch.ones_like(flat, dtype=torch.float32), accumulate=True)
        occurred = counts > 0

        rep = [plans[i].repetition_penalty for i in idx]
        if any(r != 1.0 for r in rep):
            rep_rows = [j for j, r in enumerate(rep) if r != 1.0]
            seen = occurred.clone()
            prompts = [rows[idx[j]].prompt_ids_tensor(device) for j in rep_rows]
            lens = [p.numel() for p in prompts]
            if sum(lens):
                row_of = torch.repeat_interleave(_index(rep_rows, device), torch.tensor(lens, device=device))
                seen[row_of, torch.cat(prompts)] = True
            r = torch.tensor(rep, dtype=torch.float32, device=device).unsqueeze(1)
            penalized = torch.where(sub > 0, sub / r, sub * r)
            sub = torch.where(seen, penalized, sub)

        freq = [plans[i].frequency_penalty for i in idx]
        if any(f != 0.0 for f in freq):
            sub = sub - torch.tensor(freq, dtype=torch.float32, device=device).unsqueeze(1) * counts
        pres = [plans[i].presence_penalty for i in idx]
        if any(p != 0.0 for p in pres):
            sub = sub - torch.tensor(pres, dtype=torch.float32, device=device).unsqueeze(1) * occurred

        if n == len(plans):
            work.copy_(sub)
        else:
            work[_index(idx, device)] = sub

    def _apply_top_k_top_p(self, logits: torch.Tensor, plans: list[_RowPlan]) -> None:
        """In place on `logits` (the random rows, temperature applied)."""
        p_idx = [j for j, p in enumerate(plans) if p.top_p < 1.0]
        k_only = [j for j, p in enumerate(plans) if p.top_k and p.top_p >= 1.0]
        device = logits.device
        if k_only:
            sub = logits if len(k_only) == len(plans) else logits[_index(k_only, device)]
            ks = [plans[j].top_k for j in k_only]
            top = sub.topk(max(ks), dim=-1).values
            kth = top.gather(1, torch.tensor(ks, device=device).sub_(1).unsqueeze(1))
            sub.masked_fill_(sub < kth, float("-inf"))
            if sub is not logits:
                logits[_index(k_only, device)] = sub
        if p_idx:
            sub = logits if len(p_idx) == len(plans) else logits[_index(p_idx, device)]
            ks = [plans[j].top_k or logits.shape[1] for j in p_idx]
            ps = [plans[j].top_p for j in p_idx]
            masked = self._top_p(sub, ks, ps)
            if sub is logits:
                logits.copy_(masked)
            else:
                logits[_index(p_idx, device)] = masked

    def _top_p(self, logits: torch.Tensor, ks: list[int], ps: list[float]) -> torch.Tensor:
        """Top-k (per row, `k = V` for off) then top-p over the renormalized rest; returns the masked rows."""
        n, vocab = logits.shape
        device = logits.device
        m = self.top_p_candidates
        if device.type == "cpu" and 0 < m < vocab // 2 and all(k >= vocab or k <= m for k in ks):
            done = _top_p_candidates(logits, ks, ps, m)
            if done is not None:
                return done
        return _top_p_sorted(logits, torch.tensor(ks, device=device), torch.tensor(ps, device=device))

    def _exponential_noise(self, shape: torch.Size, rows: list[RowSamplingState],
                           device: torch.device) -> torch.Tensor:
        noise = torch.empty(shape, dtype=torch.float32, device=device)
        seeded = [j for j, r in enumerate(rows) if r.generator is not None]
        if not seeded:
            noise.exponential_(generator=self.generator)
        else:
            for j in seeded:
                noise[j].exponential_(generator=rows[j].generator)
            unseeded = [j for j, r in enumerate(rows) if r.generator is None]
            if unseeded:
                block = torch.empty(len(unseeded), shape[1], dtype=torch.float32, device=device)
                noise[_index(unseeded, device)] = block.exponential_(generator=self.generator)
        return noise


# -- free functions -------------------------------------------------------------------------------
def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _sample_with_noise(logits: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """argmax(probs / noise) per row; `probs` need not be normalized, so `exp(logits - max)` will do."""
    probs = (logits - logits.amax(dim=-1, keepdim=True)).exp_()
    # An Exp(1) draw of exactly 0 would turn a masked token's 0/0 into NaN (which argmax prefers).
    noise.clamp_min_(torch.finfo(torch.float32).tiny)
    return probs.div_(noise).argmax(dim=-1)


def _apply_min_p(logits: torch.Tensor, plans: list[_RowPlan]) -> None:
    """Drop tokens whose probability is below `min_p * max_prob`, i.e. `logit < max_logit + log(min_p)`."""
    idx = [j for j, p in enumerate(plans) if p.min_p > 0.0]
    if not idx:
        return
    device = logits.device
    sub = logits if len(idx) == len(plans) else logits[_index(idx, device)]
    log_min_p = torch.tensor([plans[j].min_p for j in idx], dtype=torch.float32, device=device).log_()
    threshold = sub.amax(dim=-1) + log_min_p
    sub.masked_fill_(sub < threshold.unsqueeze(1), float("-inf"))
    if sub is not logits:
        logits[_index(idx, device)] = sub


def _top_p_sorted(logits: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    positions = torch.arange(vocab, device=logits.device)
    sorted_logits.masked_fill_(positions.unsqueeze(0) < (vocab - ks).unsqueeze(1), float("-inf"))
    cum = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
    drop = cum <= (1.0 - ps).unsqueeze(1)
    drop[:, -1] = False  # always keep the most likely token
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _top_p_candidates(logits: torch.Tensor, ks: list[int], ps: list[float], m: int) -> torch.Tensor | None:
    """Top-k/top-p among the `m` most likely tokens; None if some row's nucleus may reach beyond them."""
    n, vocab = logits.shape
    device = logits.device
    vals, _ = logits.topk(m, dim=-1)  # descending
    k_t = torch.tensor(ks, device=device)
    p_t = torch.tensor(ps, dtype=torch.float32, device=device)
    positions = torch.arange(m, device=device)
    vals = vals.masked_fill(positions.unsqueeze(0) >= k_t.unsqueeze(1), float("-inf"))
    # Normalizer: over the whole row without top-k, over the top-k (all among the candidates) with it.
    log_z = torch.where(k_t >= vocab, torch.logsumexp(logits, dim=-1), torch.logsumexp(vals, dim=-1))
    probs = (vals - log_z.unsqueeze(1)).exp_()
    cum = probs.cumsum(dim=-1)
    if not bool((cum[:, -1] >= p_t).all()):
        return None
    # Keep a candidate while the mass before it is < p (the smallest set reaching p).
    exclusive = cum - probs
    keep = exclusive < p_t.unsqueeze(1)
    keep[:, 0] = True
    num_keep = keep.sum(dim=-1, keepdim=True)
    cutoff = vals.gather(1, num_keep - 1)
    return logits.masked_fill(logits < cutoff, float("-inf"))


def _gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                     num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row: the given token then the top `num_top`: (ids [n, 1+k], logprobs [n, 1+k], ranks [n, 1+k]).

    rank = 1 + the number of tokens with a strictly greater logprob."""
    token_ids = token_ids.to(torch.int64).unsqueeze(1)
    chosen = logprobs.gather(1, token_ids)
    chosen_rank = (logprobs > chosen).sum(dim=-1, keepdim=True) + 1
    if num_top <= 0:
        return token_ids, chosen, chosen_rank
    top_vals, top_ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)
    # Everything greater than a top value sits before it in the (descending) top list.
    top_ranks = (top_vals.unsqueeze(1) > top_vals.unsqueeze(2)).sum(dim=-1) + 1
    return (torch.cat([token_ids, top_ids], dim=1), torch.cat([chosen, top_vals], dim=1),
            torch.cat([chosen_rank, top_ranks], dim=1))


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor,
                            num_top: int) -> list[TokenLogprobs]:
    """One entry per row of `logits [n, V]`: logprob and rank of `target_token_ids[i]` (the next prompt
    token), then the top `num_top`, all from `log_softmax(logits)` in float32."""
    if logits.dim() != 2 or target_token_ids.shape != (logits.shape[0],):
        raise ValueError(f"target_token_ids: expected shape [{logits.shape[0]}] for logits "
                         f"{tuple(logits.shape)}, got {tuple(target_token_ids.shape)}")
    if num_top < 0:
        raise ValueError(f"prompt_logprobs: must be non-negative, got {num_top}")
    if logits.shape[0] == 0:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids, vals, ranks = _gather_logprobs(logprobs, target_token_ids.to(logits.device), num_top)
    ids_l, vals_l, ranks_l = ids.tolist(), vals.tolist(), ranks.tolist()
    return [TokenLogprobs(token_ids=i, logprobs=v, ranks=r) for i, v, r in zip(ids_l, vals_l, ranks_l)]
