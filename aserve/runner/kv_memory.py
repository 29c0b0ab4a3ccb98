"""Memory helpers of the runner: zero-page KV allocation, the memory-profiling step, and the swap
copies between the device and CPU caches."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from aserve.config import GiB

from aserve.runner.input_batch import ModelInputs

logger = logging.getLogger(__name__)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor. On CPU its memory comes from calloc (through numpy), so the OS maps
    zero pages on first touch: GiBs of KV cache cost nothing at start-up (torch.zeros writes every
    page, seconds for the default 4 GiB)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class ModelInputsForProfile:
    """The memory-profiling step: fresh prefills totalling `num_tokens`, each at most `max_seq_len` long."""

    @staticmethod
    def make(num_tokens: int, max_seq_len: int, block_size: int, device: torch.device) -> tuple[ModelInputs, int]:
        """Returns the inputs and the number of blocks their scratch KV cache needs (block 0 stays unused)."""
        from aserve.model.attention.base import AttentionMetadata

        lens = [max_seq_len] * (num_tokens // max_seq_len)
        if num_tokens % max_seq_len:
            lens.append(num_tokens % max_seq_len)
        blocks = [math.ceil(n / block_size) for n in lens]
        table = torch.zeros((len(lens), max(blocks)), dtype=torch.int32)
        slots, positions, starts = [], [], [0]
        next_block = 1
        for i, (n, b) in enumerate(zip(lens, blocks)):
            table[i, :b] = torch.arange(next_block, next_block + b, dtype=torch.int32)
            slots.append(torch.arange(next_block * block_size, next_block * block_size + n, dtype=torch.int64))
            positions.append(torch.arange(n, dtype=torch.int64))
            starts.append(starts[-1] + n)
            next_block += b
        meta = AttentionMetadata(
            num_tokens=num_tokens, num_seqs=len(lens), num_decodes=0, num_decode_tokens=0,
            slot_mapping=torch.cat(slots).to(device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
            block_tables=table.to(device),
            max_query_len=max(lens), max_seq_len=max(lens), query_start_loc_cpu=starts, seq_lens_cpu=list(lens))
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
        inputs = ModelInputs(ids, torch.cat(positions).to(device), meta, [], [], [], [], {})
        return inputs, next_block


def copy_blocks(pairs: list[tuple[int, int]], src_caches: list[torch.Tensor], dst_caches: list[torch.Tensor]) -> None:
    """Copies block `src` of every source cache into block `dst` of the matching destination cache,
    for each (src, dst) of `pairs` (swap-out: device -> CPU; swap-in: CPU -> device)."""
    if not pairs:
        return
    src = torch.tensor([p[0] for p in pairs], dtype=torch.int64)
    dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
    for s_cache, d_cache in zip(src_caches, dst_caches):
        d_cache.index_copy_(1, dst.to(d_cache.device), s_cache.index_select(1, src.to(s_cache.device))
                            .to(d_cache.device))


def profile_num_blocks(run_profile_step: Callable[[], None], device: torch.device, gpu_memory_utilization: float,
                       per_block: int) -> int:
    """CUDA: runs the largest step once (`run_profile_step`), then sizes the KV cache from what the
    device has free afterwards, as vLLM does: `gpu_memory_utilization` of the card, minus everything in
    use on it now (this process's weights and CUDA context, and whatever other processes or engines
    hold: the free memory says it, not the card's total), minus the step's activation peak (freed
    after the step, needed again by every step). RuntimeError naming the flags if that is not even
    two blocks of `per_block` bytes."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    run_profile_step()
    torch.cuda.synchronize(device)
    activation_peak = torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
    torch.cuda.empty_cache()  # the step's cached blocks back to the device, so free memory counts them
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free
    budget = total * gpu_memory_utilization - in_use - activation_peak
    logger.info("Memory profile: total %.2f GiB, in use %.2f GiB (weights, context, other processes), "
                "activation peak %.2f GiB, KV budget %.2f GiB", total / GiB, in_use / GiB,
                activation_peak / GiB, budget / GiB)
    if budget <= per_block * 2:
        raise RuntimeError(
            f"No memory left for the KV cache ({free / GiB:.2f} GiB free of {total / GiB:.2f} GiB after the "
            f"profile step, {gpu_memory_utilization} of the card allowed): raise --gpu-memory-utilization, stop "
            "what else holds the GPU, or lower --max-num-batched-tokens / --max-model-len")
    return int(budget // per_block)


def run_profile_step(runner) -> None:
    """`runner` (a ModelRunner) runs the largest step the scheduler can emit once: `max_num_batched_tokens`
    prompt tokens (at most `max_num_seqs` prompts of at most `max_model_len`), through a scratch KV
    cache, plus the LM head over one row per sequence (k + 1 with speculation; a draft model's own
    activations are not profiled; a pipeline stage before the last has no LM head to run and takes
    zeros as its stream). Before `initialize_kv_cache` the scratch cache stays bound until the real
    one replaces it."""
    sched = runner.config.scheduler
    max_len = runner.config.model.max_model_len
    num_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * max_len)
    dummy, num_blocks = ModelInputsForProfile.make(num_tokens, max_len, runner.block_size, runner.device)
    a = runner.arch
    scratch = [torch.zeros((2, num_blocks, runner.block_size, a.num_key_value_heads, a.head_dim),
                           dtype=runner._kv_dtype(), device=runner.device) for _ in range(a.num_hidden_layers)]
    with torch.inference_mode():
        runner.model.bind_kv_caches(scratch)
        try:
            if runner.stage is not None:
                runner.stage.feed_dummy(num_tokens)
            hidden = runner.model(dummy.input_ids, dummy.positions, dummy.meta)
            last_stage = runner.stage is None or runner.stage.is_last
            if runner.model.lm_head is not None and last_stage:  # (a decoder embedder has none)
                spec = runner.config.speculative  # verification: k + 1 logits rows per sequence
                rows = sched.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
                runner.model.compute_logits(hidden[-min(num_tokens, rows):])
        finally:
            if runner.kv_caches:  # already initialized: put the real cache back
                runner.model.bind_kv_caches(runner.kv_caches)
