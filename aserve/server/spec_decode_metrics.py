"""Speculative decoding's Prometheus counters, vLLM's names under the server's metrics prefix, in the app's own
registry (see `metrics.py`): `spec_decode_num_drafts` (requests that verified drafts, once per step),
`spec_decode_num_draft_tokens` (drafts verified), `spec_decode_num_accepted_tokens` (drafts accepted)
and `spec_decode_num_accepted_tokens_per_pos` (accepted at each draft position, label `position`).
Acceptance rate = accepted / draft tokens; mean accepted length = 1 + accepted / drafts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from aserve.engine.stats import SpecDecodingStats


class SpecDecodeMetrics:
    def __init__(self, model_name: str, num_speculative_tokens: int, registry: CollectorRegistry,
                 prefix: str = "vllm"):
        self.model_name = model_name

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"{prefix}:{name}", doc, ["model_name", *extra], registry=registry)

        self.num_drafts = counter("spec_decode_num_drafts", "Requests that verified drafts (once per step).")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each position.",
                               ("position",))
        for metric in (self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens):
            metric.labels(model_name=model_name)
        for pos in range(num_speculative_tokens):
            self.per_pos.labels(model_name=model_name, position=str(pos))

    def record(self, stats: SpecDecodingStats | None) -> None:
        if stats is None or not stats.num_drafts:
            return
        name = self.model_name
        self.num_drafts.labels(model_name=name).inc(stats.num_drafts)
        self.num_draft_tokens.labels(model_name=name).inc(stats.num_draft_tokens)
        self.num_accepted_tokens.labels(model_name=name).inc(stats.num_accepted_tokens)
        for pos, count in enumerate(stats.num_accepted_tokens_per_pos):
            if count:
                self.per_pos.labels(model_name=name, position=str(pos)).inc(count)
