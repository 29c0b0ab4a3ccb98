"""`aserve` command-line arguments: engine flags generated from `EngineArgs`, plus server flags.

Engine flags are generated from the `EngineArgs` dataclass fields (vLLM spellings: `max_model_len`
-> `--max-model-len`), so they never drift from the engine's arguments. Booleans that default to
True get a `--no-...` form; dict-valued fields take JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any

from aserve.config import BUNDLED_MODEL_NAME, EngineArgs
from aserve.server.lora_modules import LoRAModule, parse_lora_modules
from aserve.server.user_middleware import load_middleware
from aserve.config.engine_args import LOAD_FORMATS
from aserve.config.resolve import _DEFAULT_TOKEN_BUDGET
from aserve.config.vllm_compat import add_compat_arguments, apply_compat
from aserve.server.chat_template import CONTENT_FORMATS
from aserve.server.help_groups import HelpAction, regroup
from aserve.server.reasoning import REASONING_PARSERS
from aserve.server.tool_parsers import TOOL_PARSERS

TOOL_PARSER_NAMES = tuple(sorted(TOOL_PARSERS))
REASONING_PARSER_NAMES = tuple(sorted(REASONING_PARSERS))

_ENGINE_HELP = {
    "model": "model name, Hugging Face folder or .gguf file",
    "served_model_name": "the model name(s) the API answers to",
    "max_model_len": "context length",
    "block_size": "tokens per KV-cache block",
    "enable_prefix_caching": "reuse KV blocks of shared prompt prefixes",
    "max_num_seqs": "maximum requests in one batch",
    "max_num_batched_tokens": "token budget per engine step",
    "dtype": "weight/activation dtype: auto, half, float16, bfloat16, float, float32",
    "kv_cache_dtype": "KV-cache dtype: auto, fp8, fp8_e4m3, fp8_e5m2",
    "quantization_param_path": "fp8 KV cache: a JSON of per-layer scales (vLLM's format: kv_cache.scaling_factor, "
                               "tensor-parallel rank -> layer -> scale for K and V); needs --kv-cache-dtype fp8",
    "calculate_kv_scales": "fp8 KV cache: compute each layer's K and V scales from the first batch (amax over "
                           "the fp8 maximum), then keep them; needs --kv-cache-dtype fp8",
    "num_gpu_blocks_override": "use this many KV blocks instead of profiling",
    "distributed_executor_backend": "where the model runner lives: uni (a thread) or mp (a process per "
                                    "tensor-parallel rank; the default with -tp > 1); ray is not implemented",
    "disable_async_output_proc": "do not overlap output processing with the next step",
    "enable_sleep_mode": "serve POST /sleep?level=1|2, POST /wake_up and GET /is_sleeping: release the KV "
                         "cache (level 2: the weights too) while idle",
    "enforce_eager": "never capture CUDA graphs (the same as -O0)",
    "compilation_config": "-O / -O3: a compilation level (0 eager, 3 compiled: CUDA graphs on CUDA, an "
                          "inductor-compiled decode on CPU) or a JSON object {\"level\": 3, \"compile_sizes\": [1]}",
    "hf_overrides": "JSON object merged into the model's config.json",
    "rope_scaling": 'JSON object, e.g. \'{"rope_type": "linear", "factor": 2.0}\'',
    "disable_log_stats": "no periodic stats log line",
    "tensor_parallel_size": "tensor-parallel degree: split each layer across this many worker processes "
                            "(one per rank, mp backend; gloo on CPU, NCCL on CUDA)",
    "pipeline_parallel_size": "pipeline-parallel degree (only 1 is implemented)",
    "data_parallel_size": "engine replicas behind one server, each with its own workers and KV cache; requests "
                          "go to the least loaded one, or to the one holding their prompt's prefix",
    "data_parallel_rank": "which replica this engine is (aserve sets it for each replica; on CUDA replica r uses "
                          "devices r*tp .. r*tp+tp-1)",
    "guided_decoding_backend": "grammar engine for structured outputs: auto, xgrammar or guidance "
    "(a request's guided_decoding_backend overrides it), with vLLM's options after a colon for every request: "
    "disable-any-whitespace, disable-additional-properties, no-fallback (e.g. xgrammar:disable-any-whitespace)",
    "structured_outputs_config": 'vLLM\'s newer spelling, a JSON object: backend, disable_any_whitespace, '
    'disable_additional_properties, disable_fallback, reasoning_parser (= --reasoning-parser), e.g. '
    '\'{"backend": "xgrammar", "disable_any_whitespace": true}\'',
    "model_impl": "auto: aserve's native class when there is one, else the Transformers backend; aserve: native "
                  "only; transformers: always transformers' modeling code with aserve's paged attention",
    "tokenizer": "tokenizer name or folder",
    "tokenizer_mode": "auto (the fast tokenizer) or slow (transformers' Python tokenizer, when the model has one)",
    "skip_tokenizer_init": "load no tokenizer: prompts must be token ids, outputs carry token ids only",
    "revision": "Hub revision (branch, tag or commit) of the model",
    "tokenizer_revision": "Hub revision of the tokenizer",
    "trust_remote_code": "accept models whose config asks for remote code (aserve runs none: it uses its native "
                         "classes or the Transformers backend)",
    "download_dir": "where Hub downloads go",
    "load_format": f"weight file format: {', '.join(LOAD_FORMATS)} (dummy: random weights; npcache: numpy copies "
                   "cached on the first load and memory-mapped afterwards; tensorizer: a .tensors file named by "
                   "--model-loader-extra-config's tensorizer_uri)",
    "seed": "random seed of sampling",
    "swap_space": "CPU swap space per GPU in GiB (used by --preemption-mode swap)",
    "cpu_offload_gb": "CUDA: GiB of weights (whole decoder layers) kept in pinned CPU memory and streamed to the "
                      "GPU each forward pass (turns CUDA graphs off; refused on CPU)",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and the KV cache",
    "cpu_kvcache_space": "KV-cache size in GiB on CPU",
    "max_logprobs": "the most logprobs a request may ask for",
    "max_seq_len_to_capture": "longest sequence CUDA graphs cover; longer ones run eager",
    "enable_chunked_prefill": "split long prompts into chunks of the --max-num-batched-tokens budget",
    "preemption_mode": "what frees KV blocks when the cache is full: recompute or swap",
    "scheduling_policy": "fcfs, or priority (by the request's priority field)",
    "rope_theta": "RoPE base (overrides the model's)",
    "generation_config": "sampling defaults: auto (the model's generation_config.json), vllm (none) or a folder "
                         "holding generation_config.json",
    "device": "auto, cpu or cuda (auto: cuda when available)",
    "attention_backend": "attention kernels: torch or triton",
    "quantization": "weight quantization: int8 (weight_only_int8) / int4 / fp8 / bitsandbytes (quantized at "
                    "load), gguf, or a quantized checkpoint's format (gptq, awq, compressed-tensors, fp8, "
                    "bitsandbytes; smooth_quant: a compressed-tensors W8A8 checkpoint)",
    "disable_sliding_window": "full attention instead of the model's sliding window",
    "override_generation_config": "JSON object of generation_config.json keys (temperature, top_p, top_k, min_p, "
                                  "repetition_penalty, max_new_tokens) over the --generation-config defaults",
    "hf_config_path": "a folder whose config.json is read instead of the model's",
    "config_format": "auto or hf: Hugging Face config.json (mistral's params.json is refused)",
    "ignore_patterns": "weight files to skip (fnmatch globs inside the model folder; also not downloaded)",
    "code_revision": "Hub revision of the model's remote code (refused with --trust-remote-code)",
    "model_loader_extra_config": "JSON object of loader options: enable_multithread_load / num_threads (files "
                                 "read on threads); tensorizer_uri / num_readers / verify_hash (--load-format "
                                 "tensorizer)",
    "max_parallel_loading_workers": "with tensor parallelism, at most this many ranks read weights at once",
    "kv_cache_memory_bytes": "KV-cache size in bytes (beats the --gpu-memory-utilization sizing)",
    "tokenizer_pool_size": "threads that tokenize and render chat templates, each with its own tokenizer copy "
                           "(0 or 1: one), so long prompts do not queue behind one another",
    "tokenizer_pool_type": "'thread' (vLLM's 'ray' is refused: aserve's pool runs threads)",
    "tokenizer_pool_extra_config": "refused when set: the thread pool takes no options",
    "logits_processor_pattern": "a regex: requests may name logits processors (qualified names matching it) in "
                                "logits_processors; none by default",
    "enable_lora": "serve LoRA adapters (--lora-modules, or loaded at run time)",
    "enable_lora_bias": "accept adapters whose lora_B has a bias",
    "max_loras": "the most adapters active in one batch (more wait for a free slot)",
    "max_lora_rank": "the largest adapter rank accepted",
    "max_cpu_loras": "adapters kept loaded in host memory (least recently used evicted)",
    "lora_dtype": "dtype of the LoRA weights: auto (the model's), float16, bfloat16, float32",
    "lora_extra_vocab_size": "extra vocabulary an adapter may add (adapters adding tokens are refused)",
    "fully_sharded_loras": "shard both LoRA matmuls across tensor-parallel ranks (no-op with one rank; refused with more)",
    "long_lora_scaling_factors": "LongLoRA scaling factors (refused: LongLoRA is not implemented)",
    "qlora_adapter_name_or_path": "a QLoRA adapter over a bitsandbytes base (refused: not implemented)",
    "scheduler_delay_factor": "while requests run, admit new prompts only after factor x the last prompt step's "
                              "latency (batches arrivals into fewer prefill steps)",
    "max_num_partial_prefills": "prefills whose chunk does not finish their prompt, per step",
    "max_long_partial_prefills": "of those, how many may be long (over --long-prefill-token-threshold), so "
                                 "short prompts get through while long ones prefill",
    "long_prefill_token_threshold": "a prompt longer than this is long; each prefill chunk is capped at it",
    "scheduler_cls": "a Scheduler subclass by dotted path (package.module.Class), checked at start-up",
    "num_scheduler_steps": "multi-step decode: when every scheduled request is decoding, run up to N decode "
                           "steps per scheduling call (fewer scheduler and IPC round trips per token)",
    "multi_step_stream_outputs": "stream each decode step's tokens as it runs (--no-multi-step-stream-outputs: "
                                 "all of a multi-step call's tokens at its end)",
    "task": "what the model serves: auto, generate, embed (alias embedding), classify, score (a cross-encoder) "
            "or encode (raw pooled states)",
    "runner": "auto, generate or pooling (pooling serves any supported causal family as a last-token embedder)",
    "override_pooler_config": 'JSON object over the model\'s pooling: pooling_type (LAST, MEAN, CLS, ALL), '
                              "normalize, softmax, dimensions (alias --pooler-config)",
    "speculative_config": 'speculative decoding, a JSON object with vLLM\'s keys: method (ngram or draft_model), '
                          "num_speculative_tokens, prompt_lookup_max/min (ngram), model (a draft sharing the "
                          "vocabulary), max_model_len, disable_by_batch_size, acceptance_method, disable_logprobs; "
                          'e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\'',
    "num_lookahead_slots": "KV slots reserved past each request's scheduled tokens (at least a draft model's "
                           "num_speculative_tokens)",
    "otlp_traces_endpoint": "send an OpenTelemetry span (llm_request) per request to this OTLP endpoint: "
                            "http(s)://host:4318[/v1/traces] is OTLP/HTTP, grpc://host:4317 or host:4317 OTLP/gRPC "
                            "($OTEL_EXPORTER_OTLP_TRACES_PROTOCOL overrides); needs pip install 'aserve[otel]'",
    "collect_detailed_traces": "add per-request model timings to the spans: model (time in the forward pass), "
                               "worker (time in the executor's step), all; comma-separated; needs "
                               "--otlp-traces-endpoint",
}
# The default shown when the field's own default (often None) is resolved later (aserve/config/resolve.py).
_ENGINE_DEFAULTS = {
    "model": f"'', the bundled {BUNDLED_MODEL_NAME}",
    "tokenizer": "the --model",
    "max_model_len": "from the model's config.json",
    "served_model_name": "the --model name",
    "download_dir": "the Hugging Face cache",
    "cpu_kvcache_space": "$ASERVE_CPU_KVCACHE_SPACE, else $VLLM_CPU_KVCACHE_SPACE, else 4",
    "max_num_batched_tokens": f"{_DEFAULT_TOKEN_BUDGET['cpu']} on CPU, {_DEFAULT_TOKEN_BUDGET['cuda']} on CUDA; "
                              "without chunked prefill at least --max-model-len",
    "enable_chunked_prefill": "True",
    "preemption_mode": "'recompute'",
    "rope_theta": "the model's",
    "distributed_executor_backend": "'uni'; 'mp' with -tp > 1",
    "attention_backend": "'triton' on CUDA, 'torch' on CPU",
    "compilation_config": "level 3 on CUDA (CUDA graphs), 0 (eager) on CPU",
    "quantization": "the checkpoint's own quantization_config, if any (a float checkpoint: none; "
                    "--load-format bitsandbytes: bitsandbytes)",
    "hf_overrides": "{}: config.json as it is",
    "rope_scaling": "None: the model's",
    "override_generation_config": "{}: no overrides",
    "hf_config_path": "None: the model's config.json",
    "kv_cache_memory_bytes": "None: sized by --gpu-memory-utilization / --cpu-kvcache-space",
    "num_gpu_blocks_override": "None: as many as fit",
    "structured_outputs_config": "None: --guided-decoding-backend",
    "revision": "None: the latest",
    "tokenizer_revision": "None: the latest",
    "code_revision": "None: the latest",
    "model_loader_extra_config": "None: one thread; tensorizer needs tensorizer_uri",
    "max_parallel_loading_workers": "None: every rank at once",
    "max_cpu_loras": "None: --max-loras",
    "long_prefill_token_threshold": "0: no cap (4%% of --max-model-len with --max-num-partial-prefills > 1)",
    "scheduler_cls": "None: aserve.core.scheduler.Scheduler (vLLM's default names mean the same)",
    "task": "'auto': generate for causal LMs, embed (classify for a classifier head) for encoders",
    "override_pooler_config": "None: the model's (sentence-transformers files, else the architecture's)",
    "speculative_config": "None: no speculative decoding",
}
_SHORT_ALIASES = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp", "data_parallel_size": "-dp",
                  "compilation_config": "-O", "quantization": "-q"}


@dataclass(frozen=True)
class ServerArgs:
    """Everything the HTTP side needs; engine arguments live in `EngineArgs`."""

    host: str | None = None  # None: all interfaces
    port: int = 8000
    api_key: str | tuple[str, ...] | None = None  # several keys: the batch is shared fairly between them
    chat_template: str | None = None
    chat_template_content_format: str = "auto"  # auto = string (text parts joined); openai = a list of parts
    response_role: str = "assistant"
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE; 1 = CERT_OPTIONAL, 2 = CERT_REQUIRED (client certificates)
    uvicorn_log_level: str = "info"
    log_level: str = "info"
    disable_log_requests: bool = False
    max_log_len: int | None = None
    disable_log_stats: bool = False
    stats_log_interval: float = 5.0
    shutdown_grace_period: float = 30.0
    max_num_queued_reqs: int = 0  # 0: unbounded
    max_num_queued_tokens: int = 0  # 0: unbounded
    max_request_body_bytes: int = 32 * 1024 * 1024  # 0: unbounded
    request_timeout: float | None = None  # seconds; None: no timeout
    metrics_prefix: str = "vllm"  # the prefix of every Prometheus name: vllm or aserve
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens in replies

    lora_modules: tuple[LoRAModule, ...] = ()  # adapters loaded before serving (aserve/server/lora.py)
    middleware: tuple[str, ...] = ()  # ASGI middleware by dotted path, in order (aserve/server/user_middleware.py)

    # tool calling and reasoning (issue 12)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    enable_reasoning: bool = False
    reasoning_parser: str | None = None

    @property
    def api_keys(self) -> tuple[str, ...]:
        """Every accepted API key (empty: no key needed)."""
        if not self.api_key:
            return ()
        return (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key)


_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# Defaults shown in --help where the value's repr says less (the server's and vLLM-compat flags).
_SERVER_DEFAULTS = {
    "api_key": "None: $ASERVE_API_KEY or $VLLM_API_KEY, else no key needed",
    "chat_template": "None: the tokenizer's",
    "max_log_len": "None: no limit",
    "ssl_keyfile": "None: plain HTTP",
    "ssl_certfile": "None: plain HTTP",
    "model_tag": "None: --model",
}


def _json_object(flag: str):
    def parse(text: str) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{flag}: not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{flag}: expected a JSON object, got {type(value).__name__}")
        return value

    parse.__name__ = "JSON object"
    return parse


def _json_str_list(flag: str):
    def parse(text: str) -> tuple[str, ...]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{flag}: not valid JSON ({exc})") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"{flag}: expected a JSON list of strings, e.g. '[\"*\"]'")
        return tuple(value)

    parse.__name__ = "JSON list"
    return parse


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True
    return tp, False


_JSON_TEXT_FIELDS = ("speculative_config", "model_loader_extra_config")  # dict | str: a JSON object on the CLI


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per `EngineArgs` field, typed from the field's annotation."""
    group = parser.add_argument_group("engine arguments (aserve.config.EngineArgs)")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        names = [flag] + ([_SHORT_ALIASES[f.name]] if f.name in _SHORT_ALIASES else [])
        default = f.default
        help_text = _ENGINE_HELP[f.name]  # a KeyError: describe the new field in _ENGINE_HELP
        help_text += f" (default: {_ENGINE_DEFAULTS.get(f.name, repr(default))})"
        tp, optional = _unwrap_optional(hints[f.name])
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": help_text}
        if f.name == "compilation_config":
            kwargs["type"] = str  # a level or a JSON object; EngineArgs.validate parses it
        elif tp is bool:
            if default is True or (optional and default is None):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["action"] = "store_true"
        elif typing.get_origin(tp) is dict or f.name in _JSON_TEXT_FIELDS:
            kwargs["type"] = _json_object(flag)
        elif typing.get_origin(tp) is list:  # list[float]: one or more numbers
            kwargs["nargs"], kwargs["type"] = "+", typing.get_args(tp)[0]
        elif typing.get_args(tp) and list in {typing.get_origin(a) for a in typing.get_args(tp)}:
            kwargs["nargs"] = "+"  # str | list[str]: one or more names
        elif tp in (int, float, str):
            kwargs["type"] = tp
        else:
            raise TypeError(f"EngineArgs.{f.name}: no command-line mapping for type {hints[f.name]!r}")
        group.add_argument(*names, **kwargs)


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server arguments")
    g.add_argument("--host", default=None, help="address to bind (default: all interfaces)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (also env ASERVE_API_KEY or VLLM_API_KEY); "
        "give it several times to accept several keys, which then share the batch fairly",
    )
    g.add_argument("--middleware", action="append", default=None,
                   help="dotted path of an ASGI middleware class or an 'async def f(request, call_next)' "
                   "function, applied in the order given (repeat the flag for several)")
    g.add_argument(
        "--chat-template",
        default=None,
        help="chat template file or inline jinja template (overrides the tokenizer's)",
    )
    g.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=CONTENT_FORMATS,
        help="how message content reaches the chat template: string (text parts joined with newlines), "
        "openai (a list of {\"type\": \"text\", \"text\": ...} parts, a string content as one part); "
        "auto = string (default: auto)",
    )
    g.add_argument("--response-role", default="assistant", help="role of generated chat messages")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help='LoRA adapters to serve (needs --enable-lora), each name=path or a JSON object '
                   '{"name": ..., "path": ..., "base_model_name": ...}; a request names one as its model')
    g.add_argument(
        "--allowed-origins",
        type=_json_str_list("--allowed-origins"),
        default=("*",),
        help='CORS origins, a JSON list (default: ["*"])',
    )
    g.add_argument(
        "--allowed-methods",
        type=_json_str_list("--allowed-methods"),
        default=("*",),
        help='CORS methods, a JSON list (default: ["*"])',
    )
    g.add_argument(
        "--allowed-headers",
        type=_json_str_list("--allowed-headers"),
        default=("*",),
        help='CORS headers, a JSON list (default: ["*"])',
    )
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--root-path", default="", help="path prefix when served behind a path-based proxy")
    g.add_argument("--ssl-keyfile", default=None, help="TLS private key file")
    g.add_argument("--ssl-certfile", default=None, help="TLS certificate file")
    g.add_argument(
        "--ssl-ca-certs",
        default=None,
        help="CA certificates that client certificates are verified against (needs --ssl-cert-reqs 1 or 2)",
    )
    g.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        choices=(0, 1, 2),
        help="client certificates, as Python's ssl module numbers them: 0 = not requested (CERT_NONE), "
        "1 = verified when sent (CERT_OPTIONAL), 2 = required (CERT_REQUIRED) (default: 0)",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=_LOG_LEVELS,
        help="log level of the HTTP server, which is hypercorn (aserve keeps vLLM's flag name; "
        "'info' and below also turn on hypercorn's access log) (default: info)",
    )
    g.add_argument("--log-level", default="info", choices=_LOG_LEVELS, help="log level of aserve")
    g.add_argument("--disable-log-requests", action="store_true", help="no log line per request")
    g.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="cut logged prompts (characters) and prompt token ids to this length",
    )
    g.add_argument(
        "--stats-log-interval", type=float, default=5.0, help="seconds between stats log lines (default: 5)"
    )
    g.add_argument(
        "--shutdown-grace-period",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGINT/SIGTERM (default: 30)",
    )
    g.add_argument(
        "--max-num-queued-reqs",
        type=int,
        default=0,
        help="answer 429 (with Retry-After) when this many requests are already waiting or running; "
        "a request with n samples counts n (default: 0 = unbounded)",
    )
    g.add_argument(
        "--max-num-queued-tokens",
        type=int,
        default=0,
        help="answer 429 (with Retry-After) when the prompt tokens not yet computed would exceed this "
        "(default: 0 = unbounded)",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=32 * 1024 * 1024,
        help="answer 413 to a larger request body, before reading it all (default: 32 MiB; 0 = unbounded)",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="abort a request still generating after this many seconds: 504 (code 'timeout'), or an SSE "
        "error event once streaming (default: no timeout)",
    )
    g.add_argument("--metrics-prefix", default="vllm", choices=("vllm", "aserve"),
                   help="prefix of every /metrics name: vllm (vLLM's dashboards and alerts work unchanged) or "
                   "aserve (default: vllm)")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (prompt tokens found in the prefix "
                   "cache) in completions and chat replies")


def add_tool_and_reasoning_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tool calling and reasoning")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='parse tool calls out of the output under tool_choice "auto" (needs --tool-call-parser)')
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSER_NAMES,
                   help="how tool calls are written in the model's output")
    g.add_argument("--enable-reasoning", action="store_true",
                   help="return reasoning as reasoning_content (needs --reasoning-parser)")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSER_NAMES,
                   help="how the model marks its reasoning (implies --enable-reasoning)")


def make_parser(serve_command: bool = False) -> argparse.ArgumentParser:
    """The `aserve [flags]` parser; `serve_command`: vLLM's `aserve serve [MODEL] [flags]` form, whose
    optional positional MODEL is the same as --model."""
    from aserve import __version__

    parser = argparse.ArgumentParser(
        prog="aserve serve" if serve_command else "aserve",
        usage="%(prog)s " + ("[MODEL] " if serve_command else "") + "[flags]   (aserve --help=listgroup: the flag "
              "groups; aserve --help=<group>: one group)",
        description="OpenAI-compatible LLM server (aserve). `aserve serve [MODEL] [flags]` (vLLM's form) "
        "and `aserve [flags]` are the same command. The flags are grouped as vLLM groups them: "
        "--help=<group> shows one group, --help=listgroup lists the groups.",
        add_help=False,
    )
    parser.add_argument("-h", "--help", action=HelpAction)
    parser.add_argument("--version", action="version", version=f"aserve {__version__}",
                        help="show the version and exit")
    if serve_command:
        parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                            help="the model to serve, as --model (vLLM's `serve MODEL` form)")
    add_engine_arguments(parser)
    add_server_arguments(parser)
    add_tool_and_reasoning_arguments(parser)
    add_compat_arguments(parser)  # vLLM names aserve aliases or refuses (aserve/config/vllm_compat.py)
    regroup(parser)  # each flag into its topic's group, as vLLM's --help (aserve/server/help_groups.py)
    for action in parser._actions:  # every flag's help ends with its default, once
        if action.dest not in ("help", "version") and "(default:" not in (action.help or ""):
            action.help = f"{action.help} (default: {_SERVER_DEFAULTS.get(action.dest, repr(action.default))})"
    return parser


def split_namespace(
    ns: argparse.Namespace, environ: typing.Mapping[str, str] | None = None
) -> tuple[EngineArgs, ServerArgs]:
    """Split parsed flags into `EngineArgs` and `ServerArgs` (the API key may come from the environment)."""
    environ = os.environ if environ is None else environ
    values = apply_compat(dict(vars(ns)), server=True)  # aliases set their targets; refusals raise
    model_tag = values.pop("model_tag", None)
    if model_tag is not None:  # `aserve serve MODEL`
        if values.get("model") not in ("", model_tag):
            raise ValueError(f"the model is given twice: {model_tag!r} (after `serve`) and --model "
                             f"{values['model']!r}; give one")
        values["model"] = model_tag
    engine_names = EngineArgs.field_names()
    engine_args = EngineArgs(**{k: v for k, v in values.items() if k in engine_names})
    if isinstance(engine_args.served_model_name, list) and len(engine_args.served_model_name) == 1:
        engine_args.served_model_name = engine_args.served_model_name[0]
    server_names = {f.name for f in dataclasses.fields(ServerArgs)}
    server_values = {k: v for k, v in values.items() if k in server_names}
    server_values["disable_log_stats"] = engine_args.disable_log_stats
    keys = server_values.get("api_key")
    if isinstance(keys, list):  # --api-key given once or more (action="append")
        server_values["api_key"] = keys[0] if len(keys) == 1 else tuple(keys)
    if not server_values.get("api_key"):
        server_values["api_key"] = environ.get("ASERVE_API_KEY") or environ.get("VLLM_API_KEY") or None
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        server_values[name] = tuple(server_values[name])
    server_values["middleware"] = tuple(server_values.get("middleware") or ())
    server_values["lora_modules"] = parse_lora_modules(server_values.get("lora_modules"))
    if server_values["lora_modules"] and not engine_args.enable_lora:
        raise ValueError("--lora-modules: needs --enable-lora")
    parser = (engine_args.structured_outputs_config or {}).get("reasoning_parser")
    if parser is not None:  # vLLM's newer home of --reasoning-parser: the same setting
        given = server_values.get("reasoning_parser")
        if parser not in REASONING_PARSER_NAMES:
            raise ValueError(f"--structured-outputs-config: reasoning_parser must be one of "
                             f"{REASONING_PARSER_NAMES}, got {parser!r}")
        if given is not None and given != parser:
            raise ValueError(f"--structured-outputs-config: reasoning_parser {parser!r} contradicts "
                             f"--reasoning-parser {given!r}")
        server_values["reasoning_parser"] = parser
    if server_values.get("reasoning_parser"):
        server_values["enable_reasoning"] = True  # vLLM: --reasoning-parser implies it
    server_args = ServerArgs(**server_values)
    validate_server_args(server_args)
    return engine_args, server_args


def validate_server_args(args: ServerArgs) -> None:
    """Raise ValueError naming the flag for a bad combination."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port: must be in [0, 65535], got {args.port}")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len: must be >= 0, got {args.max_log_len}")
    for name in ("max_num_queued_reqs", "max_num_queued_tokens", "max_request_body_bytes"):
        value = getattr(args, name)
        if value < 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 0 (0 = unbounded), got {value}")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise ValueError(f"--request-timeout: must be > 0 seconds, got {args.request_timeout}")
    if any(not key for key in args.api_keys):
        raise ValueError("--api-key: must not be empty")
    if args.shutdown_grace_period < 0:
        raise ValueError(f"--shutdown-grace-period: must be >= 0, got {args.shutdown_grace_period}")
    if args.stats_log_interval <= 0:
        raise ValueError(f"--stats-log-interval: must be > 0, got {args.stats_log_interval}")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile must be given together")
    if args.ssl_ca_certs and not args.ssl_certfile:
        raise ValueError("--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile")
    if args.ssl_cert_reqs not in (0, 1, 2):
        raise ValueError(f"--ssl-cert-reqs: must be 0, 1 or 2, got {args.ssl_cert_reqs}")
    if args.ssl_ca_certs and args.ssl_cert_reqs == 0:
        raise ValueError(
            "--ssl-ca-certs is only used to verify client certificates, which --ssl-cert-reqs 0 (the "
            "default) never requests: add --ssl-cert-reqs 1 (optional) or 2 (required)"
        )
    if args.ssl_cert_reqs and not args.ssl_ca_certs:
        raise ValueError(
            f"--ssl-cert-reqs {args.ssl_cert_reqs} needs --ssl-ca-certs to verify client certificates against"
        )
    if args.root_path and (not args.root_path.startswith("/") or args.root_path.endswith("/")):
        raise ValueError(f"--root-path: must start with '/' and not end with '/', got {args.root_path!r}")
    if args.chat_template_content_format not in CONTENT_FORMATS:
        raise ValueError(f"--chat-template-content-format: must be one of {CONTENT_FORMATS}, "
                         f"got {args.chat_template_content_format!r}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or mistral)")
    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_PARSER_NAMES:
        raise ValueError(f"--tool-call-parser: must be one of {TOOL_PARSER_NAMES}, got {args.tool_call_parser!r}")
    if args.enable_reasoning and not args.reasoning_parser:
        raise ValueError("--enable-reasoning needs --reasoning-parser (deepseek_r1 or qwen3)")
    if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSER_NAMES:
        raise ValueError(f"--reasoning-parser: must be one of {REASONING_PARSER_NAMES}, got {args.reasoning_parser!r}")
    load_middleware(args.middleware)  # importable and of a usable kind, before the model loads


def parse_args(
    argv: list[str] | None = None, environ: typing.Mapping[str, str] | None = None
) -> tuple[EngineArgs, ServerArgs]:
    """Parses `aserve [flags]` or vLLM's `aserve serve [MODEL] [flags]` (argv without the program name;
    None: sys.argv[1:]). Exits with status 2 and a usage line for bad flags, 0 after --help / --version."""
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_command = bool(argv) and argv[0] == "serve"
    parser = make_parser(serve_command)
    ns = parser.parse_args(argv[1:] if serve_command else argv)
    try:
        return split_namespace(ns, environ)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
