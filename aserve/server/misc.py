"""GET /v1/models, /health, /version, /metrics; POST /tokenize, /detokenize, /reset_prefix_cache."""

from __future__ import annotations

import time
from typing import Protocol, cast

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from aserve.server.chat import to_conversation
from aserve.server.errors import APIError, bad_request, decode_body
from aserve.server.metrics import CONTENT_TYPE
from aserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    encoder,
)
from aserve.server.state import get_state

class _PrefixCacheOwner(Protocol):
    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (and no change) while requests hold blocks."""
        ...


_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


def _json(obj: object, status: int = 200) -> Response:
    return Response(encoder.encode(obj), status_code=status, media_type="application/json")


async def list_models(request: Request) -> Response:
    state = get_state(request)
    created = int(time.time())
    root = state.model_config.model or state.model_config.model_path
    task = state.pooling.task if state.pooling is not None else "generate"
    cards = [
        ModelCard(id=name, created=created, root=root, max_model_len=state.max_model_len, task=task)
        for name in state.served_model_names
    ]
    base = state.served_model_names[0]
    cards += [ModelCard(id=lora.lora_name, created=created, root=lora.lora_path, max_model_len=state.max_model_len,
                        parent=lora.base_model_name or base) for lora in state.engine.loras.list()]
    return _json(ModelList(data=cards))


async def health(request: Request) -> Response:
    """200 with an empty body while the engine is healthy, 503 otherwise."""
    state = get_state(request)
    try:
        await state.engine.check_health()
    except Exception as exc:
        return APIError(
            503, f"the engine is not healthy: {type(exc).__name__}: {exc}", code="engine_unhealthy"
        ).to_response()
    return Response(status_code=200)


async def version(request: Request) -> Response:
    return _json({"version": get_state(request).version})


async def metrics(request: Request) -> Response:
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE)


async def tokenize(request: Request) -> Response:
    state = get_state(request)
    req = decode_body(await request.body(), _tokenize_decoder)
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of `prompt` or `messages`", param="prompt")
    state.require_tokenizer("prompt" if req.prompt is not None else "messages")
    if req.messages is not None:
        conversation = to_conversation(req.messages, state.args.chat_template_content_format)
        _, ids = await state.run_tokenizer(lambda w: w.renderer.render_and_tokenize(
            conversation,
            add_special_tokens=bool(req.add_special_tokens),
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs,
        ))
    else:
        add_special = True if req.add_special_tokens is None else req.add_special_tokens
        ids = await state.run_tokenizer(lambda w: w.tokenizer.encode(req.prompt, add_special_tokens=add_special))
    token_strs = None
    if req.return_token_strs:
        token_strs = await state.run_tokenizer(lambda w: w.tokenizer.convert_ids_to_tokens(ids))
    return _json(
        TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids, token_strs=token_strs)
    )


async def detokenize(request: Request) -> Response:
    state = get_state(request)
    req = decode_body(await request.body(), _detokenize_decoder)
    state.check_model(req.model)
    state.require_tokenizer("tokens")
    vocab_size = state.model_config.arch.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token ids must be in [0, {vocab_size}), got {bad[:5]}", param="tokens")
    text = await state.run_tokenizer(lambda w: w.tokenizer.decode(req.tokens))
    return _json(DetokenizeResponse(prompt=text))


async def reset_prefix_cache(request: Request) -> Response:
    """vLLM's POST /reset_prefix_cache: 200 (empty) once the prefix cache is forgotten; 409 while
    running requests hold KV blocks (nothing changes then; retry when the server is idle)."""
    engine = cast(_PrefixCacheOwner, get_state(request).engine)
    if not await engine.reset_prefix_cache():
        raise APIError(
            409,
            "the prefix cache was not reset: running requests hold KV blocks; retry when idle",
            code="prefix_cache_in_use",
        )
    return Response(status_code=200)
