"""Selection ops for top-k / top-p and greedy, with the CPU shortcuts kept in one place.

On CPU a full `argmax` / `topk` / `sort` over a large vocabulary costs more than the rest of the
sampler, so: argmax and small-k topk work on chunks of `CHUNK` logits (two levels, exact), and a
top-p row first looks for its nucleus among the few most likely tokens (`nucleus_fits`), falling
back to the full sort only when those do not hold `top_p` of the mass. Elsewhere the torch op runs.
"""

from __future__ import annotations

import torch

CHUNK = 64  # two-level argmax / top-k work on chunks of this many logits
_NEG_INF = float("-inf")


def argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` (first maximum) for `[B, V]`; two-level on CPU, where argmax is slow."""
    num, vocab = x.shape
    if x.device.type != "cpu" or vocab % CHUNK or vocab < 4 * CHUNK:
        return x.argmax(dim=-1)
    chunks = x.view(num, vocab // CHUNK, CHUNK)
    best_chunk = chunks.amax(dim=-1).argmax(dim=-1)
    inside = chunks[torch.arange(num, device=x.device), best_chunk].argmax(dim=-1)
    return best_chunk * CHUNK + inside


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x.topk(k, dim=-1)` (values descending, ids). For small k on CPU it selects among the k chunks
    with the largest maxima: every top-k element lies in one of them."""
    num, vocab = x.shape
    if x.device.type != "cpu" or vocab % CHUNK or k * CHUNK * 4 > vocab:
        return x.topk(k, dim=-1)
    chunks = x.view(num, vocab // CHUNK, CHUNK)
    chunk_ids = chunks.amax(dim=-1).topk(k, dim=-1).indices  # [num, k]
    picked = chunks.gather(1, chunk_ids.unsqueeze(2).expand(num, k, CHUNK)).view(num, k * CHUNK)
    vals, pos = picked.topk(k, dim=-1)
    ids = chunk_ids.gather(1, pos // CHUNK) * CHUNK + pos % CHUNK
    return vals, ids


def nucleus_fits(logits: torch.Tensor, log_z: torch.Tensor, top_p: torch.Tensor,
                 k: int) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
    """The `k` most likely tokens per row (values, ids) and, per row, whether they hold at least
    `top_p` of the whole distribution (`log_z`: each row's log normalizer). Syncs (CPU only)."""
    vals, ids = topk(logits, k)
    fits = ((vals - log_z.unsqueeze(1)).exp_().sum(dim=-1) >= top_p).tolist()
    return vals, ids, fits


def mask_candidates(vals: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                    log_z: torch.Tensor | None) -> None:
    """On candidates sorted by descending logit `vals [n, W]`, in place: set to -inf every position at
    or beyond the row's `top_k`, then every position after the smallest prefix whose probability mass
    reaches `top_p` (position 0 always stays). `log_z`: each row's normalizer over the whole
    vocabulary (None: over the candidates left by top-k)."""
    if top_k is not None:
        beyond = torch.arange(vals.shape[1], device=vals.device).unsqueeze(0) >= top_k.unsqueeze(1)
        vals.masked_fill_(beyond, _NEG_INF)
    if top_p is not None:
        if log_z is None:
            log_z = torch.logsumexp(vals, dim=-1)
        probs = (vals - log_z.unsqueeze(1)).exp_()
        mass_before = probs.cumsum(dim=-1).sub_(probs)
        vals.masked_fill_(mass_before >= top_p.unsqueeze(1), _NEG_INF)
