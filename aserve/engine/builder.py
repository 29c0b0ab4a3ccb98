"""Building an engine from `EngineArgs`: validate, resolve the model, load the tokenizer, start the
executor (which loads the model and sizes the KV cache), and hand the parts to the engines.

`build_engine(args)` validates every argument that does not need the model's files before it
resolves, downloads or converts anything, so a bad flag is reported at once.
"""

from __future__ import annotations

import json
import concurrent.futures
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from aserve.config import AserveConfig, ConfigError, EngineArgs
from aserve.config.engine_args import SAMPLING_DEFAULT_KEYS
from aserve.engine.engine_core import EngineCore, load_scheduler_class
from aserve.executor.base import Executor, cuda_available, local_gpu_count, make_executor

logger = logging.getLogger(__name__)

ExecutorFactory = Callable[[AserveConfig], Executor]

# generation_config.json key -> SamplingParams field (vLLM's --generation-config auto).
_SAMPLING_DEFAULT_KEYS = SAMPLING_DEFAULT_KEYS


@dataclass
class EngineParts:
    config: AserveConfig
    tokenizer: object
    eos_token_ids: tuple[int, ...]
    core: EngineCore
    generation_defaults: dict


# tokenizer_config.json classes that are exactly transformers' generic fast tokenizer (tokenizer.json
# only); loading them directly skips AutoTokenizer's AutoConfig import chain (seconds at start-up).
_GENERIC_FAST_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(config: AserveConfig):
    """The model's Hugging Face tokenizer (None with --skip-tokenizer-init). A local folder whose
    tokenizer_config.json names the generic fast class is loaded with that class directly (what
    AutoTokenizer would pick, seconds sooner); anything else goes through AutoTokenizer."""
    if config.model.skip_tokenizer_init:
        return None
    kwargs = dict(revision=config.model.tokenizer_revision, trust_remote_code=config.model.trust_remote_code)
    if config.model.tokenizer_mode == "slow":
        return _slow_tokenizer(config.model.tokenizer, kwargs)
    if config.model.tokenizer_mode == "mistral":
        return _mistral_tokenizer(config.model.tokenizer, config.model.tokenizer_revision)
    if _generic_fast_tokenizer(config.model.tokenizer):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(config.model.tokenizer, **kwargs)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.model.tokenizer, **kwargs)


def _mistral_tokenizer(name: str, revision: str | None):
    """--tokenizer-mode mistral: mistral_common's tokenizer (tekken.json or tokenizer.model.v*) behind
    transformers' Hugging Face interface (MistralCommonBackend). Chat prompts are then encoded by
    mistral_common, not a jinja template (server/chat_template.py). ConfigError naming the flag when
    mistral_common is missing or the folder has no Mistral tokenizer file."""
    try:
        import mistral_common  # noqa: F401
    except ImportError:
        raise ConfigError("--tokenizer-mode mistral: needs the mistral_common package "
                          "(pip install 'aserve[mistral]')") from None
    from transformers.tokenization_mistral_common import MistralCommonBackend

    try:
        return MistralCommonBackend.from_pretrained(name, revision=revision or "main",
                                                    local_files_only=os.path.isdir(name))
    except Exception as e:  # noqa: BLE001 - no tekken.json / tokenizer.model.v*, or a bad one
        raise ConfigError(f"--tokenizer-mode mistral: cannot load a Mistral tokenizer from {name!r} "
                          f"({type(e).__name__}: {e})") from None


def _slow_tokenizer(name: str, kwargs: dict):
    """--tokenizer-mode slow: what transformers gives for `use_fast=False`, as vLLM asks (its Python tokenizer where
    it has one; transformers 5 backs most classes by the Rust library either way, which is logged). ConfigError
    naming the flag when it cannot load one."""
    import transformers
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name, use_fast=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - transformers raises several kinds here
        raise ConfigError(f"--tokenizer-mode slow: {name!r} has no slow (Python) tokenizer "
                          f"({type(e).__name__}: {e}); use 'auto'") from None
    if tokenizer.is_fast:
        logger.warning("--tokenizer-mode slow: transformers %s has no Python tokenizer for %s; %s (Rust-backed) "
                       "serves it, as with vLLM on this transformers", transformers.__version__, name,
                       type(tokenizer).__name__)
    return tokenizer


def _generic_fast_tokenizer(folder: str) -> bool:
    path = Path(folder)
    if not (path / "tokenizer.json").is_file() or not (path / "tokenizer_config.json").is_file():
        return False
    try:
        declared = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return False
    return declared in _GENERIC_FAST_TOKENIZERS


def read_generation_config(folder: str | Path) -> dict:
    """The folder's generation_config.json as a dict ({} when there is none)."""
    path = Path(folder) / "generation_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def generation_defaults(config: AserveConfig, model_generation_config: dict) -> dict:
    """Sampling defaults per --generation-config: `auto` = the model's file, `vllm` = none, else a folder;
    then --override-generation-config's keys over them (as vLLM: with `vllm` too)."""
    source = config.model.generation_config
    if source == "vllm":
        data = {}
    else:
        data = model_generation_config if source == "auto" else read_generation_config(source)
    data = {**data, **(config.model.override_generation_config or {})}
    return {ours: data[theirs] for theirs, ours in _SAMPLING_DEFAULT_KEYS.items() if data.get(theirs) is not None}


def check_sampling_overrides(args: EngineArgs) -> None:
    """ConfigError naming --override-generation-config when a value is one SamplingParams refuses."""
    from aserve.sampling_params import SamplingParams

    try:
        SamplingParams(**args.sampling_overrides())
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"--override-generation-config: {exc}") from None


def eos_token_ids(config: AserveConfig, model_generation_config: dict, tokenizer) -> tuple[int, ...]:
    """The model config's EOS ids, then the generation config's, then the tokenizer's (deduplicated)."""
    ids = list(config.model.arch.eos_token_ids)
    eos = model_generation_config.get("eos_token_id")
    ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def build_engine(args: EngineArgs, executor_factory: ExecutorFactory = make_executor) -> EngineParts:
    """Validate, resolve, load. Raises ConfigError / ModelSourceError with a message naming the argument.

    `executor_factory(config)` makes the (unstarted) executor; tests hand in one whose runner is fake.
    """
    from aserve.config.observability import resolve_observability
    from aserve.config.speculative import draft_model_name
    from aserve.engine.tracing import check_otel_available
    from aserve.model_source import resolve_model

    args.validate()  # before any model work: a bad flag is reported at once
    check_otel_available(resolve_observability(args.otlp_traces_endpoint, args.collect_detailed_traces))
    check_sampling_overrides(args)
    start = time.perf_counter()
    model_path = resolve_model(args.model, args.revision, args.download_dir, args.load_format,
                               ignore_patterns=args.resolved_ignore_patterns())
    tokenizer_path = args.tokenizer
    if tokenizer_path is not None and not Path(tokenizer_path).exists():
        tokenizer_path = resolve_model(tokenizer_path, args.tokenizer_revision, args.download_dir, "auto")
    draft = draft_model_name(args)  # speculative decoding's draft model resolves like --model
    draft_path = resolve_model(draft, None, args.download_dir, "auto") if draft else None
    on_cuda = args.device != "cpu" and cuda_available()
    config = args.create_config(model_path=model_path, tokenizer_path=tokenizer_path, cuda_available=on_cuda,
                                draft_model_path=draft_path, num_local_gpus=local_gpu_count() if on_cuda else None)
    load_scheduler_class(config.scheduler.scheduler_cls)  # before the model loads: a bad path fails at once
    # The tokenizer (~1 s, mostly imports) loads on a thread while the executor starts the model (a
    # worker process spends ~2 s importing torch before it loads anything): start-up overlaps them.
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aserve-tokenizer") as pool:
        tokenizer_future = pool.submit(load_tokenizer, config)
        executor = executor_factory(config)
        try:
            info = executor.start()
        except BaseException:
            tokenizer_future.cancel()
            raise
        try:
            tokenizer = tokenizer_future.result()
        except BaseException:  # a tokenizer that cannot load (--tokenizer-mode slow without one): no leaked worker
            executor.shutdown()
            raise
    tokens = (info.num_blocks - 1) * info.block_size  # block 0 is the reserved null block
    if tokens < config.model.max_model_len:
        executor.shutdown()
        raise ConfigError(
            f"--max-model-len: {config.model.max_model_len} tokens do not fit in the KV cache ({tokens} tokens in "
            f"{info.num_blocks - 1} blocks); lower --max-model-len or give the cache more room "
            "(--cpu-kvcache-space, --gpu-memory-utilization, --kv-cache-memory-bytes, --num-gpu-blocks-override)")
    core = EngineCore(config, executor, info)
    logger.info("Engine ready in %.1fs: %s on %s (%s attention, %s executor); %d KV blocks x %d tokens = %d tokens "
                "(%.1fx max_model_len)", time.perf_counter() - start, config.model.served_model_name,
                info.device, info.attention_backend, config.parallel.distributed_executor_backend,
                info.num_blocks - 1, info.block_size, tokens, tokens / config.model.max_model_len)
    model_generation_config = read_generation_config(config.model.model_path)
    return EngineParts(config=config, tokenizer=tokenizer,
                       eos_token_ids=eos_token_ids(config, model_generation_config, tokenizer),
                       core=core, generation_defaults=generation_defaults(config, model_generation_config))
