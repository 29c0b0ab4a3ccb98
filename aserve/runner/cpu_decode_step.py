"""A CPU decode step's decoder layers in one native call (`kernels/cpu_decode_step.c`): no Python, no
`nn.Module` calls and no tensor allocations between the ops of a step, for Llama-shaped bf16 models
whose projections run on aserve's C kernels.

The runner builds it after binding the KV cache (`CpuDecodeStep.build`, None when the model does not
qualify; the reason is logged once) and uses it for steps where every row decodes one token, with no
padding and no LoRA. The embedding, the final norm and everything after stay the model's own. The call
runs the same kernels in the same order as the layer-by-layer forward, so its hidden states are bitwise
the same: the layers remain the reference and the fallback.

Qualifies: `LlamaModel` decoders (Llama, Mistral, Qwen2, Qwen3, Phi-3) with gated-SiLU dense MLPs, neox
rotary with a bf16 table, bf16 RMSNorms of one eps (per-head q/k norms included), every projection packed for `linear_vnni` (bf16, AVX512-BF16) or for
`linear_int4` (int4 / GGUF Q4), float32 outputs where the layers have them, a bf16 KV cache with unit
scales, one rank.
"""

from __future__ import annotations

import ctypes
import logging

import torch
from torch import nn

from aserve.kernels.c_build import log_once
from aserve.kernels.cpu_ops import CpuKernels

logger = logging.getLogger(__name__)

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_ARGTYPES = (_P, _I, _P, _P, _P, _P, _P, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _I, _F,
             _P, _P, _P, _P, _P, _P, _P, _P, _P, _P)


class _Matmul(ctypes.Structure):
    _fields_ = [("kind", _I), ("weight", _P), ("scale", _P), ("offset", _P), ("bias", _P), ("n", _I),
                ("group_size", _I)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P), ("qkv", _Matmul), ("o", _Matmul), ("gate_up", _Matmul),
                ("down", _Matmul), ("k_cache", _P), ("v_cache", _P), ("window", _I), ("scale", _F)]


# Linear methods whose packed operands the C matmuls take as they are (no change to x before the matmul).
_C_METHODS = ("cpu_bf16_kernel", "int4", "gguf", "CheckpointIntMethod")


class NotEligible(Exception):
    """Why a model does not take the native decode step."""


def _matmul(linear: nn.Module, k: int, float_output: bool) -> _Matmul:
    """The C descriptor of a Linear whose method packed it for the kernels (`linear [.., k] -> [.., n]`)."""
    if type(linear).__name__ not in ("Linear", "MergedLinear") or getattr(linear, "parallel_form", None):
        raise NotEligible(f"{type(linear).__name__} is not a plain Linear")
    if bool(getattr(linear, "float_output", False)) != float_output:
        raise NotEligible("a projection's output dtype differs from the fused step's")
    method = linear.quant_method
    if (getattr(method, "name", None) not in _C_METHODS and type(method).__name__ not in _C_METHODS
            or getattr(linear, "input_perm", None) is not None):  # GPTQ act-order permutes x first
        raise NotEligible(f"a projection runs on {type(method).__name__}, not a C kernel as it is")
    bias = linear.bias
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        raise NotEligible("a bias is not a contiguous bf16 vector")
    bias_ptr = None if bias is None else bias.data_ptr()
    vnni = getattr(linear, "vnni_weight", None)
    if vnni is not None:
        if vnni.shape[1] * 2 != k:
            raise NotEligible("a packed weight does not fit its input")
        return _Matmul(0, vnni.data_ptr(), None, None, bias_ptr, vnni.shape[0] * 16, 0)
    codes = getattr(linear, "int4_c_codes", None)
    if codes is not None:
        scale, offset = linear.int4_c_scale, linear.int4_c_offset
        if codes.shape[1] * 4 != k:
            raise NotEligible("packed 4-bit codes do not fit their input")
        return _Matmul(1, codes.data_ptr(), scale.data_ptr(), offset.data_ptr(), bias_ptr, codes.shape[0] * 16,
                       k // scale.shape[1])
    raise NotEligible(f"a projection runs on {linear.quant_method.name}, not a C kernel")


class CpuDecodeStep:
    """The bound model's decode layers as one call; scratch for up to `max_rows` decode rows."""

    def __init__(self, model: nn.Module, kernels: CpuKernels, max_rows: int):
        inner = model.model
        layers = list(inner.layers)
        first = layers[0]
        attn = first.self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.hidden_size = first.input_layernorm.weight.shape[0]
        self.intermediate = first.mlp.down_proj.input_size
        self.eps = first.input_layernorm.eps
        self.embed, self.rotary, self.norm = inner.embed_tokens, inner.rotary, inner.norm
        self._check(model, layers)
        h, qkv_width = self.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self._layers = (_Layer * len(layers))(*(self._layer(layer, h, qkv_width) for layer in layers))
        self.block_size = first.self_attn.attn.kv_cache.shape[2]
        self.max_rows = max_rows
        rows, q_width = max_rows, self.num_heads * self.head_dim
        bf16, f32 = torch.bfloat16, torch.float32
        self._hidden = torch.empty(rows, h, dtype=f32)
        self._residual = (torch.empty(rows, h, dtype=f32), torch.empty(rows, h, dtype=f32))
        self._scratch = [torch.empty(rows, h, dtype=bf16), torch.empty(rows, qkv_width, dtype=bf16),
                         torch.empty(rows, q_width, dtype=bf16),
                         torch.empty(rows, self.num_kv_heads * self.head_dim, dtype=bf16),
                         torch.empty(rows, q_width, dtype=bf16), torch.empty(rows, h, dtype=f32),
                         torch.empty(rows, 2 * self.intermediate, dtype=f32),
                         torch.empty(rows, self.intermediate, dtype=bf16),
                         torch.empty(rows, q_width, dtype=bf16),  # q and k normalized per head (Qwen3)
                         torch.empty(rows, self.num_kv_heads * self.head_dim, dtype=bf16)]
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

    def _check(self, model: nn.Module, layers: list[nn.Module]) -> None:
        from aserve.model.layers.activation import SiluAndMul
        from aserve.model.layers.norm import RMSNorm
        from aserve.model.models.llama import LlamaMLP, LlamaModel

        if type(model.model) is not LlamaModel:
            raise NotEligible("not a Llama-shaped decoder")
        rotary = self.rotary
        if not rotary.is_neox or rotary.cos_sin_cache.dtype != torch.bfloat16:
            raise NotEligible("the rotary is not neox with a bf16 table")
        for layer in layers:
            attn = layer.self_attn
            if type(layer.mlp) is not LlamaMLP or type(layer.mlp.act_fn) is not SiluAndMul:
                raise NotEligible("an MLP is not a dense gated SiLU")
            if attn.rotary is not rotary:
                raise NotEligible("attention has its own rotary")
            head_norms = (attn.q_norm, attn.k_norm) if attn.q_norm is not None else ()
            for norm in (layer.input_layernorm, layer.post_attention_layernorm, *head_norms):
                if type(norm) is not RMSNorm or norm.weight.dtype != torch.bfloat16 or norm.eps != self.eps:
                    raise NotEligible("a norm is not a bf16 RMSNorm")
            cache, core = attn.attn.kv_cache, attn.attn
            if (cache is None or cache.dtype != torch.bfloat16 or not cache.is_contiguous()
                    or core.k_scale != 1.0 or core.v_scale != 1.0 or core.logit_softcap
                    or getattr(core, "calculate_kv_scales", False)):
                raise NotEligible("the KV cache is not a bf16 cache with unit scales")
            if (attn.num_heads, attn.num_kv_heads, attn.head_dim) != (self.num_heads, self.num_kv_heads,
                                                                       self.head_dim):
                raise NotEligible("layers differ in their heads")
            if self.num_heads % self.num_kv_heads or self.num_heads // self.num_kv_heads > 16:
                raise NotEligible("more than 16 query heads per KV head")

    def _layer(self, layer: nn.Module, h: int, qkv_width: int) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        q_width = self.num_heads * self.head_dim
        cache = attn.attn.kv_cache
        qkv = _matmul(attn.qkv_proj, h, False)
        gate_up = _matmul(mlp.gate_up_proj, h, True)
        o, down = _matmul(attn.o_proj, q_width, True), _matmul(mlp.down_proj, self.intermediate, True)
        if qkv.n != qkv_width or gate_up.n != 2 * self.intermediate or o.n != h or down.n != h:
            raise NotEligible("a projection's width differs from the layer's")
        half = cache.stride(0) * cache.element_size()
        q_norm, k_norm = ((attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr()) if attn.q_norm is not None
                          else (None, None))
        return _Layer(layer.input_layernorm.weight.data_ptr(), layer.post_attention_layernorm.weight.data_ptr(),
                      q_norm, k_norm, qkv, o, gate_up, down, cache.data_ptr(), cache.data_ptr() + half,
                      attn.attn.sliding_window or 0, attn.attn.scale)

    def can_run(self, meta, num_rows: int) -> bool:
        """Every row one decode token, no padding rows, at most `max_rows`."""
        return meta.num_decodes == meta.num_seqs == num_rows <= self.max_rows and meta.block_tables.stride(1) == 1

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The model's output for a decode-only step (`can_run`): the final norm's rows `[B, hidden]`."""
        rows = input_ids.shape[0]
        embedded = self.embed(input_ids)
        cos_sin = self.rotary.cos_sin(positions)
        hidden, residual = self._hidden, self._residual
        scratch = [t.data_ptr() for t in self._scratch]
        tables = meta.block_tables
        current = self._fn(self._layers, len(self._layers), embedded.data_ptr(), hidden.data_ptr(),
                           residual[0].data_ptr(), residual[1].data_ptr(), cos_sin.data_ptr(), cos_sin.shape[1] // 2,
                           tables.data_ptr(), tables.stride(0), meta.seq_lens.data_ptr(), meta.slot_mapping.data_ptr(),
                           rows, self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate,
                           self.block_size, self.eps, *scratch)
        if current < 0:
            raise RuntimeError(f"CPU decode step: a projection's kernel failed ({current})")
        out, _ = self.norm(hidden[:rows], residual[current][:rows])
        return out
