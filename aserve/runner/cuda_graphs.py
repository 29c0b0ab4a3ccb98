"""Fixed-shape decode batches: capture sizes, padding, and CUDA graph capture / replay.

Decode-only batches are padded to the next capture size (1, 2, 4, 8, then steps of 8 up to
`max_num_seqs`). On CUDA with the triton attention backend (unless --enforce-eager) one graph
per size is captured at start-up, largest first, into one shared memory pool, and replayed with
inputs copied into static buffers.
Prefill batches, oversize batches and contexts longer than `max_seq_len_to_capture` run eagerly.
On CPU the same padding path can be forced (tests prove padding never changes a result).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager, nullcontext
from dataclasses import dataclass

import torch

from aserve.model.attention.base import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8, capped at max_num_seqs (which is always included)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


def padded_size(sizes: list[int], num_seqs: int) -> int | None:
    """The smallest capture size holding `num_seqs`, or None when the batch is larger than all."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    output: torch.Tensor


class CudaGraphRunner:
    """Captures `forward(input_ids, positions, meta) -> hidden` per decode batch size and replays it.

    Static buffers are sized for the largest batch and `max_blocks` block-table columns; a replay
    copies the step's (padded) inputs into the views for its size.
    """

    def __init__(self, forward: Callable[..., torch.Tensor], sizes: list[int], max_blocks: int,
                 max_seq_len_to_capture: int, device: torch.device,
                 capture_context: Callable[[int], ContextManager] | None = None):
        """`capture_context(size)`: entered around each size's warm-up and capture (the LoRA forward
        context over the static per-token slot buffer, which replays then read)."""
        self.forward = forward
        self.capture_context = capture_context
        self.sizes = sizes
        self.max_blocks = max_blocks
        self.max_seq_len_to_capture = max_seq_len_to_capture
        self.device = device
        self.graphs: dict[int, _Graph] = {}
        self.pool = None
        n = sizes[-1]
        self._input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self._positions = torch.zeros(n, dtype=torch.int64, device=device)
        self._slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self._qsl = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self._block_tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)

    def _meta(self, size: int) -> AttentionMetadata:
        """The metadata a graph is captured with. Its host fields are frozen into the graph (backends
        size work from them: the torch backend trims block tables to `max(seq_lens_cpu)`, the triton
        one picks its context splits), so they describe the largest context a replay may hold,
        never the dummy capture inputs; the device tensors are the static buffers replays fill."""
        return AttentionMetadata(
            num_tokens=size, num_seqs=size, num_decodes=size, num_decode_tokens=size,
            slot_mapping=self._slots[:size], query_start_loc=self._qsl[: size + 1],
            seq_lens=self._seq_lens[:size], block_tables=self._block_tables[:size],
            max_query_len=1, max_seq_len=self.max_seq_len_to_capture,
            query_start_loc_cpu=list(range(size + 1)), seq_lens_cpu=[self.max_seq_len_to_capture] * size,
        )

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture every size, largest first, sharing one pool. Returns seconds spent."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            meta = self._meta(size)
            ids, pos = self._input_ids[:size], self._positions[:size]
            with self.capture_context(size) if self.capture_context is not None else nullcontext():
                for _ in range(2):  # warm up (autotuning, lazy init) outside the graph
                    self.forward(ids, pos, meta)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = self.forward(ids, pos, meta)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = _Graph(graph, ids, pos, meta, out)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    def can_run(self, num_seqs: int, max_seq_len: int, num_blocks_cols: int) -> bool:
        return (num_seqs <= self.sizes[-1] and max_seq_len <= self.max_seq_len_to_capture
                and num_blocks_cols <= self.max_blocks and bool(self.graphs))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay for a batch already padded to a capture size. Returns hidden states [size, hidden]."""
        size = meta.num_seqs
        g = self.graphs[size]
        g.input_ids.copy_(input_ids)
        g.positions.copy_(positions)
        g.meta.slot_mapping.copy_(meta.slot_mapping)
        g.meta.seq_lens.copy_(meta.seq_lens)
        cols = meta.block_tables.shape[1]
        g.meta.block_tables.zero_()
        g.meta.block_tables[:, :cols].copy_(meta.block_tables)
        g.graph.replay()
        return g.output
