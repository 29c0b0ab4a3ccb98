"""POST /score, /v1/score (vLLM's) and /rerank, /v1/rerank, /v2/rerank (Jina / Cohere shape, vLLM's).

Both score text pairs. A classifier (`--task score` / `classify`: a cross-encoder) reads each pair in
one forward pass as a text pair (with token-type ids) and the score is its first output value; an
embedding model (`--task embed`) embeds each distinct text once and the score is the cosine
similarity of the two embeddings. `/score` pairs `text_1` with `text_2` one to one (two strings), one
to many (a string, or a one-item list, and a list) or pairwise (two lists of equal length); `/rerank`
scores the query against each document and answers them sorted by score, best first.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import msgspec
import numpy as np
from msgspec import UNSET
from starlette.requests import Request
from starlette.responses import Response

from aserve.config.pooling import PoolingConfig
from aserve.outputs import PoolingRequestOutput
from aserve.scoring import score_pairs as pair_texts
from aserve.server.errors import bad_request, unsupported
from aserve.server.pooling import PoolingBatch, answer, check_count, make_params, open_pooling_call, submit
from aserve.server.pooling_protocol import (
    PoolingUsage,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
)
from aserve.server.state import ServerState

_score_decoder = msgspec.json.Decoder(ScoreRequest)
_rerank_decoder = msgspec.json.Decoder(RerankRequest)
Pair = tuple[str, str]
Scores = Callable[[list[PoolingRequestOutput]], list[float]]


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[Pair]:
    """vLLM's pairing (`aserve.scoring.score_pairs`), each side at most MAX_POOLING_INPUTS long; a 400
    naming `text_1` or `text_2` otherwise."""
    check_count(1 if isinstance(text_1, str) else len(text_1), "text_1")
    check_count(1 if isinstance(text_2, str) else len(text_2), "text_2")
    try:
        return pair_texts(text_1, text_2)
    except ValueError as e:
        field, _, message = str(e).partition(": ")
        raise bad_request(message, param=field) from None


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    denom = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.dot(a, b) / denom) if denom > 0 else 0.0


async def _submit_scores(request: Request, state: ServerState, pooling: PoolingConfig, prefix: str,
                         pairs: Sequence[Pair], names: Callable[[int, int], str], truncate: int | None,
                         activation: bool | None, priority: int) -> tuple[PoolingBatch, Scores]:
    """Queue what scoring `pairs` takes and return the batch with the function turning its outputs into
    one score per pair. `names(i, side)` names pair i's text on `side` (0 or 1) in the request."""
    if pooling.is_classifier:
        params = make_params(activation=activation, truncate_prompt_tokens=truncate, task="score")
        batch = await submit(request, state, prefix, list(pairs), params, priority, lambda i: names(i, 1))
        return batch, lambda outputs: [float(out.outputs.data[0]) for out in outputs]
    if activation is not None:
        raise unsupported("activation", "it applies to a cross-encoder's scores; this model scores by the "
                          "cosine similarity of embeddings (--task embed)")
    texts: list[str] = []
    where: dict[str, int] = {}
    text_names: list[str] = []
    index_pairs: list[tuple[int, int]] = []
    for i, pair in enumerate(pairs):
        ends = []
        for side, text in enumerate(pair):
            if text not in where:
                where[text] = len(texts)
                texts.append(text)
                text_names.append(names(i, side))
            ends.append(where[text])
        index_pairs.append((ends[0], ends[1]))
    params = make_params(truncate_prompt_tokens=truncate, task="embed")
    batch = await submit(request, state, prefix, texts, params, priority, text_names.__getitem__)

    def cosines(outputs: list[PoolingRequestOutput]) -> list[float]:
        vectors = [np.frombuffer(out.raw, dtype=np.float32).astype(np.float64) for out in outputs]
        return [_cosine(vectors[a], vectors[b]) for a, b in index_pairs]

    return batch, cosines


def _usage(outputs: list[PoolingRequestOutput]) -> int:
    return sum(len(out.prompt_token_ids) for out in outputs)


async def create_score(request: Request) -> Response:
    call = await open_pooling_call(request, _score_decoder, request.url.path, "score")
    state, deadline, req, model, pooling = call.state, call.deadline, call.req, call.model, call.pooling
    pairs = score_pairs(req.text_1, req.text_2)
    one_first = isinstance(req.text_1, str) or len(req.text_1) == 1

    def names(i: int, side: int) -> str:
        value, field = (req.text_1, "text_1") if side == 0 else (req.text_2, "text_2")
        if isinstance(value, str) or (side == 0 and one_first):
            return field if isinstance(value, str) else f"{field}[0]"
        return f"{field}[{i}]"

    batch, scores_of = await _submit_scores(request, state, pooling, "score", pairs, names,
                                            req.truncate_prompt_tokens, req.activation, req.priority)

    def build(outputs: list[PoolingRequestOutput]) -> ScoreResponse:
        data = [ScoreData(index=i, score=s) for i, s in enumerate(scores_of(outputs))]
        num = _usage(outputs)
        return ScoreResponse(id=batch.request_id, created=int(time.time()), model=model, data=data,
                             usage=PoolingUsage(prompt_tokens=num, total_tokens=num))

    return await answer(request, deadline, batch, build)


async def create_rerank(request: Request) -> Response:
    call = await open_pooling_call(request, _rerank_decoder, request.url.path, "score")
    state, deadline, req, model, pooling = call.state, call.deadline, call.req, call.model, call.pooling
    check_count(len(req.documents), "documents")
    pairs = [(req.query, doc) for doc in req.documents]
    batch, scores_of = await _submit_scores(
        request, state, pooling, "rerank", pairs, lambda i, side: "query" if side == 0 else f"documents[{i}]",
        req.truncate_prompt_tokens, req.activation, req.priority)
    top_n = req.top_n or len(req.documents)

    def build(outputs: list[PoolingRequestOutput]) -> RerankResponse:
        scores = scores_of(outputs)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]
        results = [RerankResult(index=i, relevance_score=scores[i],
                                document=RerankDocument(req.documents[i]) if req.return_documents else UNSET)
                   for i in order]
        return RerankResponse(id=batch.request_id, model=model,
                              usage=RerankUsage(total_tokens=_usage(outputs)), results=results)

    return await answer(request, deadline, batch, build)

