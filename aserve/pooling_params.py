"""PoolingParams: what a pooling request (embed, classify, score, encode) asks for, vLLM's names.

Validated once at construction (`SamplingParamsError` naming the field); the checks that need the
model (`dimensions` against the hidden size and Matryoshka support, the prompt's length) live in
`aserve.engine.input_processor`. Unset fields (None) take the served model's pooler config.
"""

from __future__ import annotations

import msgspec

from aserve.sampling_params import RequestOutputKind, SamplingParamsError

MAX_POOLING_INPUTS = 2048  # inputs in one /v1/embeddings, /score or /rerank request (and LLM.embed batch)


class PoolingParams(msgspec.Struct, omit_defaults=True, kw_only=True):
    """`dimensions`: keep the first this many values of each embedding (Matryoshka models) before
    normalizing. `normalize`: L2-normalize embeddings (None: the model's pooler config). `activation`:
    softmax (sigmoid with one label) over a classifier's logits (None: the model's). `task`: the one
    asked for ("embed" | "classify" | "score" | "encode"; None: the served task), checked against what
    the engine serves. `truncate_prompt_tokens`: keep only this many tokens (-1: max_model_len); text
    is truncated by the tokenizer on the right (its special tokens kept), token ids keep the last ones.
    `token_type_ids`: set by the engine for text pairs (cross-encoders), never by users."""

    dimensions: int | None = None
    normalize: bool | None = None
    activation: bool | None = None
    task: str | None = None
    truncate_prompt_tokens: int | None = None
    token_type_ids: list[int] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY

    def __post_init__(self) -> None:
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise SamplingParamsError("dimensions", f"must be a positive integer, got {self.dimensions!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1)):
            raise SamplingParamsError("truncate_prompt_tokens", f"must be -1 (the model's limit) or >= 1, got {t!r}")
        if self.task is not None and self.task not in ("embed", "classify", "score", "encode"):
            raise SamplingParamsError("task", f"must be embed, classify, score or encode, got {self.task!r}")
        if self.output_kind != RequestOutputKind.FINAL_ONLY:
            raise SamplingParamsError("output_kind", "pooling requests have one final output (FINAL_ONLY)")

    @property
    def n(self) -> int:  # one output per request (the engine's intake treats it as one sample)
        return 1
