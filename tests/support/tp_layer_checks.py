"""The body of one rank of tests/distributed/test_parallel_layers.py: every tensor-parallel layer form
against the same layer unsharded, in a real gloo group (a module of its own so spawned ranks can import
it). Every check builds the full layer from a seed both ranks share, then this rank's slice loaded
from the full checkpoint tensors, and compares outputs (float32; the sums only change order)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from aserve.distributed.collectives import all_gather_last_dim, all_reduce, all_reduce_min
from aserve.distributed.context import ParallelContext, init_distributed, shutdown_distributed
from aserve.distributed.rendezvous import Rendezvous
from aserve.model.layers.embedding import LMHead, VocabEmbedding
from aserve.model.layers.linear import COLUMN, ROW, Conv1DLinear, Linear, MergedConv1DLinear, MergedLinear
from aserve.model.layers.moe import FusedMoE
from aserve.model.quantization.int8 import Int8WeightOnlyMethod

H = 16  # hidden size of every check


def _close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = 1e-5) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.allclose(got, want, atol=atol, rtol=1e-5), f"{what}: max diff {(got - want).abs().max()}"


def _full(cls, *args, bias: bool = False, seed: int = 0, **kwargs):
    """An unsharded layer with random weights (the same on every rank); its checkpoint tensors."""
    layer = cls(*args, bias=bias, dtype=torch.float32, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    layer.weight.data = torch.randn(layer.weight.shape, generator=gen)
    tensors = {"weight": layer.weight.data.clone()}
    if bias:
        layer.bias.data = torch.randn(layer.bias.shape, generator=gen)
        tensors["bias"] = layer.bias.data.clone()
    return layer, tensors


def check_collectives(ctx: ParallelContext, x: torch.Tensor) -> None:
    """Shared memory (tensors that fit a slot) and gloo (larger ones) give the same sums and gathers."""
    from aserve.distributed.shm import SLOT_BYTES

    assert ctx.shm is not None, "CPU ranks on x86 use the shared-memory collectives"
    for numel in (7, SLOT_BYTES // 4 + 1):  # fits a slot; one float more than a slot (gloo)
        for dtype in (torch.float32, torch.bfloat16):
            mine = torch.randn(numel, generator=torch.Generator().manual_seed(ctx.tp_rank)).to(dtype)
            want = mine.clone()
            dist.all_reduce(want, group=ctx.group)
            assert torch.equal(all_reduce(mine.clone(), ctx), want), f"all_reduce of {numel} {dtype}"
            got = all_gather_last_dim(mine.view(1, -1), ctx)
            parts = [torch.randn(numel, generator=torch.Generator().manual_seed(r)).to(dtype)
                     for r in range(ctx.tp_size)]
            assert torch.equal(got, torch.cat(parts).view(1, -1)), f"all_gather of {numel} {dtype}"


def check_column(ctx: ParallelContext, x: torch.Tensor) -> None:
    full, ckpt = _full(Linear, H, 12, bias=True)
    local = Linear(H, 12 // ctx.tp_size, bias=True, dtype=torch.float32)
    local.set_tensor_parallel(ctx, COLUMN)
    for name, tensor in ckpt.items():
        local.load_shard(getattr(local, name), tensor)
    _close(all_gather_last_dim(local(x), ctx), full(x), "column-parallel Linear (gathered)")


def check_column_int8(ctx: ParallelContext, x: torch.Tensor) -> None:
    """Per-output-channel int8 on column slices: each rank's rows are the full layer's rows, exactly."""
    full, ckpt = _full(Linear, H, 32)
    full.set_quant_method(Int8WeightOnlyMethod())
    full.load_shard(full.weight, ckpt["weight"])
    full.process_weights_after_loading()
    local = Linear(H, 32 // ctx.tp_size, dtype=torch.float32)
    local.set_tensor_parallel(ctx, COLUMN)
    local.set_quant_method(Int8WeightOnlyMethod())
    local.load_shard(local.weight, ckpt["weight"])
    local.process_weights_after_loading()
    _close(all_gather_last_dim(local(x), ctx), full(x), "column-parallel int8 Linear")


def check_row_int8(ctx: ParallelContext, x: torch.Tensor) -> None:
    """int8 on row slices: each rank quantizes its own columns (finer scales than one rank's), so the
    reduced output is within int8 noise of the float layer."""
    full, ckpt = _full(Linear, 32, H, bias=True, seed=8)
    xin = torch.randn(x.shape[0], 32, generator=torch.Generator().manual_seed(9))
    local = Linear(32 // ctx.tp_size, H, bias=True, dtype=torch.float32)
    local.set_tensor_parallel(ctx, ROW)
    local.set_quant_method(Int8WeightOnlyMethod())
    for name, tensor in ckpt.items():
        local.load_shard(getattr(local, name), tensor)
    local.process_weights_after_loading()
    width = 32 // ctx.tp_size
    want = full(xin)
    _close(local(xin[:, ctx.tp_rank * width:(ctx.tp_rank + 1) * width]), want, "row-parallel int8 Linear",
           atol=0.02 * float(want.abs().max()))


def check_merged_qkv_with_replicated_kv(ctx: ParallelContext, x: torch.Tensor) -> None:
    """q has 4 heads of 2, k and v 1 head each: with 2 ranks each rank takes 2 q heads and the whole
    (replicated) k and v; loaded part by part and from an already-fused tensor alike."""
    sizes = [8, 2, 2]
    full, ckpt = _full(MergedLinear, H, sizes, bias=True)
    replicas = (1, ctx.tp_size, ctx.tp_size)
    local_sizes = [8 // ctx.tp_size, 2, 2]
    q, k, v = full.split(full(x))
    r = ctx.tp_rank
    want = torch.cat([q[:, r * local_sizes[0]:(r + 1) * local_sizes[0]], k, v], dim=-1)
    for fused in (False, True):
        local = MergedLinear(H, local_sizes, bias=True, dtype=torch.float32)
        local.set_tensor_parallel(ctx, COLUMN, replicas)
        for name, tensor in ckpt.items():
            if fused:
                local.load_shard(getattr(local, name), tensor)
            else:
                for i, part in enumerate(tensor.split(sizes, dim=0)):
                    local.load_shard(getattr(local, name), part, i)
        _close(local(x), want, f"merged q|k|v, replicated k/v ({'fused' if fused else 'per part'} checkpoint)")


def check_merged_gate_up(ctx: ParallelContext, x: torch.Tensor) -> None:
    full, ckpt = _full(MergedLinear, H, [12, 12])
    local = MergedLinear(H, [12 // ctx.tp_size] * 2, dtype=torch.float32)
    local.set_tensor_parallel(ctx, COLUMN)
    for i, part in enumerate(ckpt["weight"].split([12, 12], dim=0)):
        local.load_shard(local.weight, part, i)
    gate, up = full.split(full(x))
    local_gate, local_up = local.split(local(x))
    _close(all_gather_last_dim(local_gate, ctx), gate, "merged gate (each part split on its own)")
    _close(all_gather_last_dim(local_up, ctx), up, "merged up")


def check_row_with_bias(ctx: ParallelContext, x: torch.Tensor) -> None:
    """Input columns split, partial outputs all-reduced, the bias added once."""
    full, ckpt = _full(Linear, 12, H, bias=True, seed=1)
    xin = torch.randn(x.shape[0], 12, generator=torch.Generator().manual_seed(2))
    local = Linear(12 // ctx.tp_size, H, bias=True, dtype=torch.float32)
    local.set_tensor_parallel(ctx, ROW)
    for name, tensor in ckpt.items():
        local.load_shard(getattr(local, name), tensor)
    width = 12 // ctx.tp_size
    _close(local(xin[:, ctx.tp_rank * width:(ctx.tp_rank + 1) * width]), full(xin), "row-parallel Linear + bias")


def check_conv1d_forms(ctx: ParallelContext, x: torch.Tensor) -> None:
    """GPT-2's transposed checkpoints: fused q|k|v column-parallel, c_proj row-parallel."""
    full_qkv, ckpt_qkv = _full(MergedConv1DLinear, H, [H] * 3, bias=True, seed=3)
    local_qkv = MergedConv1DLinear(H, [H // ctx.tp_size] * 3, bias=True, dtype=torch.float32)
    local_qkv.set_tensor_parallel(ctx, COLUMN)
    local_qkv.load_shard(local_qkv.weight, ckpt_qkv["weight"].t())  # stored [in, out]
    local_qkv.load_shard(local_qkv.bias, ckpt_qkv["bias"])
    full_proj, ckpt_proj = _full(Conv1DLinear, H, H, bias=True, seed=4)
    local_proj = Conv1DLinear(H // ctx.tp_size, H, bias=True, dtype=torch.float32)
    local_proj.set_tensor_parallel(ctx, ROW)
    local_proj.load_shard(local_proj.weight, ckpt_proj["weight"].t())
    local_proj.load_shard(local_proj.bias, ckpt_proj["bias"])
    want = full_proj(sum(full_qkv.split(full_qkv(x))))
    _close(local_proj(sum(local_qkv.split(local_qkv(x)))), want, "Conv1D column -> row")


def check_vocab_parallel(ctx: ParallelContext, x: torch.Tensor) -> None:
    """An odd vocabulary (11 rows: 6 + 5 and a padding row): lookups of every id, logits gathered."""
    vocab = 11
    gen = torch.Generator().manual_seed(5)
    table, head_w = torch.randn(vocab, H, generator=gen), torch.randn(vocab, H, generator=gen)
    ids = torch.tensor([0, 5, 6, 10, 3, 10])
    emb = VocabEmbedding(vocab, H, dtype=torch.float32)
    emb.set_vocab_parallel(ctx)
    emb.load_shard(emb.weight, table)
    _close(emb(ids), table[ids], "vocab-parallel embedding")
    head = LMHead(vocab, H, dtype=torch.float32)
    head.set_vocab_parallel(ctx)
    head.load_shard(head.weight, head_w)
    _close(head(x), x @ head_w.t(), "vocab-parallel LM head")
    tied_emb = VocabEmbedding(vocab, H, dtype=torch.float32)
    tied_head = LMHead(vocab, H, dtype=torch.float32, tie_to=tied_emb)
    tied_head.set_vocab_parallel(ctx)
    tied_emb.set_vocab_parallel(ctx)
    tied_emb.load_shard(tied_emb.weight, table)
    assert tied_head.weight is tied_emb.weight
    _close(tied_head(x), x @ table.t(), "tied vocab-parallel LM head")


def check_moe_experts(ctx: ParallelContext, x: torch.Tensor) -> None:
    """Every expert's intermediate dim split, loaded per expert and stacked; output all-reduced."""
    num_experts, inter = 4, 8
    gen = torch.Generator().manual_seed(6)
    gate_up = torch.randn(num_experts, 2 * inter, H, generator=gen) * H**-0.5
    down = torch.randn(num_experts, H, inter, generator=gen) * inter**-0.5
    full = FusedMoE(num_experts, H, inter, torch.float32)
    full.gate_up_proj.data, full.down_proj.data = gate_up.clone(), down.clone()
    weights = torch.rand(x.shape[0], 2, generator=gen).softmax(-1)
    ids = torch.stack([torch.arange(x.shape[0]) % num_experts, (torch.arange(x.shape[0]) + 1) % num_experts], 1)
    want = full(x, weights, ids)
    for stacked in (False, True):
        local = FusedMoE(num_experts, H, inter // ctx.tp_size, torch.float32)
        local.set_tensor_parallel(ctx)
        if stacked:
            local.load_shard(local.gate_up_proj, gate_up)
            local.load_shard(local.down_proj, down)
        else:
            for e in range(num_experts):
                local.load_expert_shard(local.gate_up_proj, gate_up[e, :inter], e, 0)
                local.load_expert_shard(local.gate_up_proj, gate_up[e, inter:], e, 1)
                local.load_expert_shard(local.down_proj, down[e], e, None)
        _close(local(x, weights, ids), want, f"MoE experts ({'stacked' if stacked else 'per expert'} checkpoint)")


CHECKS = [check_collectives, check_column, check_column_int8, check_row_int8, check_merged_qkv_with_replicated_kv,
          check_merged_gate_up, check_row_with_bias, check_conv1d_forms, check_vocab_parallel, check_moe_experts]


def run_rank(rank: int, world_size: int, port: int) -> None:
    """torch.multiprocessing.spawn's entry: join the group, run every check; raises on the first failure."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    ctx = init_distributed(Rendezvous("127.0.0.1", port, world_size, "gloo", timeout_s=60), rank)
    try:
        assert all_reduce_min(10 + rank, ctx) == 10
        x = torch.randn(5, H, generator=torch.Generator().manual_seed(7))
        for check in CHECKS:
            check(ctx, x)
    finally:
        shutdown_distributed()


def join_alone(port: int, timeout_s: float) -> None:
    """Rank 0 of 2 whose peer never comes: must raise within about `timeout_s`."""
    init_distributed(Rendezvous("127.0.0.1", port, 2, "gloo", timeout_s=timeout_s), 0)
