"""The draw: one index per row from `softmax(logits)` after min-p, with two algorithms.

* `exponential noise` (accelerators): `argmax(p / E)`, `E ~ Exp(1)`, picks index i with probability
  p_i; no sort, no sync, but a noise value per logit.
* `inverse CDF` (CPU): one uniform per row and a `searchsorted` over the cumulative weights, far
  cheaper on CPU than a vocabulary-sized noise tensor.

A seeded row takes its randomness only from its own generator, in amounts independent of the batch
(`widths[j]`: the leading columns row j really uses), so a seed gives the same tokens whatever else
is sampled alongside; the other rows share the sampler's generator.
"""

from __future__ import annotations

import torch

from aserve.runner.sampling.state import index_tensor
from aserve.runner.sampling.topk_topp import argmax


def draw(logits: torch.Tensor, generators: list[torch.Generator | None], shared: torch.Generator,
         min_p: torch.Tensor | None, use_exponential_noise: bool,
         widths: list[int] | None = None) -> torch.Tensor:
    """One index per row of `logits [n, W]` (overwritten); `-inf` entries are never drawn. `min_p [n]`
    (None: no row uses it) drops tokens below `min_p` times the most likely one's probability."""
    # Unnormalized probabilities in [0, 1]; the most likely token has weight 1, so min-p is a threshold
    # (weights at or below it are dropped: stay just below 1 so the top token survives).
    weights = logits.sub_(logits.amax(dim=-1, keepdim=True)).exp_()
    if min_p is not None:
        level = min_p.clamp_max(1.0 - 1e-6).unsqueeze(1)
        weights.masked_fill_(weights <= level, 0.0)
    if use_exponential_noise:
        return _draw_by_noise(weights, generators, shared, widths)
    return _draw_by_inverse_cdf(weights, generators, shared)


def _split(generators: list[torch.Generator | None]) -> tuple[list[int], list[int]]:
    seeded = [j for j, g in enumerate(generators) if g is not None]
    unseeded = [j for j, g in enumerate(generators) if g is None]
    return seeded, unseeded


def _draw_by_noise(weights: torch.Tensor, generators: list[torch.Generator | None], shared: torch.Generator,
                   widths: list[int] | None) -> torch.Tensor:
    num, width = weights.shape
    device = weights.device
    seeded, unseeded = _split(generators)
    noise = torch.empty(num, width, dtype=torch.float32, device=device)
    if len(unseeded) == num:
        noise.exponential_(generator=shared)
    elif unseeded:
        block = torch.empty(len(unseeded), width, dtype=torch.float32, device=device)
        noise[index_tensor(unseeded, device)] = block.exponential_(generator=shared)
    for j in seeded:
        w = width if widths is None else widths[j]
        noise[j, :w].exponential_(generator=generators[j])
        noise[j, w:] = 1.0
    # An Exp(1) draw of exactly 0 would turn a masked entry's 0/0 into NaN, which argmax prefers.
    noise.clamp_min_(torch.finfo(torch.float32).tiny)
    return argmax(weights.div_(noise))


def _draw_by_inverse_cdf(weights: torch.Tensor, generators: list[torch.Generator | None],
                         shared: torch.Generator) -> torch.Tensor:
    num, width = weights.shape
    device = weights.device
    seeded, unseeded = _split(generators)
    u = torch.empty(num, dtype=torch.float32, device=device)
    if len(unseeded) == num:
        u.uniform_(generator=shared)
    elif unseeded:
        u[index_tensor(unseeded, device)] = torch.rand(len(unseeded), generator=shared, device=device)
    for j in seeded:
        u[j] = torch.rand(1, generator=generators[j], device=device)[0]
    cdf = weights.cumsum_(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    # The first index whose cumulative weight exceeds the target: zero-weight entries never qualify.
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_max_(width - 1)
