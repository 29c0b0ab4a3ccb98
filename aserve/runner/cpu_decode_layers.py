"""What the native CPU decode step (`cpu_decode_step.py`) needs to know of a model's decoder layers: one
C struct per layer (`kernels/cpu_decode_step.c`'s `decode_layer`) holding pointers to its packed weights,
norms and KV cache halves, read from the layers the model built. Each family form it knows is described
here, with everything that would make the C call differ from the layer's own forward refused
(`NotEligible`), so the model's layers stay the reference.

Forms: Llama (`LlamaModel`: Llama, Mistral, Qwen2, Qwen3 with per-head q/k norms, Phi-3) and Gemma
(`GemmaModel`: Gemma 2 and 3: normalized attention and MLP outputs, `1 + w` norms, GELU-tanh, score
soft-capping, Gemma 3's local rotary for sliding layers).
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# Linear methods whose packed operands the C matmuls take as they are (no change to x before the matmul).
_C_METHODS = ("cpu_bf16_kernel", "int4", "gguf", "CheckpointIntMethod")


class Matmul(ctypes.Structure):
    _fields_ = [("kind", _I), ("weight", _P), ("scale", _P), ("offset", _P), ("bias", _P), ("n", _I),
                ("group_size", _I), ("y_f32", _I)]


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("pre_ff_norm", _P), ("post_ff_norm", _P), ("q_norm", _P),
                ("k_norm", _P), ("qkv", Matmul), ("o", Matmul), ("gate_up", Matmul), ("down", Matmul),
                ("k_cache", _P), ("v_cache", _P), ("window", _I), ("scale", _F), ("softcap", _F),
                ("norm_offset", _F), ("gemma", _I), ("act", _I), ("local_rotary", _I)]


class NotEligible(Exception):
    """Why a model does not take the native decode step."""


def matmul(linear: nn.Module, k: int) -> Matmul:
    """The C descriptor of a Linear whose method packed it for the kernels (`linear [.., k] -> [.., n]`)."""
    if type(linear).__name__ not in ("Linear", "MergedLinear") or getattr(linear, "parallel_form", None):
        raise NotEligible(f"{type(linear).__name__} is not a plain Linear")
    method = linear.quant_method
    if (getattr(method, "name", None) not in _C_METHODS and type(method).__name__ not in _C_METHODS
            or getattr(linear, "input_perm", None) is not None):  # GPTQ act-order permutes x first
        raise NotEligible(f"a projection runs on {type(method).__name__}, not a C kernel as it is")
    bias = linear.bias
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()):
        raise NotEligible("a bias is not a contiguous bf16 vector")
    bias_ptr = None if bias is None else bias.data_ptr()
    y_f32 = int(bool(getattr(linear, "float_output", False)))
    vnni = getattr(linear, "vnni_weight", None)
    if vnni is not None:
        if vnni.shape[1] * 2 != k:
            raise NotEligible("a packed weight does not fit its input")
        return Matmul(0, vnni.data_ptr(), None, None, bias_ptr, vnni.shape[0] * 16, 0, y_f32)
    codes = getattr(linear, "int4_c_codes", None)
    if codes is not None:
        scale, offset = linear.int4_c_scale, linear.int4_c_offset
        if codes.shape[1] * 4 != k:
            raise NotEligible("packed 4-bit codes do not fit their input")
        return Matmul(1, codes.data_ptr(), scale.data_ptr(), offset.data_ptr(), bias_ptr, codes.shape[0] * 16,
                      k // scale.shape[1], y_f32)
    raise NotEligible(f"a projection runs on {linear.quant_method.name}, not a C kernel")


def _norm(norm: nn.Module | None, norm_type: type, eps: float) -> int | None:
    if norm is None:
        return None
    if type(norm) is not norm_type or norm.weight.dtype != torch.bfloat16 or norm.eps != eps:
        raise NotEligible(f"a norm is not a bf16 {norm_type.__name__} with the model's eps")
    return norm.weight.data_ptr()


def _attention(layer: nn.Module, attn: nn.Module, rotary: nn.Module, shape: tuple[int, int, int]) -> tuple:
    """(cache, core) after the checks every form shares: heads, KV cache and scales, rotary table."""
    if (attn.num_heads, attn.num_kv_heads, attn.head_dim) != shape:
        raise NotEligible("layers differ in their heads")
    heads, kv_heads, _ = shape
    if heads % kv_heads or heads // kv_heads > 16:
        raise NotEligible("more than 16 query heads per KV head")
    if not rotary.is_neox or rotary.cos_sin_cache.dtype != torch.bfloat16:
        raise NotEligible("the rotary is not neox with a bf16 table")
    core = attn.attn
    cache = core.kv_cache
    if (cache is None or cache.dtype != torch.bfloat16 or not cache.is_contiguous() or core.k_scale != 1.0
            or core.v_scale != 1.0 or getattr(core, "calculate_kv_scales", False)):
        raise NotEligible("the KV cache is not a bf16 cache with unit scales")
    return cache, core


def _fill(layer: Layer, attn: nn.Module, mlp: nn.Module, h: int, inter: int, cache: torch.Tensor, core: nn.Module,
          shape: tuple[int, int, int]) -> Layer:
    heads, kv_heads, head_dim = shape
    layer.qkv, layer.o = matmul(attn.qkv_proj, h), matmul(attn.o_proj, heads * head_dim)
    layer.gate_up, layer.down = matmul(mlp.gate_up_proj, h), matmul(mlp.down_proj, inter)
    if (layer.qkv.n != (heads + 2 * kv_heads) * head_dim or layer.gate_up.n != 2 * inter or layer.o.n != h
            or layer.down.n != h or layer.qkv.y_f32):
        raise NotEligible("a projection's width or output differs from the layer's")
    layer.k_cache = cache.data_ptr()
    layer.v_cache = cache.data_ptr() + cache.stride(0) * cache.element_size()
    layer.window, layer.scale, layer.softcap = core.sliding_window or 0, core.scale, core.logit_softcap or 0.0
    return layer


def describe_llama(decoder: nn.Module, shape: tuple[int, int, int], h: int, inter: int, eps: float) -> list[Layer]:
    from aserve.model.layers.activation import SiluAndMul
    from aserve.model.layers.norm import RMSNorm
    from aserve.model.models.llama import LlamaMLP

    out = []
    for block in decoder.layers:
        attn, mlp = block.self_attn, block.mlp
        if type(mlp) is not LlamaMLP or type(mlp.act_fn) is not SiluAndMul or attn.rotary is not decoder.rotary:
            raise NotEligible("an MLP is not a dense gated SiLU, or attention has its own rotary")
        cache, core = _attention(block, attn, decoder.rotary, shape)
        layer = Layer(input_norm=_norm(block.input_layernorm, RMSNorm, eps),
                      post_norm=_norm(block.post_attention_layernorm, RMSNorm, eps),
                      q_norm=_norm(attn.q_norm, RMSNorm, eps), k_norm=_norm(attn.k_norm, RMSNorm, eps),
                      norm_offset=0.0, gemma=0, act=0, local_rotary=0)
        out.append(_fill(layer, attn, mlp, h, inter, cache, core, shape))
    return out


def describe_gemma(decoder: nn.Module, shape: tuple[int, int, int], h: int, inter: int, eps: float) -> list[Layer]:
    from aserve.model.layers.activation import GeluAndMul
    from aserve.model.layers.norm import GemmaRMSNorm
    from aserve.model.models.gemma import GemmaMLP

    local = decoder.local_rotary
    out = []
    for block in decoder.layers:
        attn, mlp = block.self_attn, block.mlp
        act = mlp.act_fn
        if (type(mlp) is not GemmaMLP or type(act) is not GeluAndMul or act.approximate != "tanh"
                or act.dtype != torch.bfloat16):
            raise NotEligible("an MLP is not a bf16 GELU-tanh GeGLU")
        uses_local = local is not None and attn.is_sliding
        cache, core = _attention(block, attn, local if uses_local else decoder.rotary, shape)
        layer = Layer(input_norm=_norm(block.input_layernorm, GemmaRMSNorm, eps),
                      post_norm=_norm(block.post_attention_layernorm, GemmaRMSNorm, eps),
                      pre_ff_norm=_norm(block.pre_feedforward_layernorm, GemmaRMSNorm, eps),
                      post_ff_norm=_norm(block.post_feedforward_layernorm, GemmaRMSNorm, eps),
                      q_norm=_norm(attn.q_norm, GemmaRMSNorm, eps), k_norm=_norm(attn.k_norm, GemmaRMSNorm, eps),
                      norm_offset=1.0, gemma=1, act=1, local_rotary=int(uses_local))
        out.append(_fill(layer, attn, mlp, h, inter, cache, core, shape))
    return out
