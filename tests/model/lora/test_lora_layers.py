"""LoRALinearMethod on single layers: over quantized bases (base result + the exact delta), no work
without a mapping, tensor-parallel slicing (COLUMN rows per part, ROW input columns), the forward context."""

from __future__ import annotations

import pytest
import torch

from aserve.distributed.context import ParallelContext
from aserve.kernels.lora_ops import lora_delta_dense, ref_lora_expand, ref_lora_shrink
from aserve.model.forward_context import ForwardContext, get_forward_context, set_forward_context
from aserve.model.layers.linear import COLUMN, ROW, Linear, MergedLinear
from aserve.model.lora.layers import (
    LoRALinearMethod,
    LoRAShardWeights,
    add_lora_delta,
    add_lora_to_layer,
    clear_slot,
    set_slot,
)
from aserve.model.lora.mapping import build_lora_mapping
from aserve.model.quantization import load_time_method
from tests.model.lora._lora_models import lora_config

IN, SIZES = 64, [64, 32, 32]


def _merged(method=None, bias=True, tp: tuple[int, int] | None = None, replicas=None):
    layer = MergedLinear(IN, [s // (tp[1] // (replicas or (1, 1, 1))[i]) if tp else s for i, s in enumerate(SIZES)],
                         bias=bias)
    if tp:
        layer.set_tensor_parallel(ParallelContext(tp_rank=tp[0], tp_size=tp[1]), COLUMN, replicas)
    if method is not None:
        layer.set_quant_method(method)
    gen = torch.Generator().manual_seed(0)
    layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=gen) * 0.1)
    layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=gen))
    layer.process_weights_after_loading()
    return layer


def _shards(gen, ranks=(8, 4, None), in_size=IN, sizes=SIZES, bias=False):
    return [None if r is None else LoRAShardWeights(torch.randn(r, in_size, generator=gen),
                                                    torch.randn(size, r, generator=gen),
                                                    torch.randn(size, generator=gen) if bias else None)
            for r, size in zip(ranks, sizes, strict=True)]


def _delta(x, shards, sizes=SIZES):
    """Naive delta of one adapter for every row of x."""
    parts = []
    for w, size in zip(shards, sizes, strict=True):
        if w is None:
            parts.append(torch.zeros(x.shape[0], size))
        else:
            parts.append(x @ w.lora_a.T @ w.lora_b.T + (w.lora_bias if w.lora_bias is not None else 0))
    return torch.cat(parts, 1)


@pytest.mark.parametrize("method", [None, "int4", "int8"])
def test_quantized_base_plus_exact_delta(method):
    layer = _merged(load_time_method(method) if method else None)
    x = torch.randn(7, IN)
    base = layer(x)  # before wrapping
    add_lora_to_layer(layer, lora_config(max_loras=2, enable_lora_bias=True), "cpu")
    assert isinstance(layer.quant_method, LoRALinearMethod) and layer.quant_method.name.endswith("+lora")
    gen = torch.Generator().manual_seed(1)
    s0, s1 = _shards(gen, bias=True), _shards(gen, ranks=(None, 16, 2))
    set_slot(layer, 0, s0)
    set_slot(layer, 1, s1)
    slots = [0, -1, 1, 1, 0, -1, 0]
    with set_forward_context(ForwardContext(lora=build_lora_mapping(slots, "cpu"))):
        got = layer(x)
    want = base.clone()
    for t, s in enumerate(slots):
        if s >= 0:
            want[t] += _delta(x[t:t + 1], (s0, s1)[s])[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    assert torch.equal(layer(x), base)  # outside a forward context: exactly the base result


def test_no_mapping_returns_the_base_tensor_itself():
    layer = Linear(16, 8)
    layer.weight.data.normal_()
    add_lora_to_layer(layer, lora_config(), "cpu")
    x = torch.randn(3, 16)
    with set_forward_context(ForwardContext()):
        assert torch.equal(layer(x), x @ layer.weight.T)
    assert get_forward_context().lora is None


def test_forward_context_is_scoped_and_nested():
    outer, inner = ForwardContext(lora=build_lora_mapping([0], "cpu")), ForwardContext()
    with set_forward_context(outer):
        assert get_forward_context() is outer
        with pytest.raises(RuntimeError), set_forward_context(inner):
            assert get_forward_context() is inner
            raise RuntimeError
        assert get_forward_context() is outer
    assert get_forward_context() == ForwardContext()


def test_bf16_model_float32_lora_adds_in_output_dtype():
    layer = Linear(16, 8, dtype=torch.bfloat16)
    layer.weight.data.normal_()
    add_lora_to_layer(layer, lora_config(lora_dtype="float32"), "cpu")
    w = LoRAShardWeights(torch.randn(4, 16), torch.randn(8, 4))
    set_slot(layer, 0, [w])
    x = torch.randn(2, 16).to(torch.bfloat16)
    with set_forward_context(ForwardContext(lora=build_lora_mapping([0, -1], "cpu"))):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    want = (x @ layer.weight.T).float()[0] + x[0].float() @ w.lora_a.T @ w.lora_b.T
    torch.testing.assert_close(y[0].float(), want, atol=0.1, rtol=0.02)


@pytest.mark.parametrize("replicas", [None, (1, 2, 2)], ids=["split", "kv-replicated"])
def test_column_parallel_takes_each_parts_rows(replicas):
    """Two COLUMN ranks' outputs, each part's slice placed side by side, equal the whole layer's delta."""
    gen = torch.Generator().manual_seed(2)
    shards = _shards(gen, bias=True)
    x = torch.randn(5, IN)
    mapping = build_lora_mapping([0] * 5, "cpu")
    want = _delta(x, shards)
    full_parts = want.split(SIZES, 1)
    for rank in range(2):
        layer = _merged(tp=(rank, 2), replicas=replicas)
        add_lora_to_layer(layer, lora_config(enable_lora_bias=True), "cpu")
        set_slot(layer, 0, shards)
        got = add_lora_delta(layer, x, torch.zeros(5, layer.output_size), mapping).split(layer.output_sizes, 1)
        for i, (part, piece) in enumerate(zip(full_parts, got, strict=True)):
            pieces = 2 // (replicas[i] if replicas else 1)
            local = SIZES[i] // pieces
            start = (rank // (replicas[i] if replicas else 1)) * local
            torch.testing.assert_close(piece, part[:, start:start + local], atol=1e-4, rtol=1e-5)


def test_row_parallel_partial_deltas_sum_to_the_whole():
    gen = torch.Generator().manual_seed(3)
    w = LoRAShardWeights(torch.randn(8, 32, generator=gen), torch.randn(16, 8, generator=gen),
                         torch.randn(16, generator=gen))
    x = torch.randn(4, 32)
    mapping = build_lora_mapping([0, 0, -1, 0], "cpu")
    total = torch.zeros(4, 16)
    for rank in range(2):
        layer = Linear(16, 16)
        layer.set_tensor_parallel(ParallelContext(tp_rank=rank, tp_size=2), ROW)
        add_lora_to_layer(layer, lora_config(enable_lora_bias=True), "cpu")
        set_slot(layer, 0, [w])
        assert layer.lora_adds_bias == (rank == 0)
        total += add_lora_delta(layer, x[:, rank * 16:(rank + 1) * 16], torch.zeros(4, 16), mapping)
    want = x @ w.lora_a.T @ w.lora_b.T + w.lora_bias
    want[2] = 0
    torch.testing.assert_close(total, want, atol=1e-4, rtol=1e-5)


def test_set_slot_refuses_what_does_not_fit():
    layer = _merged()
    add_lora_to_layer(layer, lora_config(max_lora_rank=8), "cpu")
    gen = torch.Generator().manual_seed(4)
    with pytest.raises(ValueError, match="rank 16 exceeds"):
        set_slot(layer, 0, _shards(gen, ranks=(16, None, None)))
    with pytest.raises(ValueError, match="3 shard"):
        set_slot(layer, 0, _shards(gen)[:2])
    with pytest.raises(ValueError, match="enable_lora_bias"):
        set_slot(layer, 0, _shards(gen, bias=True, ranks=(4, None, None)))
    with pytest.raises(ValueError, match="already"):
        add_lora_to_layer(layer, lora_config(), "cpu")


@pytest.mark.parametrize("path", ["dense", "grouped"])
def test_cpu_dense_and_grouped_paths_give_the_naive_delta(path, monkeypatch):
    """Small CPU steps take the dense path (every slot at once, masked), long ones the grouped path:
    both must give each token exactly its own adapter's delta (bias included), base tokens none."""
    import aserve.model.lora.layers as lora_layers

    monkeypatch.setattr(lora_layers, "DENSE_MAX_TOKENS", 10_000 if path == "dense" else 0)
    layer = _merged()
    add_lora_to_layer(layer, lora_config(max_loras=3, enable_lora_bias=True), "cpu")
    assert layer.lora_b_dense is not None
    gen = torch.Generator().manual_seed(3)
    adapters = {0: _shards(gen, (8, 4, None), bias=True), 2: _shards(gen, (16, 16, 2), bias=True)}
    for slot, shards in adapters.items():
        set_slot(layer, slot, shards)
    set_slot(layer, 1, _shards(gen, (8, 8, 8)))  # resident but used by no token
    slots = [2, -1, 0, 2, 0, -1, 2]
    x = torch.randn(len(slots), IN, generator=gen)
    base = layer(x)
    with set_forward_context(ForwardContext(lora=build_lora_mapping(slots, "cpu"))):
        got = layer(x)
    expected = base.clone()
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected[t] += _delta(x[t:t + 1], adapters[slot])[0]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_tokens", [7, 300], ids=["decode-sized", "prefill-sized"])
def test_bf16_cpu_layers_take_the_c_kernel_and_agree_with_the_torch_path(num_tokens, monkeypatch):
    """bf16 LoRA weights on CPU go to the C kernel (one call per layer, any step size): fp32 math rounded
    once, so within one bf16 step of the fp32 reference; the torch fallback (dense) agrees loosely (it
    also rounds the shrink to bf16)."""
    import aserve.model.lora.layers as lora_layers
    from aserve.kernels import lora_cpu

    if lora_cpu.load() is None:
        pytest.skip("the LoRA C kernel cannot be built here")
    layer = _merged()
    layer.to(torch.bfloat16)
    add_lora_to_layer(layer, lora_config(lora_dtype="bfloat16", enable_lora_bias=True), "cpu")
    assert layer.lora_cpu_kernel is not None and layer.lora_b_tiles is not None
    gen = torch.Generator().manual_seed(6)
    set_slot(layer, 0, _shards(gen, (8, 4, None), bias=True))
    set_slot(layer, 2, _shards(gen, (16, 16, 2)))
    slots = [(2, -1, 0, 2, 0, -1, 2)[t % 7] for t in range(num_tokens)]
    x = torch.randn(num_tokens, IN, generator=gen).bfloat16()
    base = layer(x)
    mapping = build_lora_mapping(slots, "cpu")
    with set_forward_context(ForwardContext(lora=mapping)):
        got = layer(x)
    calls = []
    monkeypatch.setattr(lora_layers, "lora_delta_dense", lambda *a, **k: calls.append(1) or lora_delta_dense(*a, **k))
    monkeypatch.setattr(layer, "lora_cpu_kernel", None)  # the torch fallback (dense: DENSE_MAX_TOKENS raised)
    monkeypatch.setattr(lora_layers, "DENSE_MAX_TOKENS", 10_000)
    with set_forward_context(ForwardContext(lora=mapping)):
        want = layer(x)
    assert calls
    base_rows = torch.tensor(slots) < 0
    assert torch.equal(got[base_rows], base[base_rows])
    # fp32 math on the stored bf16 weights, rounded once: the C kernel is within one bf16 step of it
    exact = ref_lora_expand(ref_lora_shrink(x, layer.lora_a, mapping.token_slots), layer.lora_b,
                            mapping.token_slots, base.float(), layer.lora_output_slices, layer.lora_bias)
    step = exact.abs().clamp_min(1e-30) * 2**-7
    assert bool(((got.float() - exact).abs() <= step).all())
    torch.testing.assert_close(want.float(), exact, atol=0.5, rtol=0.05)  # the torch path rounds the shrink too
    clear_slot(layer, 2)
    assert not layer.lora_b_tiles[2].any() and layer.lora_rank_array.tolist() == [8, 0, 0]
