"""Memory helpers of the runner's start-up: zero-page KV allocation and the memory-profiling step's inputs."""

from __future__ import annotations

import math

import torch

from aserve.runner.input_batch import ModelInputs


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
