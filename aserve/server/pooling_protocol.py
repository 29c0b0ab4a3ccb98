"""Wire types of the pooling endpoints as msgspec Structs: OpenAI's `/v1/embeddings`, vLLM's `/score`,
`/rerank` (Jina / Cohere shape) and `/classify`.

Requests forbid unknown fields (a misspelt option is a 400 naming it); value checks (counts, lengths,
`dimensions`, `truncate_prompt_tokens`) happen in the handlers and the engine's pooling intake, whose
errors name the request's field.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import UNSET, Struct, UnsetType

from aserve.pooling_params import MAX_POOLING_INPUTS
from aserve.server.protocol import Priority, TruncatePromptTokens

PoolingInput = Annotated[
    str | list[Any],
    msgspec.Meta(description=f"A string, a list of strings, a list of token ids, or a list of token-id lists "
                             f"(at most {MAX_POOLING_INPUTS} inputs)."),
]
ENCODING_FORMATS = ("float", "base64")
ScoreText = Annotated[
    str | list[str],
    msgspec.Meta(description=f"A string or a list of strings (at most {MAX_POOLING_INPUTS})."),
]


class _PoolingFields(Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields every pooling request takes (vLLM's extras included)."""

    model: str | None = None
    truncate_prompt_tokens: TruncatePromptTokens = None
    priority: Priority = 0


class EmbeddingRequest(_PoolingFields, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's embeddings request; `normalize` is vLLM's (None: the model's pooler config)."""

    input: PoolingInput
    encoding_format: Annotated[
        str,
        msgspec.Meta(description="`float` or `base64`: each embedding as the base64 of its float32 "
                                 "little-endian bytes.", extra_json_schema={"enum": list(ENCODING_FORMATS)}),
    ] = "float"
    dimensions: Annotated[
        int | None, msgspec.Meta(description="Keep the first this many values (Matryoshka models only).")
    ] = None
    user: str | None = None
    normalize: bool | None = None


class ClassificationRequest(_PoolingFields, kw_only=True, forbid_unknown_fields=True):
    """vLLM's classification request (a `*ForSequenceClassification` model)."""

    input: PoolingInput
    user: str | None = None
    activation: bool | None = None


class ScoreRequest(_PoolingFields, kw_only=True, forbid_unknown_fields=True):
    """vLLM's score request: `text_1` against `text_2`, one to one (two strings), one to many (a
    string and a list) or pairwise (two lists of equal length)."""

    text_1: ScoreText
    text_2: ScoreText
    activation: bool | None = None


class RerankRequest(_PoolingFields, kw_only=True, forbid_unknown_fields=True):
    """The Jina / Cohere rerank request (vLLM's): `top_n` 0 or absent returns every document."""

    query: str
    documents: list[str]
    top_n: Annotated[int, msgspec.Meta(ge=0)] = 0
    return_documents: bool = True
    activation: bool | None = None


# -- responses --------------------------------------------------------------------------------------


class PoolingUsage(Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingData(Struct):
    index: int
    embedding: list[float] | str  # a string with encoding_format "base64"
    object: str = "embedding"


class EmbeddingResponse(Struct):
    id: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage
    object: str = "list"


class ClassificationData(Struct):
    index: int
    label: str
    probs: list[float]
    num_classes: int
    object: str = "classification"


class ClassificationResponse(Struct):
    id: str
    created: int
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage
    object: str = "list"


class ScoreData(Struct):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(Struct):
    id: str
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage
    object: str = "list"


class RerankDocument(Struct):
    text: str


class RerankResult(Struct):
    index: int
    relevance_score: float
    document: RerankDocument | UnsetType = UNSET


class RerankUsage(Struct):
    total_tokens: int


class RerankResponse(Struct):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]
