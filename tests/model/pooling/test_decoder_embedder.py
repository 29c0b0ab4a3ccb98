"""Causal decoders as embedders (Qwen3-Embedding / gte-Qwen2 style): the causal model's final normed
hidden state at each sequence's last token, normalized, vs transformers' `AutoModel` last hidden state;
several prompts of different lengths in one packed paged prefill."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from aserve.model.attention.torch_backend import TorchAttentionBackend
from aserve.config.pooler import PoolingType, resolve_pooler_config
from aserve.model.pooling.loading import load_pooling_model
from aserve.model.pooling.pooler import Pooler
from tests.model._paged_batch import PagedBatch
from tests.model._tiny_models import load_ours
from tests.support.tiny_models import VOCAB, save_tiny_hf

LENGTHS = [9, 2, 17, 5]


def _prompts(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]


def _pooled(model, prompts, architecture):
    arch = model.arch
    batch = PagedBatch(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, 16, 16, dtype=model.dtype)
    model.bind_kv_caches(batch.kv_caches)
    chunks = sorted(enumerate(prompts), key=lambda c: len(c[1]) != 1)
    input_ids, positions, meta = batch.step(chunks)
    config = resolve_pooler_config(None, architecture, "embed")
    assert config.pooling_type == PoolingType.LAST and config.normalize
    with torch.no_grad():
        pooled = Pooler(config)(model(input_ids, positions, meta), meta.query_start_loc_cpu)
    order = [seq for seq, _ in chunks]
    return pooled[torch.tensor(order).argsort()]


def _reference(path, prompts):
    hf = transformers.AutoModel.from_pretrained(str(path), attn_implementation="eager").eval()
    with torch.no_grad():
        last = torch.stack([hf(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts])
    return torch.nn.functional.normalize(last.float(), dim=-1)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_causal_last_token_embedding_matches_transformers(tmp_path, family):
    save_tiny_hf(tmp_path, family)
    architecture = json.loads((tmp_path / "config.json").read_text())["architectures"][0]
    prompts = _prompts()
    ref = _reference(tmp_path, prompts)
    for model in (load_ours(tmp_path),  # the generating model's forward already returns final-normed hidden rows
                  load_pooling_model(str(tmp_path), backend=TorchAttentionBackend())):  # its LM-head-free embedder
        ours = _pooled(model, prompts, architecture)
        cos = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
        assert cos.min() >= 0.9999, cos


def test_embedder_loads_a_bare_decoder_checkpoint(tmp_path):
    """Qwen3-Embedding-style folders: the decoder's weights without the `model.` prefix and no LM head."""
    from safetensors.torch import save_file

    hf = save_tiny_hf(tmp_path, "qwen3", seed=2)
    (tmp_path / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in hf.model.state_dict().items()}, str(tmp_path / "model.safetensors"))
    model = load_pooling_model(str(tmp_path), backend=TorchAttentionBackend())
    assert model.lm_head is None
    with pytest.raises(RuntimeError, match="no LM head"):
        model.compute_logits(torch.zeros(1, model.arch.hidden_size))
    prompts = _prompts(seed=1)
    ours = _pooled(model, prompts, "Qwen3ForCausalLM")
    assert torch.nn.functional.cosine_similarity(ours, _reference(tmp_path, prompts), dim=-1).min() >= 0.9999
