"""The pure-torch attention backend (CPU, and a reference on any device), built on `aserve.kernels.reference`."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from aserve.kernels import cpu_ops, reference
from aserve.model.attention.base import AttentionMetadata, DecodeInputs


@dataclass
class _PrefillSeq:
    """One prefill / extend sequence; its block ids and mask are made on first use (the C prefill
    kernel needs neither)."""

    q_start: int
    q_end: int
    seq_len: int
    table: torch.Tensor  # int32: its row of the block table
    block_size: int
    window: int | None

    @functools.cached_property
    def block_ids(self) -> torch.Tensor:  # int64 [ceil(seq_len / block_size)]
        return self.table[: -(-self.seq_len // self.block_size)].to(torch.int64)

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:  # see reference.prefill_mask
        return reference.prefill_mask(self.q_end - self.q_start, self.seq_len, self.window, self.table.device)


@dataclass
class _StepPlan:
    """Everything the layers share within one step, derived from the metadata once."""

    block_size: int
    slots: torch.Tensor  # int64: destination slots of the tokens that are written
    valid_rows: torch.Tensor | None  # rows of k/v to write; None = the first num_tokens rows
    decode_block_ids: torch.Tensor | None  # int64 [num_decodes * blocks_per_decode]
    # bool [num_decodes, blocks_per_decode * block_size]; None: one decode that sees its first
    # `decode_len` gathered keys, no mask needed
    decode_mask: torch.Tensor | None
    decode_len: int
    prefills: list[_PrefillSeq]


class TorchAttentionBackend:
    """Writes K/V with `reshape_and_cache`, then runs all decodes as one batched masked SDPA and each
    prefill/extend sequence as its own (offset-)causal SDPA. With a bf16 cache on the CPU, where the
    C kernels are built (`aserve.kernels.cpu_ops`), decodes instead attend in one kernel call that
    reads the blocks in place (a decode-only step also writes its K/V there), and so do all of a step's
    prefills where the CPU has the bf16 dot product.

    Shapes come from the metadata's host lists, so it never syncs with the device except to check
    for skipped (-1) slots once per step. A compiled decode passes `DecodeInputs` instead of the
    metadata; those steps run as one opaque op per layer (`torch_paged_decode`). Gathered K/V go
    into grow-only buffers reused by every layer. Call `begin_forward(meta)` once per model forward to share
    the per-step plan (block indices, masks; one per sliding window in use) across layers; without it
    each call plans on its own.
    """

    name = "torch"
    supports_decode_inputs = True  # a compiled decode may pass DecodeInputs (see decode_inputs)

    def __init__(self) -> None:
        self._kernels = cpu_ops.load()  # C decode attention for bf16 CPU caches (None: torch only)
        self._step_meta: AttentionMetadata | None = None
        self._plans: dict[int | None, _StepPlan] = {}  # this step's plan per sliding window
        self._buffers: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

    def begin_forward(self, meta: AttentionMetadata) -> None:
        """Mark the start of a forward pass over `meta` (plans are rebuilt on first use)."""
        self._step_meta = meta
        self._plans = {}

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata | DecodeInputs,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:
        if isinstance(meta, DecodeInputs):  # planned with the model's one window (decode_inputs)
            return torch.ops.aserve.torch_paged_decode(q, k, v, kv_cache, meta.slots, meta.block_ids, meta.mask,
                                                       meta.decode_len, meta.key_buffer, meta.value_buffer,
                                                       scale, k_scale, v_scale)
        kernels = self._kernels
        use_kernel = kernels is not None and meta.num_decodes > 0 and kernels.accepts(q, kv_cache)
        num_tokens = meta.num_tokens
        if use_kernel and meta.num_decodes == meta.num_seqs == q.shape[0]:  # decodes only, no padding
            # The kernel takes contiguous q; a view of a fused q|k|v projection (GPT-2, OPT) is not.
            return kernels.paged_decode_attention(q.contiguous(), kv_cache, meta.block_tables, meta.seq_lens,
                                                  scale, sliding_window, (k, v, meta.slot_mapping), logit_softcap)
        block_size = kv_cache.shape[2]
        plan = self._plans.get(sliding_window) if meta is self._step_meta else None
        if plan is None or plan.block_size != block_size:
            plan = _make_plan(meta, block_size, sliding_window)
            if meta is self._step_meta:
                self._plans[sliding_window] = plan
        if plan.valid_rows is None:
            k, v = k[:num_tokens], v[:num_tokens]
        else:
            k, v = k.index_select(0, plan.valid_rows), v.index_select(0, plan.valid_rows)
        reference.reshape_and_cache(k, v, kv_cache, plan.slots, k_scale, v_scale, all_valid=True)

        num_decodes = meta.num_decodes
        if num_decodes == q.shape[0] and not plan.prefills:  # decodes only, no padding rows
            return self._decode(q, kv_cache, plan, scale, k_scale, v_scale, logit_softcap)
        # contiguous whatever q's strides; padding rows 0
        out = q.new_empty(q.shape) if q.shape[0] == num_tokens else q.new_zeros(q.shape)
        prefills = plan.prefills
        if (prefills and kernels is not None and kernels.accepts(q, kv_cache) and q.stride(1) == q.shape[2]
                and kv_cache.is_contiguous() and kernels.paged_prefill_attention(
                q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, (num_decodes, meta.num_seqs),
                out, scale, sliding_window, logit_softcap)):
            prefills = []  # attended in place by the C kernel
        if num_decodes and use_kernel:
            out[:num_decodes] = kernels.paged_decode_attention(q[:num_decodes].contiguous(), kv_cache,
                                                               meta.block_tables, meta.seq_lens, scale, sliding_window,
                                                               softcap=logit_softcap)
        elif num_decodes:
            out[:num_decodes] = self._decode(q[:num_decodes], kv_cache, plan, scale, k_scale, v_scale,
                                             logit_softcap)
        for seq in prefills:
            keys, values = self._gather(kv_cache, seq.block_ids, 1, q.dtype, k_scale, v_scale)
            out[seq.q_start:seq.q_end] = reference.attend_prefill(
                q[seq.q_start:seq.q_end], keys[0, :seq.seq_len], values[0, :seq.seq_len], seq.mask, scale,
                logit_softcap)
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, plan: _StepPlan, scale: float, k_scale: float,
                v_scale: float, softcap: float | None = None) -> torch.Tensor:
        assert plan.decode_block_ids is not None
        numel = plan.decode_block_ids.shape[0] * kv_cache[0, 0].numel()
        buffers = self.buffer_pair(kv_cache.dtype, kv_cache.device, numel)
        return _attend_decodes(q, kv_cache, plan.decode_block_ids, plan.decode_mask, plan.decode_len, buffers,
                               scale, k_scale, v_scale, softcap)

    def _gather(self, kv_cache: torch.Tensor, block_ids: torch.Tensor, num_seqs: int, dtype: torch.dtype,
                k_scale: float, v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        numel = block_ids.shape[0] * kv_cache[0, 0].numel()
        key_buf, value_buf = self.buffer_pair(kv_cache.dtype, kv_cache.device, numel)
        keys = reference.gather_kv(kv_cache[0], block_ids, num_seqs, out=key_buf)
        values = reference.gather_kv(kv_cache[1], block_ids, num_seqs, out=value_buf)
        return reference.dequantize(keys, dtype, k_scale), reference.dequantize(values, dtype, v_scale)

    def buffer_pair(self, dtype: torch.dtype, device: torch.device, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat grow-only buffers (fresh allocations page-fault on every call; reuse is much faster)."""
        key = (dtype, device)
        pair = self._buffers.get(key)
        if pair is None or pair[0].numel() < numel:
            size = max(numel, int(pair[0].numel() * 1.5) if pair is not None else 0)
            pair = (torch.empty(size, dtype=dtype, device=device), torch.empty(size, dtype=dtype, device=device))
            self._buffers[key] = pair
        return pair


def _make_plan(meta: AttentionMetadata, block_size: int, sliding_window: int | None) -> _StepPlan:
    num_tokens = meta.num_tokens
    slots = meta.slot_mapping[:num_tokens].to(torch.int64)
    valid_rows = None
    if num_tokens and not bool((slots >= 0).all()):
        valid_rows = torch.nonzero(slots >= 0).flatten()
        slots = slots.index_select(0, valid_rows)

    num_decodes = meta.num_decodes
    decode_block_ids = decode_mask = None
    decode_len = 0
    if num_decodes:
        decode_block_ids, decode_mask, decode_len = _plan_decodes(meta, block_size, sliding_window)

    prefills = []
    starts = meta.query_start_loc_cpu
    for i in range(num_decodes, meta.num_seqs):
        q_start, q_end, seq_len = starts[i], starts[i + 1], meta.seq_lens_cpu[i]
        if q_end == q_start:
            continue
        prefills.append(_PrefillSeq(q_start, q_end, seq_len, meta.block_tables[i], block_size, sliding_window))
    return _StepPlan(block_size, slots, valid_rows, decode_block_ids, decode_mask, decode_len, prefills)


def _plan_decodes(meta: AttentionMetadata, block_size: int,
                  window: int | None) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """The decodes' flat block ids, their mask (None: one sequence that sees all of its first
    `decode_len` keys) and the longest decode context."""
    num_decodes = meta.num_decodes
    decode_len = max(meta.seq_lens_cpu[:num_decodes])
    num_blocks = -(-decode_len // block_size)
    block_ids = meta.block_tables[:num_decodes, :num_blocks].reshape(-1).to(torch.int64)
    mask = None
    if num_decodes > 1 or (window is not None and window < decode_len):
        mask = reference.decode_mask(meta.seq_lens[:num_decodes], num_blocks * block_size, window)
    return block_ids, mask, decode_len


def decode_inputs(meta: AttentionMetadata, kv_cache: torch.Tensor, backend: TorchAttentionBackend,
                  sliding_window: int | None) -> DecodeInputs:
    """`meta` (decodes only, no skipped slots) as the tensors a compiled decode takes, over caches
    shaped like `kv_cache`, with `backend`'s grow-only gather scratch; every layer must use
    `sliding_window` (the mask is shared)."""
    block_ids, mask, decode_len = _plan_decodes(meta, kv_cache.shape[2], sliding_window)
    buffers = backend.buffer_pair(kv_cache.dtype, kv_cache.device, block_ids.shape[0] * kv_cache[0, 0].numel())
    if mask is None:
        mask = torch.empty(0, dtype=torch.bool, device=block_ids.device)
    return DecodeInputs(meta.slot_mapping[:meta.num_tokens].to(torch.int64), block_ids, mask,
                        torch.tensor(decode_len, dtype=torch.int64), buffers[0], buffers[1])


@torch.library.custom_op("aserve::torch_paged_decode", mutates_args=("kv_cache", "key_buffer", "value_buffer"))
def torch_paged_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                       slots: torch.Tensor, block_ids: torch.Tensor, mask: torch.Tensor, decode_len: torch.Tensor,
                       key_buffer: torch.Tensor, value_buffer: torch.Tensor,
                       scale: float, k_scale: float, v_scale: float) -> torch.Tensor:
    """Decode attention on `DecodeInputs` as one opaque op (a compiled graph calls it; its shapes and
    values never reach the graph's guards): write k/v `[B, KVH, D]` at `slots`, gather the context
    into the scratch buffers, attend q `[B, H, D]`."""
    reference.reshape_and_cache(k, v, kv_cache, slots, k_scale, v_scale, all_valid=True)
    return _attend_decodes(q, kv_cache, block_ids, mask if mask.numel() else None, int(decode_len),
                           (key_buffer, value_buffer), scale, k_scale, v_scale)


def _attend_decodes(q: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor, mask: torch.Tensor | None,
                    decode_len: int, buffers: tuple[torch.Tensor, torch.Tensor], scale: float, k_scale: float,
                    v_scale: float, softcap: float | None = None) -> torch.Tensor:
    """Gather the decodes' blocks into `buffers`, then attend (no mask: the first `decode_len` keys)."""
    num_seqs = q.shape[0]
    keys = reference.dequantize(reference.gather_kv(kv_cache[0], block_ids, num_seqs, out=buffers[0]),
                                q.dtype, k_scale)
    values = reference.dequantize(reference.gather_kv(kv_cache[1], block_ids, num_seqs, out=buffers[1]),
                                  q.dtype, v_scale)
    if mask is None:
        keys, values = keys[:, :decode_len], values[:, :decode_len]
    return reference.attend_decode(q, keys, values, mask, scale, softcap)


@torch_paged_decode.register_fake
def _(q, k, v, kv_cache, slots, block_ids, mask, decode_len, key_buffer, value_buffer, scale, k_scale, v_scale):
    return torch.empty_like(q)
