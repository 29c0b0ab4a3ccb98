"""Pipeline stages (model/pipeline.py, config/parallel.py): a model split into stages that each build and
load only their layers, composed through the residual stream, computes exactly what the whole model
computes (fp32, paged KV over prefill chunks and decodes), for Llama, Qwen2 (biases, sliding windows by
layer) and Qwen2-MoE (a dense layer among MoE ones, so global layer indices matter)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from aserve.config.parallel import pipeline_layer_range, stage_arch_config
from aserve.model.attention.torch_backend import TorchAttentionBackend
from aserve.model.loader import load_model
from aserve.model.pipeline import make_stage, stage_local_name
from tests.model._paged_batch import PagedBatch
from tests.model._tiny_models import engine_config
from tests.support.tiny_models import save_tiny_hf

STEPS = [[(0, 7), (1, 5)], [(0, 1), (1, 4)], [(0, 1), (1, 1)], [(0, 1), (1, 1)]]


def test_layers_split_evenly_front_loaded():
    assert [pipeline_layer_range(5, r, 2) for r in range(2)] == [(0, 3), (3, 5)]
    assert [pipeline_layer_range(8, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [pipeline_layer_range(7, r, 3) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]


def test_checkpoint_names_map_to_the_stage_local_layer():
    stage = SimpleNamespace(first_layer=3, num_hidden_layers=2)  # layers 3 and 4 of the checkpoint
    assert stage_local_name("model.layers.3.mlp.down_proj.weight", stage) == "model.layers.0.mlp.down_proj.weight"
    assert stage_local_name("model.layers.4.self_attn.q_proj.bias", stage) == "model.layers.1.self_attn.q_proj.bias"
    assert stage_local_name("model.layers.5.input_layernorm.weight", stage) is None
    assert stage_local_name("model.layers.2.input_layernorm.weight", stage) is None
    assert stage_local_name("model.embed_tokens.weight", stage) == "model.embed_tokens.weight"
    assert stage_local_name("h.3.attn.c_attn.weight", stage) == "h.0.attn.c_attn.weight"


def _forward(models, hooks, batches, chunks):
    """One step through the stages: each stage's stream feeds the next; the last returns hidden states."""
    stream = None
    for model, hook, batch in zip(models, hooks, batches):
        ids, pos, meta = batch.step(chunks)
        if hook is not None:
            hook.set_stream(stream)
        stream = model(ids, pos, meta)
    return stream


def _run(models, hooks) -> list[torch.Tensor]:
    arch = [m.arch for m in models]
    batches = [PagedBatch(a.num_hidden_layers, a.num_key_value_heads, a.head_dim, 8, 32, seed=3) for a in arch]
    for model, batch in zip(models, batches):
        model.bind_kv_caches(batch.kv_caches)
    prompts = [[(7 * i + 3) % 200 + 1 for i in range(12)], [(5 * i + 11) % 200 + 1 for i in range(10)]]
    done = [0, 0]
    outs = []
    with torch.no_grad():
        for step in STEPS:
            chunks = []
            for seq, n in step:
                chunks.append((seq, prompts[seq][done[seq]:done[seq] + n] or [prompts[seq][-1]]))
                done[seq] += n
            chunks.sort(key=lambda c: len(c[1]) != 1)
            outs.append(_forward(models, hooks, batches, chunks))
    return outs


@pytest.mark.parametrize("family, overrides", [
    ("llama", {"num_hidden_layers": 5}),
    ("qwen2", {"num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 6, "max_window_layers": 2}),
    ("qwen2_moe", {"num_hidden_layers": 3, "mlp_only_layers": [1]}),
])
@pytest.mark.parametrize("num_stages", [2, 3])
def test_stages_compose_to_the_whole_model(tmp_path, family, overrides, num_stages):
    save_tiny_hf(tmp_path, family, seed=7, **overrides)
    config = engine_config(tmp_path)
    backend = TorchAttentionBackend()
    whole = load_model(config, backend, "cpu")
    stages, hooks = [], []
    for rank in range(num_stages):
        arch = stage_arch_config(config.model.arch, rank, num_stages)
        stage_config = dataclasses.replace(config, model=dataclasses.replace(config.model, arch=arch))
        model = load_model(stage_config, backend, "cpu")
        assert len(model.model.layers) == arch.num_hidden_layers
        hooks.append(make_stage(model, is_first=rank == 0, is_last=rank == num_stages - 1))
        stages.append(model)
    want = _run([whole], [None])
    got = _run(stages, hooks)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    # the stages hold disjoint layers: together, the whole model's parameters once each (plus the
    # embedding, the final norm and the LM head, which every stage keeps)
    layer_params = sum(p.numel() for m in stages for p in m.model.layers.parameters())
    assert layer_params == sum(p.numel() for p in whole.model.layers.parameters())
