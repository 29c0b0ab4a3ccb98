"""A CPU decode step's decoder layers in one native call (`kernels/cpu_decode_step.c`): no Python, no
`nn.Module` calls and no tensor allocations between the ops of a step, for bf16 models whose
projections run on aserve's C kernels.

The runner builds it after binding the KV cache (`CpuDecodeStep.build`, None when the model does not
qualify; the reason is logged once) and uses it for steps where every row decodes one token, with no
padding and no LoRA. The embedding (with learned positions where the family has them) and the final
norm stay the model's own modules. For the RMSNorm families the call runs the same kernels in the same
order as the layer-by-layer forward, so its hidden states are bitwise the same (below FLOAT_GEMM_MIN_ROWS
rows: from there the layers' products on the AVX2 form are a float32 GEMM, `kernels/cpu_float_gemm.py`,
within rounding of the kernels, while this call keeps the kernels at any size); GPT-2 and OPT (whose
LayerNorms and activations are torch ops layer by layer) and MoE blocks (whose routing softmax is) agree
within bf16 rounding. The layers remain the reference and the fallback. With torch's thread count at
two or more the call's threads share its ops as one team (`kernels/cpu_team.h`: no barrier between ops,
a chunk a paused thread holds finished by another; the same bits), `team_threads` says how many.

Qualifies: the decoder forms `cpu_decode_layers.py` describes (Llama, Mistral, Qwen2, Qwen3, Phi-3,
Mixtral, Qwen2-MoE, Qwen3-MoE; Gemma 2 and 3; GPT-2; OPT, pre- and post-LN) with every projection on a C
kernel (`linear_vnni` bf16 on AVX512-BF16 or AVX2 + FMA, the unpacked bf16 kernel, `linear_int4`: GGUF Q4, GPTQ / AWQ
without act-order), a bf16 KV cache with unit scales, one rank.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import nn

from aserve.kernels.c_build import log_once
from aserve.kernels.cpu_ops import CpuKernels
from aserve.runner import cpu_decode_layers as layers_c
from aserve.runner.cpu_decode_layers import Layer, NotEligible, StepShape

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_ARGTYPES = (_P, _I, _P, _P, _P, _P, _P, _P, _I, _P, _I, _P, _P, _I, _I, _I, _I, _I, _I, _F, *([_P] * 11), _I)


class _Form(NamedTuple):
    """A decoder class's layers (`describe`), its first attention module, how a step's rows are embedded
    and how the last layer's output becomes the model's output."""

    describe: Callable[[nn.Module, StepShape], list[Layer]]
    blocks: Callable[[nn.Module], nn.ModuleList]
    attention: Callable[[nn.Module], nn.Module]
    embed: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    finish: Callable[[nn.Module, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _embed_scaled(decoder: nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    x = decoder.embed_tokens(ids)
    scale = getattr(decoder, "embed_scale", None)  # as the model does (Gemma), in the activations' dtype
    return x if scale is None else x * torch.tensor(scale, dtype=x.dtype)


def _embed_opt(decoder: nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    x = decoder.embed_tokens(ids)
    if decoder.project_in is not None:
        x = decoder.project_in(x)
    return x + decoder.embed_positions(positions)


def _finish_opt(decoder: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    if decoder.final_layer_norm is not None:
        x, _ = decoder.final_layer_norm(x, residual)
    return x if decoder.project_out is None else decoder.project_out(x)


def _forms() -> dict[type, _Form]:
    from aserve.model.models.gemma import GemmaModel
    from aserve.model.models.gpt2 import GPT2Model
    from aserve.model.models.llama import LlamaModel
    from aserve.model.models.opt import OPTDecoder

    def llama(describe):
        return _Form(describe, lambda d: d.layers, lambda b: b.self_attn.attn, _embed_scaled,
                     lambda d, x, residual: d.norm(x, residual)[0])

    gpt2 = _Form(layers_c.describe_gpt2, lambda d: d.h, lambda b: b.attn.attn,
                 lambda d, ids, pos: d.wte(ids) + d.wpe(pos), lambda d, x, residual: d.ln_f(x, residual)[0])
    opt = _Form(layers_c.describe_opt, lambda d: d.layers, lambda b: b.self_attn.attn, _embed_opt, _finish_opt)
    return {LlamaModel: llama(layers_c.describe_llama), GemmaModel: llama(layers_c.describe_gemma),
            GPT2Model: gpt2, OPTDecoder: opt}


def decoder_width(decoder: nn.Module) -> int:
    """The width of the residual stream: what the positions or tokens are embedded into."""
    for name in ("embed_positions", "wpe", "embed_tokens"):
        table = getattr(decoder, name, None)
        if table is not None:
            return int(table.weight.shape[1])
    raise NotEligible(f"{type(decoder).__name__} has no embedding table")


class CpuDecodeStep:
    """The bound model's decode layers as one call; scratch for up to `max_rows` decode rows."""

    def __init__(self, model: nn.Module, kernels: CpuKernels, max_rows: int):
        decoder = model.model
        form = _forms().get(type(decoder))
        if form is None:
            raise NotEligible(f"{type(decoder).__name__} has no native decode form")
        self.decoder, self.form = decoder, form
        first = form.attention(form.blocks(decoder)[0])
        self.shape = (first.num_heads, first.num_kv_heads, first.head_dim)
        self.hidden_size = decoder_width(decoder)
        self.eps = _norm_eps(form.blocks(decoder)[0])
        self.rotary, self.local_rotary = getattr(decoder, "rotary", None), getattr(decoder, "local_rotary", None)
        shape = StepShape(self.shape, self.hidden_size, self.eps, max_rows)
        layers = form.describe(decoder, shape)
        self._keep = shape  # what the structs point into (keep: MoE descriptors; moe_scratch)
        self._layers = (Layer * len(layers))(*layers)
        self.post_ln = bool(layers[-1].post_ln)  # the last layer leaves no residual stream
        self.block_size = first.kv_cache.shape[2]
        self.max_rows = max_rows
        heads, kv_heads, head_dim = self.shape
        rows, h, q_width, kv_width = max_rows, self.hidden_size, heads * head_dim, kv_heads * head_dim
        widest = max(layer.gate_up.n for layer in layers)
        inter = max([_down_input(layer) for layer in layers] + [1])
        bf16, f32 = torch.bfloat16, torch.float32
        self._hidden = torch.empty(rows, h, dtype=f32)  # bf16 rows at its start where the layers leave bf16
        self._residual = (torch.empty(rows, h, dtype=f32), torch.empty(rows, h, dtype=f32))
        self._scratch = [torch.empty(rows, h, dtype=bf16), torch.empty(rows, (heads + 2 * kv_heads) * head_dim,
                                                                       dtype=bf16),
                         torch.empty(rows, q_width, dtype=bf16), torch.empty(rows, kv_width, dtype=bf16),
                         torch.empty(rows, q_width, dtype=bf16), torch.empty(rows, h, dtype=f32),
                         torch.empty(rows, max(widest, 1), dtype=f32), torch.empty(rows, inter, dtype=bf16),
                         torch.empty(rows, q_width, dtype=bf16), torch.empty(rows, kv_width, dtype=bf16),
                         torch.empty(rows, h, dtype=bf16)]
        self._fn = kernels.decode_layers
        self._fn.argtypes = _ARGTYPES
        # The step's ops shared by a team of this many threads (kernels/cpu_team.h); < 2: a region per kernel.
        self.team_threads = torch.get_num_threads()

    @classmethod
    def build(cls, model: nn.Module, kernels: CpuKernels | None, max_rows: int) -> CpuDecodeStep | None:
        """The step for `model` (its KV cache bound), or None when it does not qualify (logged once)."""
        if kernels is None or not kernels.packed_matmuls:
            return None
        try:
            step = cls(model, kernels, max_rows)
        except (NotEligible, AttributeError, IndexError) as e:
            log_once(logging.INFO, f"CPU decode: layer by layer ({type(model).__name__}: {e})")
            return None
        on_team = (step.team_threads >= 2 and kernels.packed_isa == "avx2"  # (the C step's own rule: cpu_decode_step.c)
                   and not any(layer.moe for layer in step._layers))
        team = f"one team of {step.team_threads} threads" if on_team else "a region per kernel"
        log_once(logging.INFO, f"CPU decode: {type(model).__name__}'s {len(step._layers)} layers in one native call "
                               f"({team})")
        return step

    def can_run(self, meta, num_rows: int) -> bool:
        """Every row one decode token, no padding rows, at most `max_rows`."""
        return meta.num_decodes == meta.num_seqs == num_rows <= self.max_rows and meta.block_tables.stride(1) == 1

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The model's output for a decode-only step (`can_run`): what its forward returns, `[B, hidden]`."""
        rows, h = input_ids.shape[0], self.hidden_size
        embedded = self.form.embed(self.decoder, input_ids, positions)
        cos_sin = self.rotary.cos_sin(positions) if self.rotary is not None else embedded
        local = self.local_rotary.cos_sin(positions) if self.local_rotary is not None else cos_sin
        rot_half = cos_sin.shape[1] // 2 if self.rotary is not None else 0
        hidden, residual = self._hidden, self._residual
        tables = meta.block_tables
        status = self._fn(self._layers, len(self._layers), embedded.data_ptr(), hidden.data_ptr(),
                          residual[0].data_ptr(), residual[1].data_ptr(), cos_sin.data_ptr(), local.data_ptr(),
                          rot_half, tables.data_ptr(), tables.stride(0), meta.seq_lens.data_ptr(),
                          meta.slot_mapping.data_ptr(), rows, h, *self.shape, self.block_size, self.eps,
                          *(t.data_ptr() for t in self._scratch), self.team_threads)
        if status < 0:
            raise RuntimeError(f"CPU decode step: a projection's kernel failed ({status})")
        out = hidden[:rows] if status & 2 else hidden.view(-1).view(torch.bfloat16)[:rows * h].view(rows, h)
        return self.form.finish(self.decoder, out, None if self.post_ln else residual[status & 1][:rows])


def _down_input(layer: Layer) -> int:
    """The width of a dense MLP's activation (0 for a sparse block, whose scratch is its own)."""
    if layer.moe:
        return 0
    gated = layer.act in (layers_c.ACT_SILU_AND_MUL, layers_c.ACT_GELU_TANH_AND_MUL)
    return layer.gate_up.n // 2 if gated else layer.gate_up.n


def _norm_eps(block: nn.Module) -> float:
    """The eps of a block's first norm (the forms check that every norm of the model has it)."""
    return float(next(m.eps for m in block.modules() if type(m).__name__.endswith("Norm")))
