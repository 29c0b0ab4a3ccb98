"""Sampling on tensors, split by concern:

* `state.py`      per-request state: rows of a persistent parameter table, generators, bias tensors
* `penalties.py`  logit_bias, allowed_token_ids, min_tokens masking, repetition/presence/frequency
* `processors.py` user logits processors (signature, per-row isolation)
* `topk_topp.py`  argmax / top-k / top-p selection, with the CPU shortcuts
* `draw.py`       the draw (exponential noise on accelerators, inverse CDF on CPU), min-p, seeds
* `logprobs.py`   raw-distribution logprobs for sampled tokens and prompt positions
* `sampler.py`    `Sampler.sample`: the per-step orchestration of the above
"""

from aserve.runner.sampling.logprobs import compute_prompt_logprobs
from aserve.runner.sampling.sampler import Sampler, SamplerResult
from aserve.runner.sampling.state import RequestSampling, SamplingStates, make_generator

__all__ = ["RequestSampling", "Sampler", "SamplerResult", "SamplingStates", "compute_prompt_logprobs",
           "make_generator"]
