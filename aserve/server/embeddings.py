"""POST /v1/embeddings (OpenAI's format) and POST /classify (vLLM's): one engine request per input,
submitted, collected and aborted together (`aserve.server.pooling`).

`/v1/embeddings` needs a model served with `--task embed`; `/classify` a classifier (`--task
classify` / `score`). `encoding_format: "base64"` sends each embedding as the base64 of its float32
little-endian bytes (what the openai SDK decodes by default). `dimensions` is for Matryoshka models
only (the engine's intake refuses it otherwise, naming the field).
"""

from __future__ import annotations

import base64
import json
import sys
import time
from array import array
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from aserve.outputs import PoolingRequestOutput
from aserve.server.errors import bad_request
from aserve.server.pooling import answer, make_params, normalize_inputs, open_pooling_call, submit
from aserve.server.pooling_protocol import (
    ENCODING_FORMATS,
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    PoolingUsage,
)
from aserve.server.state import ServerState

_embedding_decoder = msgspec.json.Decoder(EmbeddingRequest)
_classification_decoder = msgspec.json.Decoder(ClassificationRequest)


def _input_param(batched: bool) -> Callable[[int], str]:
    return (lambda i: f"input[{i}]") if batched else (lambda i: "input")


def pooling_usage(outputs: list[PoolingRequestOutput]) -> PoolingUsage:
    """Prompt tokens the model read (after truncation), summed over the outputs."""
    num = sum(len(out.prompt_token_ids) for out in outputs)
    return PoolingUsage(prompt_tokens=num, total_tokens=num)


def base64_embedding(out: PoolingRequestOutput) -> str:
    """The base64 of the embedding's float32 little-endian bytes (`raw` is native order)."""
    raw = out.raw
    if sys.byteorder != "little":
        values = array("f", raw)
        values.byteswap()
        raw = values.tobytes()
    return base64.b64encode(raw).decode("ascii")


async def create_embedding(request: Request) -> Response:
    call = await open_pooling_call(request, _embedding_decoder, "/v1/embeddings", "embed")
    state, deadline, req, model = call.state, call.deadline, call.req, call.model
    if req.encoding_format not in ENCODING_FORMATS:
        raise bad_request(f"must be 'float' or 'base64', got {req.encoding_format!r}",
                          param="encoding_format")
    inputs = normalize_inputs(req.input)
    batched = isinstance(req.input, list) and inputs[0] is not req.input
    params = make_params(dimensions=req.dimensions, normalize=req.normalize,
                         truncate_prompt_tokens=req.truncate_prompt_tokens, task="embed")
    batch = await submit(request, state, "embd", inputs, params, req.priority, _input_param(batched))
    as_base64 = req.encoding_format == "base64"

    def build(outputs: list[PoolingRequestOutput]) -> EmbeddingResponse:
        data = [EmbeddingData(index=i, embedding=base64_embedding(out) if as_base64 else out.outputs.data)
                for i, out in enumerate(outputs)]
        return EmbeddingResponse(id=batch.request_id, created=int(time.time()), model=model, data=data,
                                 usage=pooling_usage(outputs))

    return await answer(request, deadline, batch, build)


@lru_cache(maxsize=8)
def _id2label(config_dir: str) -> dict[int, str]:
    """config.json's `id2label` (class index -> name); empty when absent or unreadable."""
    try:
        labels = json.loads((Path(config_dir) / "config.json").read_text()).get("id2label") or {}
        return {int(k): str(v) for k, v in labels.items()}
    except (OSError, ValueError, AttributeError):
        return {}


def class_labels(state: ServerState) -> dict[int, str]:
    """The served classifier's class names from its config.json (read once), else none."""
    cfg = state.model_config
    return _id2label(cfg.hf_config_path or cfg.model_path)


async def create_classification(request: Request) -> Response:
    call = await open_pooling_call(request, _classification_decoder, "/classify", "classify")
    state, deadline, req, model = call.state, call.deadline, call.req, call.model
    inputs = normalize_inputs(req.input)
    batched = isinstance(req.input, list) and inputs[0] is not req.input
    params = make_params(activation=req.activation, truncate_prompt_tokens=req.truncate_prompt_tokens,
                         task="classify")
    batch = await submit(request, state, "classify", inputs, params, req.priority, _input_param(batched))
    labels = class_labels(state)

    def build(outputs: list[PoolingRequestOutput]) -> ClassificationResponse:
        data = []
        for i, out in enumerate(outputs):
            probs = list(out.outputs.data)
            best = max(range(len(probs)), key=probs.__getitem__) if probs else 0
            data.append(ClassificationData(index=i, label=labels.get(best, str(best)), probs=probs,
                                           num_classes=len(probs)))
        return ClassificationResponse(id=batch.request_id, created=int(time.time()), model=model, data=data,
                                      usage=pooling_usage(outputs))

    return await answer(request, deadline, batch, build)
