"""LoRA adapters over HTTP, as vLLM serves them: `--lora-modules` at start-up, the adapter's name as a
request's `model`, adapters in `/v1/models` with the base model as `parent`, and — when
`VLLM_ALLOW_RUNTIME_LORA_UPDATING` (or `ASERVE_ALLOW_RUNTIME_LORA_UPDATING`) is true —
`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (under `/v1`, so they need the API
key when one is set).

A bad adapter folder is a 400 naming the problem (the engine and other requests are unharmed); an
unknown adapter a 404.
"""

from __future__ import annotations

import os

import msgspec
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from aserve.lora.errors import LoRAAdapterError
from aserve.lora.request import LoRARequest
from aserve.server.errors import APIError, bad_request, decode_body
from aserve.server.lora_modules import LoRAModule
from aserve.server.state import get_state

RUNTIME_UPDATE_ENV = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "ASERVE_ALLOW_RUNTIME_LORA_UPDATING")


class LoRAModulesError(ValueError):
    """A `--lora-modules` adapter could not be loaded at start-up (the message names it)."""


class LoadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: str
    lora_int_id: int | None = None


_load_decoder = msgspec.json.Decoder(LoadLoRAAdapterRequest)
_unload_decoder = msgspec.json.Decoder(UnloadLoRAAdapterRequest)


def runtime_updates_allowed(environ=os.environ) -> bool:
    return any(environ.get(name, "").strip().lower() in ("1", "true", "yes") for name in RUNTIME_UPDATE_ENV)


async def register_lora_modules(engine, modules: tuple[LoRAModule, ...], served_model_names: tuple[str, ...]) -> None:
    """Load every `--lora-modules` adapter before the server answers; LoRAModulesError on the first failure."""
    for module in modules:
        if module.name in served_model_names:
            raise LoRAModulesError(f"--lora-modules: {module.name!r} is the served model's name")
        request = LoRARequest(module.name, engine.loras.next_id(), module.path, base_model_name=module.base_model_name)
        try:
            await engine.add_lora(request)
        except LoRAAdapterError as e:
            raise LoRAModulesError(f"--lora-modules: adapter {module.name!r} ({module.path}): {e}") from None


async def load_lora_adapter(request: Request) -> Response:
    state = get_state(request)
    req = decode_body(await request.body(), _load_decoder)
    if not req.lora_name or not req.lora_path:
        raise bad_request("both `lora_name` and `lora_path` must be non-empty", param="lora_name")
    engine = state.engine
    if not state.lora_enabled:
        raise bad_request("LoRA adapters are not enabled: start the server with --enable-lora", param="lora_name")
    if req.lora_name in state.served_model_names or engine.loras.get(req.lora_name) is not None:
        raise bad_request(f"The lora adapter '{req.lora_name}' has already been loaded.", param="lora_name",
                          code="lora_adapter_exists")
    lora_request = LoRARequest(req.lora_name, engine.loras.next_id(), req.lora_path)
    try:
        await engine.add_lora(lora_request)
    except LoRAAdapterError as e:
        raise bad_request(f"cannot load the lora adapter '{req.lora_name}': {e}", param="lora_path",
                          code="invalid_lora_adapter") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    state = get_state(request)
    req = decode_body(await request.body(), _unload_decoder)
    known = state.engine.loras.get(req.lora_name)
    if known is None or (req.lora_int_id is not None and req.lora_int_id != known.lora_int_id):
        raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name",
                       code="lora_adapter_not_found")
    await state.engine.remove_lora(req.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
