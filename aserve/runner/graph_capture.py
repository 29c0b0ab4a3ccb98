"""The runner's decode capture at start-up and after a wake-up: CUDA graphs for the decode batch sizes;
on CPU with -O3 the inductor-compiled decode forward, else the decode layers in one native call
(`runner/cpu_decode_step.py`) where the model qualifies."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from aserve.runner.compiled_decode import CompiledDecode
from aserve.runner.cpu_decode_step import CpuDecodeStep
from aserve.runner.cuda_graphs import CudaGraphRunner

if TYPE_CHECKING:
    from aserve.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)
# Attention backends whose forward never syncs with the host, so a CUDA graph can capture it.
_GRAPH_CAPTURABLE_BACKENDS = ("triton",)


def capture_decode(runner: ModelRunner) -> None:
    """CUDA, unless enforce_eager: capture the decode graphs. Only host-sync-free backends can be
    captured; the torch backend checks its slots on the host, so with it decode stays eager.
    CPU with `compile_sizes` (-O3): compile the decode forward for those batch sizes instead."""
    if runner.kv_scale_calc.defer_capture():  # captured after the first step computed the fp8 KV scales
        return
    sizes = runner.config.runner.compile_sizes
    if runner.device.type == "cpu" and sizes:
        if not getattr(runner.backend, "supports_decode_inputs", False):
            raise ValueError(f"-O3 on CPU needs the torch attention backend, not {runner.backend.name}")
        runner.compiled_decode = CompiledDecode(runner.model, sizes, runner.kv_caches,
                                                runner.config.runner.compile_backend)
        seconds = runner.compiled_decode.warm_up()
        logger.info("Compiled the CPU decode forward (inductor) for batch sizes %s in %.1fs", list(sizes), seconds)
        return
    if runner.device.type == "cpu":
        runner.cpu_step = native_decode_step(runner)
        return
    if runner.device.type != "cuda" or runner.config.runner.enforce_eager:
        return
    if runner.backend.name not in _GRAPH_CAPTURABLE_BACKENDS:
        logger.warning("CUDA graphs need the triton attention backend; the %s backend runs decode eagerly",
                       runner.backend.name)
        return
    # No sequence outgrows max_model_len: a smaller cap keeps the captured decode work small.
    max_len = min(runner.config.runner.max_seq_len_to_capture, runner.config.model.max_model_len)
    runner.graph_runner = CudaGraphRunner(
        runner.model, runner.static_sizes, runner.max_blocks_per_seq, max_len, runner.device,
        runner.lora.graph_capture_context if runner.lora is not None else None)
    seconds = runner.graph_runner.capture()
    logger.info("Captured CUDA graphs for decode batch sizes %s in %.1fs", runner.static_sizes, seconds)


def native_decode_step(runner: ModelRunner) -> CpuDecodeStep | None:
    """The decode layers in one C call, for a bf16 model served by one rank without LoRA, unless
    ASERVE_CPU_DECODE_STEP=0 (the layer-by-layer forward: the reference)."""
    if (os.environ.get("ASERVE_CPU_DECODE_STEP", "1") == "0" or runner.model is None or runner.lora is not None
            or runner.parallel.world_size > 1 or runner.config.model.dtype != "bfloat16"
            or getattr(runner.model, "lm_head", None) is None):
        return None
    from aserve.kernels import cpu_ops

    return CpuDecodeStep.build(runner.model, cpu_ops.load(), runner.config.scheduler.max_num_seqs)
