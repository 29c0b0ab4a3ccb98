"""What the route handlers share: the engine client, the tokenizer, templates, metrics, settings.

`EngineClient` spells out the part of `aserve.engine.async_engine.AsyncEngine` the server uses, so
the server depends on that interface (and tests can hand in a fake) rather than on the engine's
module.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from importlib import metadata
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio

from aserve.config import AserveConfig, ModelConfig
from aserve.config.pooling import PoolingConfig
from aserve.engine.errors import EngineSleepingError
from aserve.engine.tracing import extract_trace_headers
from aserve.lora.request import LoRARequest
from aserve.outputs import RequestOutput
from aserve.pooling_params import PoolingParams
from aserve.sampling_params import SamplingParams
from aserve.server.tokenizer_pool import TokenizerPool, TokenizerWorker
from aserve.server.args import ServerArgs
from aserve.server.chat_template import ChatRenderer, resolve_chat_template
from aserve.server.errors import APIError, RequestFailed, overloaded
from aserve.server.metrics import PrometheusStatLogger
from aserve.server.mistral_chat import is_mistral_tokenizer
from aserve.server.retry_after import DrainRate

if TYPE_CHECKING:
    from aserve.engine.lora_registry import LoRARegistry

logger = logging.getLogger("aserve.server")

T = TypeVar("T")


class PromptStream(Protocol):
    """What `add_request` returns: the request's outputs, and its prompt after truncation."""

    prompt_token_ids: list[int]

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...


class _RaisingOnError:
    """The engine's stream, except that an output carrying `error` (the request failed alone) raises
    RequestFailed: the handlers' failure paths turn it into a 400/500 or an SSE error event."""

    def __init__(self, inner: PromptStream):
        self._inner = inner
        self.prompt_token_ids = inner.prompt_token_ids

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        async for out in self._inner:
            if out.error is not None:
                raise RequestFailed(out.error)
            yield out


class EngineClient(Protocol):
    """The AsyncEngine interface the server relies on."""

    model_config: ModelConfig
    config: AserveConfig
    tokenizer: Any

    def add_request(
        self,
        request_id: str,
        prompt: str | tuple[str, str] | None,  # a text pair only with PoolingParams (cross-encoders)
        prompt_token_ids: list[int] | None,
        params: SamplingParams | PoolingParams,
        priority: int = 0,
        client_id: str | None = None,  # a hash of the API key (fair sharing), never the key
        lora_request: LoRARequest | None = None,
    ) -> PromptStream: ...

    @property
    def loras(self) -> LoRARegistry: ...

    async def add_lora(self, lora_request: LoRARequest) -> bool: ...

    async def remove_lora(self, name: str) -> bool: ...

    def queued_load(self, count_tokens: bool = True) -> tuple[int, int]: ...

    async def abort(self, request_id: str) -> None: ...

    def add_stat_logger(self, logger: Any) -> None: ...

    def is_healthy(self) -> bool: ...

    async def check_health(self) -> None: ...

    async def run(self, *, task_status: Any = ...) -> None: ...

    def shutdown(self) -> None: ...

    def get_scheduler_stats(self) -> Any: ...

    def inflight_requests(self) -> list[Any]: ...  # aserve.core.stats.InflightRequest (/dashboard)

    async def reset_prefix_cache(self) -> bool: ...

    # sleep mode (aserve/server/sleep.py; AsyncEngine documents the contracts)
    @property
    def sleep_mode_enabled(self) -> bool: ...

    def is_sleeping(self) -> bool: ...

    async def sleep(self, level: int = 1) -> None: ...

    async def wake_up(self, tags: list[str] | None = None) -> None: ...

    def check_guided_decoding(self, params: SamplingParams) -> None: ...


def package_version() -> str:
    try:
        return metadata.version("aserve")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


@dataclass
class ServerState:
    engine: EngineClient
    args: ServerArgs
    model_config: ModelConfig
    tokenizer: Any
    metrics: PrometheusStatLogger
    drain_rate: DrainRate
    system_fingerprint: str
    version: str
    max_prompt_chars: int | None = None
    tokenizers: TokenizerPool | None = None  # None without a tokenizer (--skip-tokenizer-init)
    draining: bool = False
    _limiter: anyio.CapacityLimiter | None = field(default=None, repr=False)

    @classmethod
    def create(cls, engine: EngineClient, args: ServerArgs) -> ServerState:
        model_config = engine.model_config
        tokenizer = engine.tokenizer
        template = resolve_chat_template(tokenizer, args.chat_template) if tokenizer is not None else None
        if tokenizer is None:
            logger.info("no tokenizer (--skip-tokenizer-init): only token-id prompts on /v1/completions")
        elif is_mistral_tokenizer(tokenizer):
            if args.chat_template:
                raise ValueError("--chat-template: --tokenizer-mode mistral encodes chats with mistral_common "
                                 "(no jinja template); drop one of the two")
            logger.info("chats encoded by mistral_common (--tokenizer-mode mistral)")
        elif template is None:
            if engine.config.pooling is None:  # a pooling model never chats
                logger.warning(
                    "no chat template: the tokenizer has none, --chat-template is not set and no bundled "
                    "template fits; /v1/chat/completions will answer 400 until one is given"
                )
        else:
            logger.info("chat template: %s", template.source)
        max_prompt_chars = None
        if tokenizer is not None:  # no token is longer than this many characters
            max_token_chars = max((len(t) for t in tokenizer.get_vocab()), default=1)
            max_prompt_chars = model_config.max_model_len * max(max_token_chars, 1)
        version = package_version()
        digest = hashlib.sha256(
            f"{version}|{model_config.model_path}|{model_config.dtype}".encode()
        ).hexdigest()
        spec = engine.config.speculative
        metrics = PrometheusStatLogger(model_config.served_model_name, model_config.max_model_len,
                                       max_loras=engine.loras.max_loras if engine.loras.enabled else None,
                                       num_speculative_tokens=spec.num_speculative_tokens if spec else None,
                                       prefix=args.metrics_prefix)
        kv = engine.get_scheduler_stats()
        metrics.record_cache_config(engine.config.cache, kv.num_total_blocks, kv.num_cpu_blocks)
        return cls(
            engine=engine,
            args=args,
            model_config=model_config,
            tokenizer=tokenizer,
            metrics=metrics,
            drain_rate=DrainRate(),
            system_fingerprint=f"fp_aserve_{digest[:10]}",
            version=version,
            max_prompt_chars=max_prompt_chars,
            tokenizers=TokenizerPool(tokenizer, lambda tok: ChatRenderer(tok, template), model_config.tokenizer_pool_size)
            if tokenizer is not None else None,
        )

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return self.model_config.served_model_names

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_model_len

    @property
    def pooling(self) -> PoolingConfig | None:
        """What a pooling engine serves (None: the engine generates text)."""
        return self.engine.config.pooling

    @property
    def lora_enabled(self) -> bool:
        return self.engine.loras.enabled

    def check_model(self, requested: str | None) -> str:
        """The model name to answer with (a served name or a loaded LoRA adapter's); an unknown name is a 404."""
        if requested is None or requested == "":
            return self.served_model_names[0]
        if requested not in self.served_model_names and self.engine.loras.get(requested) is None:
            adapters = [r.lora_name for r in self.engine.loras.list()]
            raise APIError(
                404,
                f"The model `{requested}` does not exist. Served models: {list(self.served_model_names) + adapters}",
                param="model",
                code="model_not_found",
            )
        return requested

    def lora_request_for(self, model: str) -> LoRARequest | None:
        """The adapter a checked `model` name denotes (None: the base model)."""
        return None if model in self.served_model_names else self.engine.loras.get(model)

    async def run_tokenizer(self, fn: Callable[[TokenizerWorker], T]) -> T:
        """`fn(worker)` (tokenizing, rendering a chat template) on the tokenizer pool's threads; the
        worker's tokenizer and renderer are its own while `fn` runs (`tokenizer_pool.py`)."""
        return await self.tokenizers.run(fn)

    async def run_blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run other blocking work (grammar compiles) in a worker thread, one at a time."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(1)
        return await anyio.to_thread.run_sync(partial(fn, *args, **kwargs), limiter=self._limiter)

    def add_request(
        self,
        request_id: str,
        prompt: str | tuple[str, str] | None,
        prompt_token_ids: list[int] | None,
        params: SamplingParams | PoolingParams,
        priority: int,
        client_id: str | None = None,
        lora_request: LoRARequest | None = None,
        admit: bool = True,
        trace_headers: dict[str, str] | None = None,
    ) -> PromptStream:
        """Hand a request to the engine. Raises SamplingParamsError (naming the field in
        SamplingParams' terms: the handler maps it to a 400), a 429 APIError over an admission cap
        (checked here, with no await before the engine queues it, so concurrent requests cannot
        overshoot; `admit=False`: the caller checked a whole batch with `check_load` and queues it
        with no await in between), or a 503 APIError if the engine is down. `client_id` is a hash
        of the API key. `prompt_token_ids` None: the engine tokenizes `prompt` (pooling only).
        `trace_headers` (`trace_headers_of(request)`) parent the request's OpenTelemetry span."""
        if not self.engine.is_healthy():
            raise APIError(503, "the engine is not running", code="engine_dead")
        if admit:
            assert isinstance(params, SamplingParams) and prompt_token_ids is not None
            self.check_admission(prompt_token_ids, params)
        self.log_request(request_id, prompt, prompt_token_ids, params)
        try:
            tracing = {"trace_headers": trace_headers} if trace_headers else {}  # engines without tracing too
            stream = self.engine.add_request(request_id, prompt, prompt_token_ids, params, priority, client_id,
                                             lora_request, **tracing)
            return _RaisingOnError(stream)
        except EngineSleepingError as exc:
            raise APIError(503, str(exc), code="model_sleeping") from None
        except RuntimeError as exc:  # EngineDeadError, or the engine is shutting down
            raise APIError(
                503, f"the engine cannot take requests: {exc}", code="engine_unavailable"
            ) from None

    def check_admission(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """A 429 (Retry-After) when queueing this request would pass --max-num-queued-reqs (a request
        with n samples counts n) or --max-num-queued-tokens (prompt tokens not yet computed, each
        sample's counted). An idle engine takes any request, so a cap never makes one impossible."""
        num_prompt = len(prompt_token_ids)
        if params.truncate_prompt_tokens is not None:
            num_prompt = min(num_prompt, params.truncate_prompt_tokens)
        self.check_load(params.num_samples, params.num_samples * num_prompt)

    def check_load(self, num_new_reqs: int, num_new_tokens: int) -> None:
        """`check_admission` for `num_new_reqs` engine requests holding `num_new_tokens` prompt tokens
        in all (a batch of pooling inputs is admitted, or refused, as a whole)."""
        max_reqs, max_tokens = self.args.max_num_queued_reqs, self.args.max_num_queued_tokens
        if not (max_reqs or max_tokens):
            return
        num_reqs, num_tokens = self.engine.queued_load(bool(max_tokens))
        if num_reqs == 0:
            return
        if max_reqs and num_reqs + num_new_reqs > max_reqs:
            raise self.queue_full(num_reqs)
        if max_tokens and num_tokens + num_new_tokens > max_tokens:
            raise overloaded(f"the server is at capacity: {num_tokens} prompt tokens queued "
                             f"(--max-num-queued-tokens {max_tokens}); retry later",
                             self.drain_rate.retry_after_s(num_reqs, num_tokens))

    def check_queue_not_full(self) -> None:
        """The early form of the --max-num-queued-reqs cap, before the body is read: a 429 when the
        queue is already at the cap (no request could be admitted, whatever its body)."""
        max_reqs = self.args.max_num_queued_reqs
        if max_reqs:
            num_reqs, _ = self.engine.queued_load(False)
            if num_reqs >= max_reqs:
                raise self.queue_full(num_reqs)

    def queue_full(self, num_reqs: int) -> APIError:
        """The 429 for --max-num-queued-reqs, with Retry-After from the recent drain rate."""
        return overloaded(f"the server is at capacity: {num_reqs} requests queued or running "
                          f"(--max-num-queued-reqs {self.args.max_num_queued_reqs}); retry later",
                          self.drain_rate.retry_after_s(num_reqs))

    def request_deadline(self) -> float | None:
        """When a request arriving now times out (anyio clock), or None without --request-timeout."""
        timeout = self.args.request_timeout
        return None if timeout is None else anyio.current_time() + timeout

    def check_guided_decoding(self, params: SamplingParams) -> None:
        """Blocking (call it through `run_blocking`): SamplingParamsError naming the field unless
        `params.guided_decoding` compiles. Runs the engine's own intake check, whose verdicts are
        cached by spec, so the check at `add_request` on the event loop is a cache hit."""
        if params.guided_decoding is not None:
            self.engine.check_guided_decoding(params)

    def check_text_length(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing, a text that cannot fit in the context: more characters than
        max_model_len tokens of the vocabulary's longest token (saves tokenizing megabytes for a 400)."""
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise APIError(
                400,
                f"{param}: this model's maximum context length is {self.max_model_len} tokens, and "
                f"{num_chars} characters cannot fit in it",
                param=param,
                code="context_length_exceeded",
            )

    def require_tokenizer(self, param: str) -> None:
        """A 400 naming `param` when the server runs without a tokenizer (--skip-tokenizer-init)."""
        if self.tokenizer is None:
            raise APIError(
                400,
                f"{param}: this server runs with --skip-tokenizer-init, so it takes only token-id prompts "
                "on /v1/completions",
                param=param,
                code="tokenizer_not_initialized",
            )

    async def abort(self, request_id: str) -> None:
        """Abort a request, shielded so it completes even inside a cancelled scope."""
        with anyio.CancelScope(shield=True):
            try:
                await self.engine.abort(request_id)
            except Exception:  # the engine may be dead already; the request is gone either way
                logger.exception("aborting request %s failed", request_id)

    def log_request(self, request_id: str, prompt: str | tuple[str, str] | None,
                    prompt_token_ids: list[int] | None, params: SamplingParams | PoolingParams) -> None:
        if self.args.disable_log_requests:
            return
        limit = self.args.max_log_len
        shown_prompt = prompt[:limit] if (prompt is not None and limit is not None) else prompt
        shown_ids = prompt_token_ids[:limit] if (prompt_token_ids is not None and limit is not None) \
            else prompt_token_ids
        logger.info(
            "Received request %s: prompt: %r, params: %r, prompt_token_ids: %s",
            request_id,
            shown_prompt,
            params,
            shown_ids,
        )

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """Sampling defaults from the model's generation_config.json (vLLM's --generation-config auto)."""
        return dict(getattr(self.engine, "generation_defaults", None) or {})

    def decode_token(self, token_id: int) -> str:
        """The token's text; without a tokenizer vLLM's `token_id:<id>` form."""
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


def get_state(request: Any) -> ServerState:
    return request.app.state.aserve


def trace_headers_of(request: Any) -> dict[str, str] | None:
    """The request's W3C trace headers (`traceparent`, `tracestate`), or None."""
    return extract_trace_headers(request.headers)


def client_id_of(request: Any) -> str | None:
    """The hash of the request's API key when the server has several (set by the app's gate), else None."""
    return request.scope.get("state", {}).get("client_id")
