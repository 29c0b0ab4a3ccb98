"""The native decode step's view of a sparse MoE block (`SparseMoeBlock`: Mixtral, Qwen2-MoE, Qwen3-MoE):
`kernels/cpu_decode.h`'s `decode_moe`, with the router, every expert's projections (as their layer's
method left them for the C matmuls), the shared expert and its gate, and scratch for the step's rows
shared by every sparse layer of the model."""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from aserve.runner.cpu_decode_layers import _I, _P, Matmul, NotEligible, StepShape, matmul


class Moe(ctypes.Structure):
    _fields_ = [("router", Matmul), ("gate_up", _P), ("down", _P), ("num_experts", _I), ("top_k", _I),
                ("renormalize", _I), ("inter", _I), ("shared_gate_up", Matmul), ("shared_down", Matmul),
                ("shared_gate", Matmul), ("shared_inter", _I), ("logits", _P), ("ids", _P), ("weights", _P),
                ("members", _P), ("member_weights", _P), ("x_rows", _P), ("gate_up_out", _P), ("act_out", _P),
                ("expert_out", _P), ("shared_gate_out", _P)]


def _scratch(d: StepShape, experts: int, top_k: int, width: int) -> list[torch.Tensor]:
    """The buffers `decode_moe` names (logits .. shared_gate_out) for d.max_rows rows, shared by every
    sparse layer of the same sizes (one set in the MoE models aserve has)."""
    key = (experts, top_k, width)
    if key not in d.moe_scratch:
        rows, f32 = d.max_rows, torch.float32
        d.moe_scratch[key] = [
            torch.empty(rows, experts, dtype=f32), torch.empty(rows, top_k, dtype=torch.int64),
            torch.empty(rows, top_k, dtype=f32), torch.empty(rows, dtype=torch.int64), torch.empty(rows, dtype=f32),
            torch.empty(rows, d.hidden, dtype=torch.bfloat16), torch.empty(rows, 2 * width, dtype=f32),
            torch.empty(rows, width, dtype=torch.bfloat16), torch.empty(rows, d.hidden, dtype=f32),
            torch.empty(rows, dtype=f32)]
    return d.moe_scratch[key]


def describe_moe(block: nn.Module, d: StepShape) -> Moe:
    """The C form of `block` (kept alive in d.keep); NotEligible when an expert's method has no C operand
    or the experts' output is not float32 (the C block sums them in float32)."""
    from aserve.model.layers.activation import SiluAndMul
    from aserve.model.models.llama import LlamaMLP

    experts, h = block.experts, d.hidden
    if experts.gate_up_experts is None or experts.parallel is not None or not experts.float_output:
        raise NotEligible("MoE experts are not per-expert C-kernel projections with float32 output")
    inter, method = experts.intermediate_size, experts.quant_method
    gate_up = (Matmul * experts.num_experts)(*(matmul(p, h, method) for p in experts.gate_up_experts))
    down = (Matmul * experts.num_experts)(*(matmul(p, inter, method) for p in experts.down_experts))
    if any(m.n != 2 * inter for m in gate_up) or any(m.n != h for m in down):
        raise NotEligible("an expert's projection width differs from the block's")
    router = matmul(block.gate, h)
    if router.n != experts.num_experts:
        raise NotEligible("the router's width is not the number of experts")
    moe = Moe(router=router, gate_up=ctypes.addressof(gate_up), down=ctypes.addressof(down),
              num_experts=experts.num_experts, top_k=block.top_k, renormalize=int(block.renormalize), inter=inter)
    widest = inter
    shared = block.shared_expert
    if shared is not None:
        if type(shared) is not LlamaMLP or type(shared.act_fn) is not SiluAndMul:
            raise NotEligible("the shared expert is not a gated SiLU MLP")
        moe.shared_inter = shared.down_proj.input_size
        moe.shared_gate_up = matmul(shared.gate_up_proj, h)
        moe.shared_down = matmul(shared.down_proj, moe.shared_inter)
        moe.shared_gate = matmul(block.shared_expert_gate, h)
        if moe.shared_gate.n != 1 or moe.shared_down.n != h or moe.shared_gate_up.n != 2 * moe.shared_inter:
            raise NotEligible("the shared expert's widths differ from the block's")
        widest = max(widest, moe.shared_inter)
    buffers = _scratch(d, experts.num_experts, block.top_k, widest)
    for name, buffer in zip([f[0] for f in Moe._fields_[-10:]], buffers):
        setattr(moe, name, buffer.data_ptr())
    d.keep.extend((gate_up, down, moe))
    return moe
