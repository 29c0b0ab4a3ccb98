"""EngineCore: the scheduler plus an executor, and the pieces both engines (offline, async) share.

`build_engine(args)` resolves the model source, validates the configuration once, loads the
tokenizer and starts the executor (which loads the model and sizes the KV cache).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from aserve.config import AserveConfig, ConfigError, EngineArgs, KVCacheInfo
from aserve.core.batch import EngineCoreOutput, RunnerInfo, RunnerOutput, SchedulerOutput
from aserve.core.request import Request, RequestStatus
from aserve.core.scheduler import Scheduler
from aserve.engine.stats import SchedulerStats
from aserve.executor.base import Executor, cuda_available, make_executor

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler and the executor; `step()` = schedule -> execute -> update."""

    def __init__(self, config: AserveConfig, executor: Executor, info: RunnerInfo):
        self.config = config
        self.executor = executor
        self.info = info
        kv = KVCacheInfo(num_blocks=info.num_blocks, num_cpu_blocks=info.num_cpu_blocks, block_size=info.block_size)
        self.scheduler = Scheduler(config.scheduler, config.cache, kv)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, req_ids: list[str]) -> None:
        self.scheduler.abort_requests(req_ids)

    def finish_stopped(self, req_ids: list[str]) -> None:
        """Samples whose text hit a stop string: finish them and free their blocks now."""
        self.scheduler.finish_requests(req_ids, RequestStatus.FINISHED_STOPPED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def schedule(self) -> SchedulerOutput:
        return self.scheduler.schedule()

    def update(self, so: SchedulerOutput, ro: RunnerOutput) -> list[EngineCoreOutput]:
        return self.scheduler.update(so, ro)

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        so = self.schedule()
        ro = self.executor.execute(so)
        return so, self.update(so, ro)

    def scheduler_stats(self) -> SchedulerStats:
        s = self.scheduler.snapshot()
        return SchedulerStats(
            num_running_reqs=s.num_running_reqs, num_waiting_reqs=s.num_waiting_reqs,
            num_swapped_reqs=s.num_swapped_reqs, kv_cache_usage=s.kv_cache_usage,
            num_used_blocks=s.num_used_blocks, num_total_blocks=s.num_total_blocks,
            num_tokens_in_used_blocks=s.num_tokens_in_used_blocks,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions)

    def shutdown(self) -> None:
        self.executor.shutdown()


@dataclass
class EngineParts:
    config: AserveConfig
    tokenizer: object
    eos_token_ids: tuple[int, ...]
    core: EngineCore
    generation_defaults: dict


def load_tokenizer(config: AserveConfig):
    if config.model.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        config.model.tokenizer, revision=config.model.tokenizer_revision,
        trust_remote_code=config.model.trust_remote_code)


def read_generation_defaults(config: AserveConfig) -> dict:
    """vLLM's --generation-config: 'auto' reads the model's generation_config.json sampling defaults."""
    gc = config.model.generation_config
    if gc == "vllm":
        return {}
    folder = Path(config.model.model_path if gc == "auto" else gc)
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    keys = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
    return {ours: data[theirs] for theirs, ours in keys.items() if theirs in data}


def eos_ids_for(config: AserveConfig, tokenizer) -> tuple[int, ...]:
    ids = list(config.model.arch.eos_token_ids)
    gen = Path(config.model.model_path) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def build_engine(args: EngineArgs, **runner_kwargs) -> EngineParts:
    """Resolve, validate, load. Raises ConfigError / ModelSourceError with a message naming the argument."""
    from aserve.model_source import resolve_model

    start = time.perf_counter()
    model_path = resolve_model(args.model, args.revision, args.download_dir, args.load_format)
    tokenizer_path = args.tokenizer
    if tokenizer_path is not None and not Path(tokenizer_path).exists():
        tokenizer_path = resolve_model(tokenizer_path, args.tokenizer_revision, args.download_dir, "auto")
    config = args.create_config(model_path=model_path, tokenizer_path=tokenizer_path,
                                cuda_available=args.device != "cpu" and cuda_available())
    tokenizer = load_tokenizer(config)
    executor = make_executor(config, **runner_kwargs)
    info = executor.start()
    tokens = (info.num_blocks - 1) * info.block_size  # block 0 is the reserved null block
    if tokens < config.model.max_model_len:
        executor.shutdown()
        raise ConfigError(
            f"--max-model-len: {config.model.max_model_len} tokens do not fit in the KV cache ({tokens} tokens in "
            f"{info.num_blocks - 1} blocks); lower --max-model-len or give the cache more room "
            "(--cpu-kvcache-space, --gpu-memory-utilization, --num-gpu-blocks-override)")
    core = EngineCore(config, executor, info)
    logger.info("Engine ready in %.1fs: %s on %s (%s attention, %s executor); %d KV blocks x %d tokens = %d tokens "
                "(%.1fx max_model_len)", time.perf_counter() - start, config.model.served_model_name,
                info.device, info.attention_backend, config.parallel.distributed_executor_backend,
                info.num_blocks - 1, info.block_size, tokens, tokens / config.model.max_model_len)
    return EngineParts(config=config, tokenizer=tokenizer, eos_token_ids=eos_ids_for(config, tokenizer),
                       core=core, generation_defaults=read_generation_defaults(config))
