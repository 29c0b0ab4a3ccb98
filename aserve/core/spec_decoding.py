"""The scheduler's side of speculative decoding: how many of a request's proposed drafts it verifies.

The runner proposes up to `num_speculative_tokens` drafts for each request that sampled (when the
step's `propose_drafts` asks it to); the next step schedules the request's last token plus the
drafts kept here, and `num_computed_tokens` counts them like any token. After the step the scheduler
rolls `num_computed_tokens` back by the rejected drafts (their KV slots are simply overwritten
later: only blocks full of accepted tokens are ever registered in the prefix cache).

Drafts are kept only while they cannot overrun the request: never past `max_tokens` (the step's
last token is always one more than the accepted drafts), `max_model_len`, or the speculative
`max_model_len`; none in a step with more running requests than `disable_by_batch_size`; none for a
request that asks for logprobs when `disable_logprobs` is set.
"""

from __future__ import annotations

from aserve.config.speculative import SpeculativeConfig
from aserve.core.request import Request
from aserve.core.stats import SpecDecodingStats


class DraftPolicy:
    """Speculation off (`config` None) keeps no drafts and asks for none."""

    def __init__(self, config: SpeculativeConfig | None, max_model_len: int):
        self.config = config
        self.max_len = max_model_len
        if config is not None and config.max_model_len is not None:
            self.max_len = min(self.max_len, config.max_model_len)
        self.stats = SpecDecodingStats()

    def step_enabled(self, num_running: int) -> bool:
        """Whether a step with `num_running` running requests verifies (and asks for) drafts."""
        cfg = self.config
        return cfg is not None and (cfg.disable_by_batch_size is None or num_running <= cfg.disable_by_batch_size)

    def drafts_for(self, req: Request) -> list[int]:
        """The leading drafts of `req.spec_token_ids` this step may verify (the request is decoding)."""
        drafts = req.spec_token_ids
        if not drafts:
            return drafts
        if self.config.disable_logprobs and req.sampling_params.logprobs is not None:
            return []
        n = min(len(drafts), req.max_tokens - req.num_output_tokens - 1, self.max_len - req.num_tokens - 1)
        return drafts[:n] if n > 0 else []

    def settle(self, req: Request, verified: list[int] | None, tokens: list[int]) -> None:
        """After a verification step: the rejected drafts' KV slots count as not computed (they are
        overwritten later), and the verification is counted."""
        if verified:
            req.num_computed_tokens -= len(verified) + 1 - len(tokens)
            self.observe(verified, tokens)

    def observe(self, drafts: list[int], tokens: list[int]) -> None:
        """Counts one verification: the leading drafts the step's tokens agree with were accepted (an
        accepted draft that ended the request, e.g. EOS, included)."""
        n = 0
        while n < len(drafts) and n < len(tokens) and tokens[n] == drafts[n]:
            n += 1
        self.stats.observe(len(drafts), n)

    def take_stats(self) -> SpecDecodingStats | None:
        """The counters since the previous call (None with speculation off)."""
        if self.config is None:
            return None
        stats, self.stats = self.stats, SpecDecodingStats()
        return stats
