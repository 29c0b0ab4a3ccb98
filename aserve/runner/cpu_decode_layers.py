"""What the native CPU decode step (`cpu_decode_step.py`) needs to know of a model's decoder layers: one
C struct per layer (`kernels/cpu_decode_step.c`'s `decode_layer`) holding pointers to its packed weights,
norms and KV cache halves, read from the layers the model built. Each family form it knows is described
here, with everything that would make the C call differ from the layer's own forward refused
(`NotEligible`), so the model's layers stay the reference.

Forms: Llama (`LlamaModel`: Llama, Mistral, Qwen2, Qwen3 with per-head q/k norms, Phi-3, and the MoE
families on the same decoder, whose sparse blocks `cpu_decode_moe.py` describes), Gemma (`GemmaModel`:
Gemma 2 and 3: normalized attention and MLP outputs, `1 + w` norms, GELU-tanh, score soft-capping, Gemma
3's local rotary for sliding layers), GPT-2 and OPT (LayerNorms with biases, learned positions, a plain
GELU / ReLU MLP; OPT's post-LN layers too).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import torch
from torch import nn

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# Linear methods whose packed operands the C matmuls take as they are (no change to x before the matmul).
_C_METHODS = ("cpu_bf16_kernel", "int4", "gguf", "CheckpointIntMethod")
_LINEARS = ("Linear", "MergedLinear", "Conv1DLinear", "MergedConv1DLinear", "ExpertProjection")
# cpu_common.h's activation numbers.
ACT_SILU_AND_MUL, ACT_GELU_TANH_AND_MUL, ACT_GELU_TANH, ACT_RELU, ACT_GELU = range(5)


class Matmul(ctypes.Structure):
    _fields_ = [("kind", _I), ("weight", _P), ("scale", _P), ("offset", _P), ("bias", _P), ("n", _I),
                ("group_size", _I), ("y_f32", _I)]


class Layer(ctypes.Structure):
    _fields_ = [("input_norm", _P), ("post_norm", _P), ("pre_ff_norm", _P), ("post_ff_norm", _P), ("q_norm", _P),
                ("k_norm", _P), ("input_norm_bias", _P), ("post_norm_bias", _P), ("qkv", Matmul), ("o", Matmul),
                ("gate_up", Matmul), ("down", Matmul), ("moe", _P), ("k_cache", _P), ("v_cache", _P),
                ("window", _I), ("scale", _F), ("softcap", _F), ("norm_offset", _F), ("gemma", _I), ("act", _I),
                ("local_rotary", _I), ("rotary", _I), ("layer_norm", _I), ("post_ln", _I)]


class NotEligible(Exception):
    """Why a model does not take the native decode step."""


@dataclass
class StepShape:
    """What a form reads besides the decoder: heads `(num_heads, num_kv_heads, head_dim)`, the hidden size,
    the norms' eps, the most rows a step takes, and `keep`: what the C structs point into that nothing
    else holds (the step keeps it alive)."""

    heads: tuple[int, int, int]
    hidden: int
    eps: float
    max_rows: int
    keep: list = field(default_factory=list)
    moe_scratch: dict = field(default_factory=dict)  # MoE blocks' buffers by (experts, top_k, width)


def matmul(linear: nn.Module, k: int, method=None) -> Matmul:
    """The C descriptor of a Linear (or an MoE expert's projection, with its layer's `method`) whose
    method left its operands for the kernels (`linear [.., k] -> [.., n]`)."""
    if type(linear).__name__ not in _LINEARS or getattr(linear, "parallel_form", None):
        raise NotEligible(f"{type(linear).__name__} is not a plain Linear")
    method = method if method is not None else linear.quant_method
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
    weight = getattr(linear, "weight", None)  # the unpacked bf16 kernel's operand (widths it does not pack)
    if (getattr(method, "name", None) == "cpu_bf16_kernel" and weight is not None and weight.dtype == torch.bfloat16
            and weight.dim() == 2 and weight.shape[1] == k and weight.is_contiguous()):
        return Matmul(2, weight.data_ptr(), None, None, bias_ptr, weight.shape[0], 0, y_f32)
    raise NotEligible(f"a projection runs on {getattr(method, 'name', type(method).__name__)}, not a C kernel")


def _norm(norm: nn.Module | None, norm_type: type, eps: float) -> int | None:
    if norm is None:
        return None
    if type(norm) is not norm_type or norm.eps != eps or (norm.weight is not None
                                                          and norm.weight.dtype != torch.bfloat16):
        raise NotEligible(f"a norm is not a bf16 {norm_type.__name__} with the model's eps")
    return None if norm.weight is None else norm.weight.data_ptr()


def _bias(norm: nn.Module) -> int | None:
    bias = norm.bias
    return None if bias is None else bias.data_ptr()


def _attention(core: nn.Module, rotary: nn.Module | None, shape: tuple[int, int, int]) -> torch.Tensor:
    """The cache after the checks every form shares: heads, KV cache and scales, rotary table."""
    if (core.num_heads, core.num_kv_heads, core.head_dim) != shape:
        raise NotEligible("layers differ in their heads")
    heads, kv_heads, _ = shape
    if heads % kv_heads or heads // kv_heads > 16:
        raise NotEligible("more than 16 query heads per KV head")
    if rotary is not None and (not rotary.is_neox or rotary.cos_sin_cache.dtype != torch.bfloat16):
        raise NotEligible("the rotary is not neox with a bf16 table")
    cache = core.kv_cache
    if (cache is None or cache.dtype != torch.bfloat16 or not cache.is_contiguous() or core.k_scale != 1.0
            or core.v_scale != 1.0 or getattr(core, "calculate_kv_scales", False)):
        raise NotEligible("the KV cache is not a bf16 cache with unit scales")
    return cache


def _fill(layer: Layer, qkv: nn.Module, o: nn.Module, fc1: nn.Module | None, fc2: nn.Module | None, h: int,
          core: nn.Module, rotary: nn.Module | None, shape: tuple[int, int, int]) -> Layer:
    """The projections (an MLP's two unless its block is sparse), the cache and the attention's numbers;
    `rotary`: the table the layer's attention uses (None: positions are embedded)."""
    heads, kv_heads, head_dim = shape
    cache = _attention(core, rotary, shape)
    layer.qkv, layer.o = matmul(qkv, h), matmul(o, heads * head_dim)
    if layer.qkv.n != (heads + 2 * kv_heads) * head_dim or layer.o.n != h or layer.qkv.y_f32:
        raise NotEligible("an attention projection's width or output differs from the layer's")
    if fc1 is not None and fc2 is not None:
        layer.gate_up = matmul(fc1, h)
        gated = layer.act in (ACT_SILU_AND_MUL, ACT_GELU_TANH_AND_MUL)
        layer.down = matmul(fc2, layer.gate_up.n // 2 if gated else layer.gate_up.n)
        if layer.down.n != h or (gated and layer.gate_up.n % 2):
            raise NotEligible("an MLP projection's width differs from the layer's")
    layer.k_cache = cache.data_ptr()
    layer.v_cache = cache.data_ptr() + cache.stride(0) * cache.element_size()
    layer.window, layer.scale, layer.softcap = core.sliding_window or 0, core.scale, core.logit_softcap or 0.0
    return layer


def describe_llama(decoder: nn.Module, d: StepShape) -> list[Layer]:
    shape, h, eps = d.heads, d.hidden, d.eps
    from aserve.model.layers.activation import SiluAndMul
    from aserve.model.layers.norm import RMSNorm
    from aserve.model.models.llama import LlamaMLP
    from aserve.model.models.moe import SparseMoeBlock
    from aserve.runner.cpu_decode_moe import describe_moe

    out = []
    for block in decoder.layers:
        attn, mlp = block.self_attn, block.mlp
        sparse = type(mlp) is SparseMoeBlock
        if not sparse and (type(mlp) is not LlamaMLP or type(mlp.act_fn) is not SiluAndMul):
            raise NotEligible("an MLP is not a dense gated SiLU or a sparse MoE block")
        if attn.rotary is not decoder.rotary:
            raise NotEligible("attention has its own rotary")
        layer = Layer(input_norm=_norm(block.input_layernorm, RMSNorm, eps),
                      post_norm=_norm(block.post_attention_layernorm, RMSNorm, eps),
                      q_norm=_norm(attn.q_norm, RMSNorm, eps), k_norm=_norm(attn.k_norm, RMSNorm, eps),
                      norm_offset=0.0, act=ACT_SILU_AND_MUL, rotary=1)
        if sparse:
            layer.moe = ctypes.addressof(describe_moe(mlp, d))
        out.append(_fill(layer, attn.qkv_proj, attn.o_proj, None if sparse else mlp.gate_up_proj,
                         None if sparse else mlp.down_proj, h, attn.attn, decoder.rotary, shape))
    return out


def describe_gemma(decoder: nn.Module, d: StepShape) -> list[Layer]:
    shape, h, eps = d.heads, d.hidden, d.eps
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
        layer = Layer(input_norm=_norm(block.input_layernorm, GemmaRMSNorm, eps),
                      post_norm=_norm(block.post_attention_layernorm, GemmaRMSNorm, eps),
                      pre_ff_norm=_norm(block.pre_feedforward_layernorm, GemmaRMSNorm, eps),
                      post_ff_norm=_norm(block.post_feedforward_layernorm, GemmaRMSNorm, eps),
                      q_norm=_norm(attn.q_norm, GemmaRMSNorm, eps), k_norm=_norm(attn.k_norm, GemmaRMSNorm, eps),
                      norm_offset=1.0, gemma=1, act=ACT_GELU_TANH_AND_MUL, local_rotary=int(uses_local), rotary=1)
        out.append(_fill(layer, attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj, h, attn.attn,
                         local if uses_local else decoder.rotary, shape))
    return out


def _plain_act(act: nn.Module) -> int:
    """The C number of a non-gated activation module (`get_act_fn`'s)."""
    if type(act) is nn.ReLU:
        return ACT_RELU
    if type(act) is nn.GELU:
        return ACT_GELU_TANH if act.approximate == "tanh" else ACT_GELU
    raise NotEligible(f"the MLP's activation {type(act).__name__} has no C form")


def _layer_norms(norm1: nn.Module, norm2: nn.Module, eps: float, **fields) -> Layer:
    from aserve.model.layers.norm import LayerNorm

    return Layer(input_norm=_norm(norm1, LayerNorm, eps), input_norm_bias=_bias(norm1),
                 post_norm=_norm(norm2, LayerNorm, eps), post_norm_bias=_bias(norm2), layer_norm=1, **fields)


def describe_gpt2(decoder: nn.Module, d: StepShape) -> list[Layer]:
    shape, h, eps = d.heads, d.hidden, d.eps
    out = []
    for block in decoder.h:
        attn, mlp = block.attn, block.mlp
        layer = _layer_norms(block.ln_1, block.ln_2, eps, act=_plain_act(mlp.act))
        out.append(_fill(layer, attn.c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj, h, attn.attn, None, shape))
    return out


def describe_opt(decoder: nn.Module, d: StepShape) -> list[Layer]:
    shape, h, eps = d.heads, d.hidden, d.eps
    out = []
    for block in decoder.layers:
        attn = block.self_attn
        layer = _layer_norms(block.self_attn_layer_norm, block.final_layer_norm, eps, act=_plain_act(block.act),
                             post_ln=int(not block.pre_norm))
        out.append(_fill(layer, attn.qkv_proj, attn.out_proj, block.fc1, block.fc2, h, attn.attn, None, shape))
    return out
