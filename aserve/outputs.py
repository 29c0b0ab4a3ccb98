"""What generate() returns: vLLM-shaped RequestOutput / CompletionOutput / Logprob."""

from __future__ import annotations

from dataclasses import dataclass

from aserve.lora.request import LoRARequest


@dataclass
class Logprob:
    """One candidate token's log probability, its rank (1 = most likely) and its decoded text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the sampled token plus the top-N).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of one request's life; `time_in_queue` is first_scheduled_time
    minus arrival_time; `num_preemptions` counts how often the scheduler preempted it."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class RequestError:
    """Why a request failed alone (the engine kept serving everyone else).

    `bad_input` is True when the request's own input was at fault (the server answers 400), False
    for an internal failure confined to this request (500 for this request only).
    """

    message: str
    bad_input: bool


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: RequestError | None = None  # set when the request failed (its outputs end with "error")
    lora_request: LoRARequest | None = None  # the adapter it ran with (None: the base model)

    def __repr__(self) -> str:
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
                f"outputs={self.outputs!r}, finished={self.finished})")


# -- pooling (embed, classify, score, encode): vLLM's output shapes ------------------------------------
@dataclass
class PoolingOutput:
    """A pooled result: `data` is one vector (embed, encode, classify) or, with ALL pooling, one
    vector per prompt token. vLLM holds a torch tensor here; aserve's outputs stay torch-free lists."""

    data: list[float] | list[list[float]]


@dataclass
class PoolingRequestOutput:
    """One pooling request's final output. `raw` holds `data` as float32 bytes (native byte order,
    row-major), what the server's base64 encoding sends; `error` is set when it failed (then `data`
    is empty)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    prompt: str | None = None
    metrics: RequestMetrics | None = None
    error: RequestError | None = None
    raw: bytes = b""


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    """Class probabilities (or raw logits when the activation is off)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    """A pair's score: a cross-encoder's probability, or the cosine similarity of two embeddings."""

    score: float


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(out.request_id, EmbeddingOutput(list(out.outputs.data)), out.prompt_token_ids, out.finished)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> ClassificationRequestOutput:
        return cls(out.request_id, ClassificationOutput(list(out.outputs.data)), out.prompt_token_ids, out.finished)


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool
