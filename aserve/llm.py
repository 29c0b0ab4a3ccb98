"""The offline API: `LLM(model=..., **engine_args).generate(prompts, params)` like vLLM's."""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec
from typing import Any

from aserve.config import ConfigError, EngineArgs
from aserve.engine.llm_engine import LLMEngine
from aserve.engine.stats import IntervalStatLineLogger
from aserve.lora.request import LoRARequest
from aserve.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from aserve.pooling_params import PoolingParams
from aserve.sampling_params import RequestOutputKind, SamplingParams
from aserve.scoring import cosine_similarity, score_pairs
from aserve.server.chat_template import ChatRenderer, load_flag_template, resolve_chat_template

PromptType = str | list[int] | dict[str, Any]


class LLM:
    """An offline engine: a tokenizer, the model on one device, and a paged KV cache.

    `model=""` (the default) serves the bundled SmolLM2-135M-Instruct. Every other keyword is an
    engine argument with vLLM's name (see `aserve.config.EngineArgs`), except `stats_log_interval`.

    Stats: as vLLM's `LLM`, no stats line unless `disable_log_stats=False`; then the server's line
    ("Avg prompt throughput: ...") is logged (logger `aserve.engine.stats`, level INFO) every
    `stats_log_interval` seconds while generating.
    `structured_outputs_config={"reasoning_parser": ...}` is refused: reasoning parsers are the server's.
    """

    def __init__(self, model: str = "", *, stats_log_interval: float = 5.0, **engine_args: Any):
        engine_args.setdefault("disable_log_stats", True)  # vLLM's LLM default
        args = EngineArgs.from_kwargs(model=model, **engine_args)
        if not (isinstance(stats_log_interval, (int, float)) and stats_log_interval > 0):
            raise ConfigError(f"stats_log_interval: must be > 0 seconds, got {stats_log_interval!r}")
        if args.data_parallel_size > 1:
            raise ConfigError("--data-parallel-size: the offline LLM runs one replica; as in vLLM, run one LLM "
                              "per replica (a process each) with its share of the prompts, or serve with "
                              "`aserve --data-parallel-size N`, which routes requests across replicas")
        if (args.structured_outputs_config or {}).get("reasoning_parser") is not None:
            raise ConfigError("--structured-outputs-config: reasoning_parser is a server option (it sets "
                              "--reasoning-parser of `aserve serve`); the offline LLM returns the raw text "
                              "and does not split reasoning. To start a grammar after the reasoning, set "
                              "GuidedDecodingParams(reasoning_end_token_ids=...) on the request")
        loggers = [] if args.disable_log_stats else [IntervalStatLineLogger(stats_log_interval)]
        self._attach(LLMEngine.from_engine_args(args, stat_loggers=loggers))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """An LLM over an engine built elsewhere (e.g. with a custom executor factory)."""
        llm = cls.__new__(cls)
        llm._attach(engine)
        return llm

    def _attach(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.llm_engine = engine  # vLLM's attribute name
        self._renderer: ChatRenderer | None = None

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    # -- generate ---------------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 prompt_token_ids: list[list[int]] | None = None, use_tqdm: bool = True,
                 priority: list[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generates for every prompt; returns one RequestOutput per prompt, in the prompts' order.

        A prompt is a string, a list of token ids, or a dict with "prompt" or "prompt_token_ids".
        `lora_request`: one adapter for every prompt, or one `LoRARequest | None` per prompt (needs
        `enable_lora=True`); each adapter is loaded on first use (LoRAAdapterError if it cannot be).
        """
        items = self._normalize_prompts(prompts, prompt_token_ids)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise ValueError(f"sampling_params: got {len(params_list)} for {len(items)} prompts")
        if priority is not None and len(priority) != len(items):
            raise ValueError(f"priority: got {len(priority)} values for {len(items)} prompts")
        loras = self._lora_requests(lora_request, len(items))
        ids: list[str] = []
        try:
            for i, ((text, token_ids), params) in enumerate(zip(items, params_list)):
                request_id = self.engine.next_request_id()
                params = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                self.engine.add_request(request_id, text, params, prompt_token_ids=token_ids,
                                        priority=priority[i] if priority else 0, lora_request=loras[i])
                ids.append(request_id)
        except Exception:
            for request_id in ids:  # one bad prompt rejects the call; nothing is left queued
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    def _lora_requests(self, lora_request, num_prompts: int) -> list[LoRARequest | None]:
        """One adapter (or None) per prompt, each registered with the engine (loaded on first use)."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * num_prompts
        else:
            loras = list(lora_request)
            if len(loras) != num_prompts:
                raise ValueError(f"lora_request: got {len(loras)} for {num_prompts} prompts")
        for lora in {r for r in loras if r is not None}:
            self.engine.add_lora(lora)
        return loras

    # -- adapters (vLLM's LLM.llm_engine.add_lora / remove_lora / list_loras) -----------------------
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.engine.list_loras()

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Renders one conversation or a list of them with the chat template (the same sandboxed renderer as
        the server; `chat_template` is a file or an inline template), then generates."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        renderer = self._chat_renderer()
        source = load_flag_template(chat_template) if chat_template else None
        prompts = []
        for conv in conversations:
            text, ids = renderer.render_and_tokenize(
                conv, add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, chat_template=source,
                chat_template_kwargs=chat_template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _chat_renderer(self) -> ChatRenderer:
        """The server's sandboxed renderer (same template resolution: tokenizer's, else a bundled one)."""
        if self._renderer is None:
            tokenizer = self.get_tokenizer()
            if tokenizer is None:
                raise ValueError("chat: needs a tokenizer (skip_tokenizer_init is set)")
            self._renderer = ChatRenderer(tokenizer, resolve_chat_template(tokenizer, None))
        return self._renderer

    # -- pooling (vLLM's LLM.encode / embed / classify / score; needs a pooling model) -----------------
    def encode(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
               use_tqdm: bool = True, truncate_prompt_tokens: int | None = None,
               priority: list[int] | None = None) -> list[PoolingRequestOutput]:
        """Pools every prompt with the served task (or `pooling_params.task`); one output per prompt, in
        order. A prompt is a string, token ids, a dict, or (for a cross-encoder) a (text_1, text_2) tuple."""
        items = self._pooling_items(prompts)
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = msgspec.structs.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        if priority is not None and len(priority) != len(items):
            raise ValueError(f"priority: got {len(priority)} values for {len(items)} prompts")
        ids: list[str] = []
        try:
            for i, (prompt, token_ids) in enumerate(items):
                request_id = self.engine.next_request_id()
                self.engine.add_request(request_id, prompt, params, prompt_token_ids=token_ids,
                                        priority=priority[i] if priority else 0)
                ids.append(request_id)
        except Exception:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        return self._run(ids, use_tqdm)

    @classmethod
    def _pooling_items(cls, prompts) -> list[tuple[str | tuple[str, str] | None, list[int] | None]]:
        def is_pair(p) -> bool:
            return isinstance(p, tuple) and len(p) == 2 and all(isinstance(t, str) for t in p)

        if isinstance(prompts, (str, dict)) or is_pair(prompts) or (
                isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        items: list = []
        for p in prompts:
            items.extend([(p, None)] if is_pair(p) else cls._normalize_prompts([p], None))
        return items

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True, truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`--task embed`)."""
        params = msgspec.structs.replace(pooling_params or PoolingParams(), task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in self.encode(prompts, params, use_tqdm,
                                                                         truncate_prompt_tokens)]

    def classify(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
                 use_tqdm: bool = True, truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (a `*ForSequenceClassification` model)."""
        params = msgspec.structs.replace(pooling_params or PoolingParams(), task="classify")
        return [ClassificationRequestOutput.from_base(o) for o in self.encode(prompts, params, use_tqdm,
                                                                              truncate_prompt_tokens)]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """One score per pair (`aserve.scoring.score_pairs`: one-to-one, one-to-many or pairwise): a
        cross-encoder scores each pair in one forward; an embedding model scores the cosine similarity
        of the two texts' embeddings."""
        pairs = score_pairs(text_1, text_2)
        pooling = self.engine.config.pooling
        if pooling is not None and pooling.is_classifier:
            params = msgspec.structs.replace(pooling_params or PoolingParams(), task="score")
            outs = self.encode(pairs, params, use_tqdm, truncate_prompt_tokens)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.data[0] if o.outputs.data else
                                                                     float("nan")), o.prompt_token_ids, o.finished)
                    for o in outs]
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        embedded = dict(zip(texts, self.embed(texts, pooling_params, use_tqdm, truncate_prompt_tokens)))
        return [ScoringRequestOutput(f"{embedded[a].request_id}_{embedded[b].request_id}",
                                     ScoringOutput(cosine_similarity(embedded[a].outputs.embedding,
                                                                     embedded[b].outputs.embedding)),
                                     embedded[a].prompt_token_ids + embedded[b].prompt_token_ids, True)
                for a, b in pairs]

    # -- internals --------------------------------------------------------------------------------
    @staticmethod
    def _normalize_prompts(prompts, prompt_token_ids) -> list[tuple[str | None, list[int] | None]]:
        if prompt_token_ids is not None:
            return [(None, list(p)) for p in prompt_token_ids]
        if prompts is None:
            raise ValueError("prompts: either prompts or prompt_token_ids is required")
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        items = []
        for p in prompts:
            if isinstance(p, str):
                items.append((p, None))
            elif isinstance(p, dict):
                items.append((p.get("prompt"), p.get("prompt_token_ids")))
            elif isinstance(p, (list, tuple)):
                items.append((None, list(p)))
            else:
                raise TypeError(f"prompts: unsupported prompt type {type(p).__name__}")
        return items

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        start, num_out = time.perf_counter(), 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        num_out += sum(len(c.token_ids) for c in out.outputs) if isinstance(out, RequestOutput) \
                            else len(out.prompt_token_ids)
                        if bar is not None:
                            bar.update(1)
                            kind = "output" if isinstance(out, RequestOutput) else "input"
                            bar.set_postfix_str(f"{kind} {num_out / (time.perf_counter() - start):.1f} tok/s")
        finally:
            if bar is not None:
                bar.close()
        return [finished[r] for r in request_ids]
