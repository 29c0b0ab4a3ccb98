"""A CPU decode step's decoder layers in one native call (`kernels/cpu_decode_step.c`): no Python, no
`nn.Module` calls and no tensor allocations between the ops of a step, for bf16 models whose
projections run on aserve's C kernels.

The runner builds it after binding the KV cache (`CpuDecodeStep.build`, None when the model does not
qualify; the reason is logged once) and uses it for steps where every row decodes one token, with no
padding and no LoRA. The embedding, the final norm and everything after stay the model's own. The call
runs the same kernels in the same order as the layer-by-layer forward, so its hidden states are bitwise
the same: the layers remain the reference and the fallback.

Qualifies: the decoder forms `cpu_decode_layers.py` describes (Llama, Mistral, Qwen2, Qwen3, Phi-3;
Gemma 2 and 3) with every projection packed for `linear_vnni` (bf16, AVX512-BF16) or `linear_int4` (int4,
GGUF Q4, GPTQ / AWQ without act-order), a bf16 KV cache with unit scales, one rank.
"""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from aserve.kernels.c_build import log_once
from aserve.kernels.cpu_ops import CpuKernels
from aserve.runner.cpu_decode_layers import Layer, NotEligible, describe_gemma, describe_llama

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_ARGTYPES = (_P, _I, _P, _P, _P, _P, _P, _P, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F,
             *([_P] * 11))


class CpuDecodeStep:
    """The bound model's decode layers as one call; scratch for up to `max_rows` decode rows."""

    def __init__(self, model: nn.Module, kernels: CpuKernels, max_rows: int):
        from aserve.model.models.gemma import GemmaModel
        from aserve.model.models.llama import LlamaModel

        decoder = model.model
        form = {LlamaModel: describe_llama, GemmaModel: describe_gemma}.get(type(decoder))
        if form is None:
            raise NotEligible(f"{type(decoder).__name__} has no native decode form")
        first = decoder.layers[0]
        attn = first.self_attn
        self.shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        self.hidden_size = first.input_layernorm.weight.shape[0]
        self.intermediate = first.mlp.down_proj.input_size
        self.eps = first.input_layernorm.eps
        self.embed, self.norm = decoder.embed_tokens, decoder.norm
        self.rotary, self.local_rotary = decoder.rotary, getattr(decoder, "local_rotary", None)
        self.embed_scale = getattr(decoder, "embed_scale", None)
        layers = form(decoder, self.shape, self.hidden_size, self.intermediate, self.eps)
        self._layers = (Layer * len(layers))(*layers)
        self.gemma = form is describe_gemma
        self.hidden_f32 = not self.gemma and bool(layers[-1].down.y_f32)
        self.block_size = attn.attn.kv_cache.shape[2]
        self.max_rows = max_rows
        heads, kv_heads, head_dim = self.shape
        rows, h, q_width, kv_width = max_rows, self.hidden_size, heads * head_dim, kv_heads * head_dim
        bf16, f32 = torch.bfloat16, torch.float32
        self._hidden = torch.empty(rows, h, dtype=f32)  # bf16 rows at its start where the layers leave bf16
        self._residual = (torch.empty(rows, h, dtype=f32), torch.empty(rows, h, dtype=f32))
        self._scratch = [torch.empty(rows, h, dtype=bf16), torch.empty(rows, (heads + 2 * kv_heads) * head_dim,
                                                                       dtype=bf16),
                         torch.empty(rows, q_width, dtype=bf16), torch.empty(rows, kv_width, dtype=bf16),
                         torch.empty(rows, q_width, dtype=bf16), torch.empty(rows, h, dtype=f32),
                         torch.empty(rows, 2 * self.intermediate, dtype=f32),
                         torch.empty(rows, self.intermediate, dtype=bf16),
                         torch.empty(rows, q_width, dtype=bf16), torch.empty(rows, kv_width, dtype=bf16),
                         torch.empty(rows, h, dtype=bf16)]
        self._fn = kernels.decode_layers
        self._fn.argtypes = _ARGTYPES

    @classmethod
    def build(cls, model: nn.Module, kernels: CpuKernels | None, max_rows: int) -> CpuDecodeStep | None:
        """The step for `model` (its KV cache bound), or None when it does not qualify (logged once)."""
        if kernels is None or not kernels.native_bf16_dot:
            return None
        try:
            step = cls(model, kernels, max_rows)
        except (NotEligible, AttributeError, IndexError) as e:
            log_once(logging.INFO, f"CPU decode: layer by layer ({type(model).__name__}: {e})")
            return None
        log_once(logging.INFO, f"CPU decode: {type(model).__name__}'s {len(step._layers)} layers in one native call")
        return step

    def can_run(self, meta, num_rows: int) -> bool:
        """Every row one decode token, no padding rows, at most `max_rows`."""
        return meta.num_decodes == meta.num_seqs == num_rows <= self.max_rows and meta.block_tables.stride(1) == 1

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The model's output for a decode-only step (`can_run`): the final norm's rows `[B, hidden]`."""
        rows, h = input_ids.shape[0], self.hidden_size
        embedded = self.embed(input_ids)
        if self.embed_scale is not None:  # as the model does (Gemma), in the activations' dtype
            embedded = embedded * torch.tensor(self.embed_scale, dtype=embedded.dtype)
        cos_sin = self.rotary.cos_sin(positions)
        local = self.local_rotary.cos_sin(positions) if self.local_rotary is not None else cos_sin
        hidden, residual = self._hidden, self._residual
        tables = meta.block_tables
        current = self._fn(self._layers, len(self._layers), embedded.data_ptr(), hidden.data_ptr(),
                           residual[0].data_ptr(), residual[1].data_ptr(), cos_sin.data_ptr(), local.data_ptr(),
                           cos_sin.shape[1] // 2, tables.data_ptr(), tables.stride(0), meta.seq_lens.data_ptr(),
                           meta.slot_mapping.data_ptr(), rows, h, *self.shape, self.intermediate, self.block_size,
                           self.eps, *(t.data_ptr() for t in self._scratch))
        if current < 0:
            raise RuntimeError(f"CPU decode step: a projection's kernel failed ({current})")
        out = hidden[:rows] if self.hidden_f32 else hidden.view(-1).view(torch.bfloat16)[:rows * h].view(rows, h)
        normed, _ = self.norm(out, residual[current][:rows])
        return normed
