"""Batched sampling on tensors: one call per step over the rows that sample.

Per row, in order (each step touches only the rows that need it): logit_bias -> allowed_token_ids ->
min_tokens stop masking -> logits processors -> repetition penalty -> presence / frequency penalties
-> temperature (0 = greedy argmax) -> top_k -> top_p -> min_p -> draw.

Rows filtered by top-k / top-p draw among a candidate set sorted by logit (a partial selection, not a
sort, whenever it provably holds the nucleus); the others draw over the whole vocabulary. The draw is
`argmax(probs / E)`, `E ~ Exp(1)` (no sort, no sync) on accelerators, and an inverse-CDF lookup with one
uniform per row on CPU, where a vocabulary-sized noise tensor costs more than the rest of the step.
A seeded row takes its randomness only from its own generator, in amounts that do not depend on the
batch, so the same seed gives the same tokens whatever else is sampled alongside.

Logprobs are those of the raw model distribution (`log_softmax` of the logits as given), computed only
when a row asks for them. The host sees the results once, in the final `.tolist()` (the CPU-only
top-p shortcut also syncs, which is free there).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from aserve.core.batch import TokenLogprobs
from aserve.sampling_params import SamplingParams

# Top-p (on CPU) looks for the nucleus among the 64, then this many most likely tokens before sorting.
_TOP_P_CANDIDATES = 1024
_CHUNK = 64  # two-level argmax / top-k work on chunks of this many logits
_NEG_INF = float("-inf")


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request."""
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
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    allowed_ids: torch.Tensor | None
    min_tokens: int
    processors: list[tuple[Callable[..., Any], int]]  # (callable, number of positional args: 2 or 3)
    num_logprobs: int | None

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def modifies_logits(self) -> bool:
        return bool(self.needs_penalties or self.bias_ids is not None or self.allowed_ids is not None
                    or self.min_tokens > 0 or self.processors)


def _processor_arity(fn: Callable[..., Any]) -> int:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise ValueError(f"logits_processors: cannot inspect the signature of {fn!r}") from e
    positional = [p for p in sig.parameters.values()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in sig.parameters.values()):
        return 3
    required = [p for p in positional if p.default is inspect.Parameter.empty]
    for n in (len(required), len(positional)):
        if n in (2, 3):
            return n
    raise ValueError(f"logits_processors: {fn!r} must take (output_token_ids, logits) or "
                     f"(prompt_token_ids, output_token_ids, logits), it takes {len(positional)} arguments")


def _make_plan(params: SamplingParams, vocab_size: int, device: torch.device) -> _RowPlan:
    greedy = params.sampling_type_greedy
    bias_ids = bias_values = allowed = None
    if params.logit_bias:
        bias_ids = torch.tensor(list(params.logit_bias.keys()), dtype=torch.int64, device=device)
        bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
    if params.allowed_token_ids is not None:
        allowed = torch.tensor(params.allowed_token_ids, dtype=torch.int64, device=device)
    for name, ids in (("logit_bias", bias_ids), ("allowed_token_ids", allowed)):
        if ids is not None and ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < vocab_size):
            raise ValueError(f"{name}: token ids must be in [0, {vocab_size})")
    return _RowPlan(
        greedy=greedy,
        temperature=1.0 if greedy else float(params.temperature),
        top_k=params.top_k if not greedy and 0 < params.top_k < vocab_size else 0,
        top_p=1.0 if greedy else float(params.top_p),
        min_p=0.0 if greedy else float(params.min_p),
        repetition_penalty=float(params.repetition_penalty),
        presence_penalty=float(params.presence_penalty),
        frequency_penalty=float(params.frequency_penalty),
        bias_ids=bias_ids,
        bias_values=bias_values,
        allowed_ids=allowed,
        min_tokens=params.min_tokens,
        processors=[(f, _processor_arity(f)) for f in params.logits_processors or ()],
        num_logprobs=params.logprobs,
    )


@dataclass
class RowSamplingState:
    """One request as the sampler sees it; built once and kept by the runner for the request's life.

    `output_token_ids` is the runner's own list: it appends each sampled token to this same object.
    `generator` must be set (`make_generator(params.seed, device)`) when `params.seed` is set.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    stop_token_ids_for_min_tokens: list[int]
    # Derived lazily by the sampler and kept across steps.
    _plan: _RowPlan | None = field(default=None, init=False, repr=False, compare=False)
    _prompt_ids: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _output_buf: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _num_buffered: int = field(default=0, init=False, repr=False, compare=False)

    def plan(self, vocab_size: int, device: torch.device) -> _RowPlan:
        if self._plan is None:
            if self.params.seed is not None and self.generator is None and not self.params.sampling_type_greedy:
                raise ValueError("generator: a request with a seed needs its own generator (make_generator)")
            self._plan = _make_plan(self.params, vocab_size, device)
        return self._plan

    def prompt_ids(self, device: torch.device) -> torch.Tensor:
        if self._prompt_ids is None:
            self._prompt_ids = torch.tensor(self.prompt_token_ids, dtype=torch.int64, device=device)
        return self._prompt_ids

    def output_ids(self, device: torch.device) -> torch.Tensor:
        """The output token ids as a tensor, extended incrementally from `output_token_ids`."""
        n = len(self.output_token_ids)
        buf = self._output_buf
        if buf is None or n < self._num_buffered:
            buf, self._num_buffered = torch.empty(max(16, 2 * n), dtype=torch.int64, device=device), 0
        if n > buf.numel():
            grown = torch.empty(2 * n, dtype=torch.int64, device=device)
            grown[:self._num_buffered] = buf[:self._num_buffered]
            buf = grown
        if n > self._num_buffered:
            buf[self._num_buffered:n] = torch.tensor(self.output_token_ids[self._num_buffered:n], dtype=torch.int64)
            self._num_buffered = n
        self._output_buf = buf
        return buf[:n]


@dataclass
class SamplerResult:
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # None where the row did not ask for logprobs


class Sampler:
    """Samples one token per row from `logits [B, V]`; see the module docstring."""

    def __init__(self, vocab_size: int, device: torch.device | str, seed: int = 0):
        if vocab_size <= 0:
            raise ValueError(f"vocab_size: must be positive, got {vocab_size}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.generator = make_generator(seed, self.device)  # shared by the unseeded rows
        # Largest candidate set tried before a full sort (top-p on CPU; top-k up to this k uses topk).
        self.top_p_candidates = _TOP_P_CANDIDATES
        # The noise draw needs no sort and no sync (accelerators); on CPU one uniform per row is far cheaper.
        self.use_exponential_noise = self.device.type != "cpu"

    def sample(self, logits: torch.Tensor, rows: list[RowSamplingState]) -> SamplerResult:
        """One token per row. `logits` is `[len(rows), vocab_size]`, any float dtype; it is not modified."""
        if logits.dim() != 2 or logits.shape[0] != len(rows) or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits: expected shape [{len(rows)}, {self.vocab_size}], got {tuple(logits.shape)}")
        num_rows, vocab = len(rows), self.vocab_size
        if num_rows == 0:
            return SamplerResult([], [])
        plans = [r.plan(vocab, logits.device) for r in rows]
        lp_rows = [i for i, p in enumerate(plans) if p.num_logprobs is not None]
        raw_logprobs = None
        if lp_rows:
            raw = logits if len(lp_rows) == num_rows else logits[_index(lp_rows, logits.device)]
            raw_logprobs = torch.log_softmax(raw.float(), dim=-1)

        if all(p.greedy and not p.modifies_logits for p in plans):
            sampled = _argmax(logits)
        else:
            sampled = self._sample_general(logits, rows, plans)

        if raw_logprobs is None:
            return SamplerResult(sampled.tolist(), [None] * num_rows)
        return self._with_logprobs(sampled, raw_logprobs, lp_rows, plans)

    # -- the general path ------------------------------------------------------------------------
    def _sample_general(self, logits: torch.Tensor, rows: list[RowSamplingState],
                        plans: list[_RowPlan]) -> torch.Tensor:
        device = logits.device
        work = logits.to(torch.float32, copy=True)
        if any(p.modifies_logits for p in plans):
            _apply_bias_and_masks(work, rows, plans)
            _apply_processors(work, rows, plans)
            _apply_penalties(work, rows, plans)
        random_rows = [i for i, p in enumerate(plans) if not p.greedy]
        if not random_rows:
            return _argmax(work)
        everything = len(random_rows) == len(plans)
        rand = work if everything else work[_index(random_rows, device)]
        rplans = [plans[i] for i in random_rows]
        temps = [p.temperature for p in rplans]
        if any(t != 1.0 for t in temps):
            rand.div_(torch.tensor(temps, dtype=torch.float32, device=device).unsqueeze(1))
        rand_tokens = self._sample_random(rand, [rows[i] for i in random_rows], rplans)
        if everything:
            return rand_tokens
        greedy_rows = _index([i for i, p in enumerate(plans) if p.greedy], device)
        tokens = torch.empty(len(plans), dtype=torch.int64, device=device)
        tokens[greedy_rows] = _argmax(work[greedy_rows])
        tokens[_index(random_rows, device)] = rand_tokens
        return tokens

    def _sample_random(self, logits: torch.Tensor, rows: list[RowSamplingState],
                       plans: list[_RowPlan]) -> torch.Tensor:
        """Rows with temperature > 0 (already applied): top-k / top-p / min-p, then the draw."""
        n, vocab = logits.shape
        device = logits.device
        cap = min(self.top_p_candidates, vocab)
        plain, by_topk, by_top_p, by_sort = [], [], [], []
        for j, p in enumerate(plans):
            if p.top_k:
                (by_topk if p.top_k <= cap else by_sort).append(j)
            else:
                (by_top_p if p.top_p < 1.0 else plain).append(j)
        tokens = torch.empty(n, dtype=torch.int64, device=device)
        if plain:
            sub = logits if len(plain) == n else logits[_index(plain, device)]
            _put(tokens, plain, self._draw(sub, [rows[j] for j in plain], [plans[j].min_p for j in plain]))
        if by_topk:
            sub = logits if len(by_topk) == n else logits[_index(by_topk, device)]
            ks = [plans[j].top_k for j in by_topk]
            vals, ids = _topk(sub, max(ks))
            _put(tokens, by_topk, self._draw_candidates(vals, ids, ks, None, by_topk, rows, plans))
        if by_top_p:
            if device.type == "cpu" and 2 * cap <= vocab:
                by_sort += self._top_p_by_candidates(logits, tokens, by_top_p, rows, plans, cap)
            else:
                by_sort += by_top_p
        if by_sort:
            by_sort.sort()
            sub = logits if len(by_sort) == n else logits[_index(by_sort, device)]
            vals, ids = sub.sort(dim=-1, descending=True)
            ks = [plans[j].top_k or vocab for j in by_sort]
            _put(tokens, by_sort, self._draw_candidates(vals, ids, ks, None, by_sort, rows, plans))
        return tokens

    def _top_p_by_candidates(self, logits: torch.Tensor, tokens: torch.Tensor, group: list[int],
                             rows: list[RowSamplingState], plans: list[_RowPlan], cap: int) -> list[int]:
        """Top-p rows whose nucleus lies among the 64 (then `cap`) most likely tokens are drawn there;
        returns the rows left for the full sort. Exact: the candidates' mass is checked against top_p."""
        device = logits.device
        sub = logits if len(group) == logits.shape[0] else logits[_index(group, device)]
        log_z = torch.logsumexp(sub, dim=-1)
        ps = torch.tensor([plans[j].top_p for j in group], dtype=torch.float32, device=device)
        left = list(range(len(group)))  # positions in `group`
        for k in sorted({min(64, cap), cap}):
            sel = None if len(left) == len(group) else _index(left, device)
            part, z, p = (sub, log_z, ps) if sel is None else (sub[sel], log_z[sel], ps[sel])
            vals, ids = _topk(part, k)
            fits = ((vals - z.unsqueeze(1)).exp_().sum(dim=-1) >= p).tolist()
            ok = [i for i, f in enumerate(fits) if f]
            if ok:
                keep = None if len(ok) == len(left) else _index(ok, device)
                if keep is not None:
                    vals, ids, z = vals[keep], ids[keep], z[keep]
                members = [group[left[i]] for i in ok]
                _put(tokens, members, self._draw_candidates(vals, ids, None, z, members, rows, plans))
            left = [left[i] for i, f in enumerate(fits) if not f]
            if not left:
                break
        return [group[i] for i in left]

    def _draw_candidates(self, vals: torch.Tensor, ids: torch.Tensor, ks: list[int] | None,
                         log_z: torch.Tensor | None, group: list[int], rows: list[RowSamplingState],
                         plans: list[_RowPlan]) -> torch.Tensor:
        """Draws among candidates sorted by descending logit (`ids` their token ids). `ks`: each row keeps
        its first k; `log_z`: each row's normalizer over the whole vocabulary (None: over the kept)."""
        device = vals.device
        width = vals.shape[1]
        gplans = [plans[j] for j in group]
        widths = None
        if ks is not None and any(k < width for k in ks):
            beyond = torch.arange(width, device=device).unsqueeze(0) >= torch.tensor(ks, device=device).unsqueeze(1)
            vals.masked_fill_(beyond, _NEG_INF)
            widths = ks
        ps = [p.top_p for p in gplans]
        if any(p < 1.0 for p in ps):
            if log_z is None:
                log_z = torch.logsumexp(vals, dim=-1)
            probs = (vals - log_z.unsqueeze(1)).exp_()
            mass_before = probs.cumsum(dim=-1).sub_(probs)
            # The smallest prefix whose mass reaches top_p; position 0 always stays (0 < top_p).
            vals.masked_fill_(mass_before >= torch.tensor(ps, device=device).unsqueeze(1), _NEG_INF)
        picked = self._draw(vals, [rows[j] for j in group], [p.min_p for p in gplans], widths)
        return ids.gather(1, picked.unsqueeze(1)).squeeze(1)

    def _draw(self, logits: torch.Tensor, rows: list[RowSamplingState], min_ps: list[float],
              widths: list[int] | None = None) -> torch.Tensor:
        """One index per row from `softmax(logits)` after min-p; `-inf` entries are never drawn.
        Overwrites `logits`.

        Seeded rows consume their own generator by amounts independent of the batch (`widths[j]`: the
        leading columns row j really uses)."""
        num, width = logits.shape
        device = logits.device
        # Unnormalized probabilities in [0, 1]; the most likely token has weight 1, so min-p is a threshold
        # (`threshold_` keeps weights strictly above it: stay just below 1 so the top token survives).
        weights = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
        for value in set(min_ps):
            if value > 0.0:
                level = min(value, 1.0 - 1e-6)
                if all(m == value for m in min_ps):
                    F.threshold_(weights, level, 0.0)
                else:
                    for j, m in enumerate(min_ps):
                        if m == value:
                            F.threshold_(weights[j], level, 0.0)
        seeded = [j for j, r in enumerate(rows) if r.generator is not None]
        unseeded = [j for j, r in enumerate(rows) if r.generator is None]
        if self.use_exponential_noise:
            # argmax(p / E) with E ~ Exp(1) picks index i with probability p_i.
            noise = torch.empty(num, width, dtype=torch.float32, device=device)
            if len(unseeded) == num:
                noise.exponential_(generator=self.generator)
            elif unseeded:
                block = torch.empty(len(unseeded), width, dtype=torch.float32, device=device)
                noise[_index(unseeded, device)] = block.exponential_(generator=self.generator)
            for j in seeded:
                w = width if widths is None else widths[j]
                noise[j, :w].exponential_(generator=rows[j].generator)
                noise[j, w:] = 1.0
            # An Exp(1) draw of exactly 0 would turn a masked entry's 0/0 into NaN, which argmax prefers.
            noise.clamp_min_(torch.finfo(torch.float32).tiny)
            return _argmax(weights.div_(noise))
        u = torch.empty(num, dtype=torch.float32, device=device)
        if len(unseeded) == num:
            u.uniform_(generator=self.generator)
        elif unseeded:
            u[_index(unseeded, device)] = torch.rand(len(unseeded), generator=self.generator, device=device)
        for j in seeded:
            u[j] = torch.rand(1, generator=rows[j].generator, device=device)[0]
        cdf = weights.cumsum_(dim=-1)
        target = (u * cdf[:, -1]).unsqueeze(1)
        # The first index whose cumulative weight exceeds the target: zero-weight entries never qualify.
        return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max_(width - 1)

    # -- logprobs --------------------------------------------------------------------------------
    @staticmethod
    def _with_logprobs(sampled: torch.Tensor, raw_logprobs: torch.Tensor, lp_rows: list[int],
                       plans: list[_RowPlan]) -> SamplerResult:
        num_rows, vocab = len(plans), raw_logprobs.shape[1]
        lp_sampled = sampled if len(lp_rows) == num_rows else sampled[_index(lp_rows, sampled.device)]
        max_top = min(max(plans[i].num_logprobs for i in lp_rows), vocab)
        ids, vals, ranks = _gather_logprobs(raw_logprobs, lp_sampled, max_top)
        ints = torch.cat([sampled, ids.flatten(), ranks.flatten()]).tolist()  # one transfer for the ints
        floats = vals.flatten().tolist()
        width = 1 + max_top
        ids_list = ints[num_rows:num_rows + len(lp_rows) * width]
        ranks_list = ints[num_rows + len(lp_rows) * width:]
        out: list[TokenLogprobs | None] = [None] * num_rows
        for j, i in enumerate(lp_rows):
            s, n = j * width, 1 + min(plans[i].num_logprobs, vocab)
            out[i] = TokenLogprobs(token_ids=ids_list[s:s + n], logprobs=floats[s:s + n],
                                   ranks=ranks_list[s:s + n])
        return SamplerResult(ints[:num_rows], out)


# -- logits transforms (in place on float32 `work [B, V]`) --------------------------------------------
def _apply_bias_and_masks(work: torch.Tensor, rows: list[RowSamplingState], plans: list[_RowPlan]) -> None:
    device, vocab = work.device, work.shape[1]
    flat = work.view(-1)
    biased = [i for i, p in enumerate(plans) if p.bias_ids is not None]
    if biased:
        keys = torch.cat([plans[i].bias_ids + i * vocab for i in biased])
        flat.index_put_((keys,), torch.cat([plans[i].bias_values for i in biased]), accumulate=True)
    allowed = [i for i, p in enumerate(plans) if p.allowed_ids is not None]
    if allowed:
        keys = torch.cat([plans[i].allowed_ids + i * vocab for i in allowed])
        kept = flat[keys]
        work.index_fill_(0, _index(allowed, device), _NEG_INF)
        flat[keys] = kept
    keys_list = [i * vocab + t for i, p in enumerate(plans)
                 if p.min_tokens and len(rows[i].output_token_ids) < p.min_tokens
                 for t in rows[i].stop_token_ids_for_min_tokens]
    if keys_list:
        flat[_index(keys_list, device)] = _NEG_INF


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
                raise ValueError(f"logits_processors: {fn!r} must return the logits row (a tensor of shape "
                                 f"{tuple(view.shape)}), got {type(new).__name__}")
            if new.data_ptr() != view.data_ptr():
                view.copy_(new)


def _apply_penalties(work: torch.Tensor, rows: list[RowSamplingState], plans: list[_RowPlan]) -> None:
    """Touches only the tokens that occurred: flat gathers/scatters, no pass over the vocabulary."""
    idx = [i for i, p in enumerate(plans) if p.needs_penalties]
    if not idx:
        return
    device, vocab = work.device, work.shape[1]
    flat = work.view(-1)
    rep = [i for i in idx if plans[i].repetition_penalty != 1.0]
    if rep:
        # Once per distinct token of prompt + output: positive logits divided, negative multiplied.
        parts = [t for i in rep for t in (rows[i].prompt_ids(device) + i * vocab,
                                          rows[i].output_ids(device) + i * vocab)]
        keys = torch.unique(torch.cat(parts))
        if keys.numel():
            factors = torch.tensor([p.repetition_penalty for p in plans], dtype=torch.float32,
                                   device=device)[keys // vocab]
            vals = flat[keys]
            flat[keys] = torch.where(vals > 0, vals / factors, vals * factors)
    other = [i for i in idx if plans[i].presence_penalty != 0.0 or plans[i].frequency_penalty != 0.0]
    if other:
        outs = [rows[i].output_ids(device) for i in other]
        keys = torch.cat([o + i * vocab for i, o in zip(other, outs)])
        if keys.numel():
            row_of = keys // vocab
            freq = torch.tensor([p.frequency_penalty for p in plans], dtype=torch.float32, device=device)
            pres = torch.tensor([p.presence_penalty for p in plans], dtype=torch.float32, device=device)
            _, inverse, counts = torch.unique(keys, return_inverse=True, return_counts=True)
            # Summed over a token's occurrences: -frequency * count - presence.
            delta = -(freq[row_of] + pres[row_of] / counts[inverse].to(torch.float32))
            flat.index_add_(0, keys, delta)


# -- helpers --------------------------------------------------------------------------------------
def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _put(tokens: torch.Tensor, where: list[int], values: torch.Tensor) -> None:
    if len(where) == tokens.shape[0]:
        tokens.copy_(values)
    else:
        tokens[_index(where, tokens.device)] = values


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` (first maximum) for `[B, V]`; two-level on CPU, where argmax is slow."""
    num, vocab = x.shape
    if x.device.type != "cpu" or vocab % _CHUNK or vocab < 4 * _CHUNK:
        return x.argmax(dim=-1)
    chunks = x.view(num, vocab // _CHUNK, _CHUNK)
    best_chunk = chunks.amax(dim=-1).argmax(dim=-1)
    inside = chunks[torch.arange(num, device=x.device), best_chunk].argmax(dim=-1)
    return best_chunk * _CHUNK + inside


def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.topk(k, dim=-1)` (values descending, ids). For small k on CPU it selects among the k chunks
    with the largest maxima: every top-k element lies in one of them."""
    num, vocab = x.shape
    if x.device.type != "cpu" or vocab % _CHUNK or k * _CHUNK * 4 > vocab:
        return x.topk(k, dim=-1)
    chunks = x.view(num, vocab // _CHUNK, _CHUNK)
    chunk_ids = chunks.amax(dim=-1).topk(k, dim=-1).indices  # [num, k]
    picked = chunks.gather(1, chunk_ids.unsqueeze(2).expand(num, k, _CHUNK)).view(num, k * _CHUNK)
    vals, pos = picked.topk(k, dim=-1)
    ids = chunk_ids.gather(1, pos // _CHUNK) * _CHUNK + pos % _CHUNK
    return vals, ids


def _gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
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


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor,
                            num_top: int) -> list[TokenLogprobs]:
    """One entry per row of `logits [n, V]`: logprob and rank of `target_token_ids[i]` (the next prompt
    token), then the top `num_top`; all from `log_softmax(logits)` in float32."""
    if logits.dim() != 2 or tuple(target_token_ids.shape) != (logits.shape[0],):
        raise ValueError(f"target_token_ids: expected shape [{logits.shape[0] if logits.dim() else '?'}] "
                         f"for logits {tuple(logits.shape)}, got {tuple(target_token_ids.shape)}")
    if num_top < 0:
        raise ValueError(f"prompt_logprobs: must be non-negative, got {num_top}")
    if logits.shape[0] == 0:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids, vals, ranks = _gather_logprobs(logprobs, target_token_ids.to(logits.device),
                                        min(num_top, logits.shape[1]))
    return [TokenLogprobs(token_ids=i, logprobs=v, ranks=r)
            for i, v, r in zip(ids.tolist(), vals.tolist(), ranks.tolist())]
