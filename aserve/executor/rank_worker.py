"""One rank's model runner as an executor hosts it: a worker process (`mp`, executor/process.py) or a
Ray actor (`ray`, executor/ray_executor.py). Both speak msgspec msgpack bytes to it, so the two
executors share one implementation of start-up, steps and the between-step calls.

Torch and the runner are imported in `start()`, inside the host (the engine's process never loads
them for this). An adapter failure is reported, never raised (`LoRAReply`); anything else raised by
a method is fatal for the executor.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import msgspec

from aserve.config import AserveConfig
from aserve.core.batch import RunnerInfo, RunnerOutput, SchedulerOutput
from aserve.distributed.rendezvous import Rendezvous
from aserve.lora.errors import LoRAAdapterError
from aserve.lora.request import LoRARequest

_encoder = msgspec.msgpack.Encoder()
_decode_so = msgspec.msgpack.Decoder(SchedulerOutput)
_decode_lora = msgspec.msgpack.Decoder(LoRARequest)
_decode_tags = msgspec.msgpack.Decoder(list[str] | None)


def limit_threads(num_ranks: int) -> None:
    """With several ranks on one CPU, each gets an equal share of the cores (at most what
    OMP_NUM_THREADS asks for), so ranks do not oversubscribe them. Before torch is imported."""
    if num_ranks == 1:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = max(1, cores // num_ranks)
    asked = os.environ.get("OMP_NUM_THREADS", "")
    threads = min(share, int(asked)) if asked.isdigit() and int(asked) > 0 else share
    os.environ["OMP_NUM_THREADS"] = str(threads)


class LoRAReply(msgspec.Struct, array_like=True):
    """An adapter call's result: `error` set when the adapter was refused (the worker is unharmed)."""

    ok: bool
    error: str | None = None


def output_rank(config: AserveConfig) -> int:
    """The rank whose `RunnerOutput` the executor returns: the first of the last pipeline stage (every
    rank of that stage samples the same tokens; earlier stages sample none)."""
    parallel = config.parallel
    return (parallel.pipeline_parallel_size - 1) * parallel.tensor_parallel_size


class RankWorker:
    """Global rank `rank` of the engine's workers (stage by stage: pp_rank * tp + tp_rank); `rendezvous`
    None: the only one."""

    def __init__(self, config: AserveConfig, rank: int, rendezvous: Rendezvous | None):
        self.config = config
        self.rank = rank
        self.rendezvous = rendezvous
        self.runner = None
        self.parallel = None
        self.output_rank = output_rank(config)

    @property
    def world_size(self) -> int:
        return self.rendezvous.world_size if self.rendezvous is not None else 1

    def start(self, device_index: int | None = None) -> bytes:
        """Joins the group, loads the model (in waves), sizes the KV cache, captures graphs; the
        encoded RunnerInfo. `device_index`: the CUDA device this rank uses (default: its rank, offset
        by the data-parallel replica)."""
        config = self.config
        if config.device.device == "cpu":  # every rank of every replica shares the cores
            limit_threads(self.world_size * config.parallel.data_parallel_size)
        from aserve.distributed.collectives import in_waves
        from aserve.distributed.context import SINGLE, init_distributed
        from aserve.runner.factory import make_runner

        if device_index is None and config.device.device == "cuda":  # replica r: devices r*world .. r*world+world-1
            device_index = config.parallel.data_parallel_rank * self.world_size + self.rank
        pp_size = config.parallel.pipeline_parallel_size
        self.parallel = (init_distributed(self.rendezvous, self.rank, device_index, pp_size)
                         if self.rendezvous is not None else SINGLE.with_device(device_index))
        self.runner = make_runner(config, self.parallel)
        in_waves(self.runner.load_model, self.parallel, config.load.options.max_parallel_loading_workers)
        info: RunnerInfo = self.runner.initialize_kv_cache()
        self.runner.capture_graphs()
        return _encoder.encode(info)

    def execute(self, body: bytes, on_progress: Callable[[bytes], None] | None = None) -> bytes:
        """One step (encoded SchedulerOutput in); the output rank's encoded RunnerOutput out, b"" elsewhere.
        `on_progress` (the output rank): each streamed decode step's encoded RunnerOutput but the last."""
        so = _decode_so.decode(body)
        mine = self.rank == self.output_rank
        if on_progress is not None and mine:
            out: RunnerOutput = self.runner.execute(so, lambda step: on_progress(_encoder.encode(step)))
        else:
            out = self.runner.execute(so)
        return _encoder.encode(out) if mine else b""

    def add_lora(self, body: bytes) -> LoRAReply:
        return self._lora_call(lambda: self.runner.add_lora(_decode_lora.decode(body)) or True)

    def remove_lora(self, lora_int_id: int) -> LoRAReply:
        return self._lora_call(lambda: self.runner.remove_lora(lora_int_id))

    @staticmethod
    def _lora_call(call: Callable[[], bool]) -> LoRAReply:
        """Any failure is the adapter's (its files, its shapes), never the worker's."""
        try:
            return LoRAReply(bool(call()))
        except Exception as exc:  # noqa: BLE001
            message = str(exc) if isinstance(exc, LoRAAdapterError) else f"{type(exc).__name__}: {exc}"
            return LoRAReply(False, message)

    def sleep(self, level: int) -> None:
        self.runner.sleep(level)

    def wake_up(self, body: bytes) -> None:
        """`body`: the encoded tags (None: both). A reload of the weights goes in waves, as at start-up."""
        from aserve.distributed.collectives import in_waves

        tags = _decode_tags.decode(body)
        in_waves(lambda: self.runner.wake_up(None if tags is None else tuple(tags)), self.parallel,
                 self.config.load.options.max_parallel_loading_workers)

    def shutdown(self) -> None:
        from aserve.distributed.context import shutdown_distributed

        if self.runner is not None and self.runner.stage is not None:
            self.runner.stage.flush()
        shutdown_distributed()
