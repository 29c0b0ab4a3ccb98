"""`TransformersCausalLM`: transformers' model over aserve's paged attention. Random schedules of
chunks and decodes over a paged cache give transformers' own full-sequence logits, and the load-time
probe refuses what this path would compute differently, naming it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from aserve.config.model_impl import transformers_arch_config
from aserve.model.attention.torch_backend import TorchAttentionBackend
from aserve.model.models.transformers_backend import (
    ATTN_IMPLEMENTATION,
    TransformersCausalLM,
    UnsupportedModelError,
    aserve_paged_attention,
)
from aserve.model.models.transformers_loading import check_against_arch
from tests.model._tiny_models import hf_logits, load_ours, random_schedule, run_schedule

SIZES = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=256, initializer_range=0.1)


def _hf(config_cls, model_cls, **overrides):
    torch.manual_seed(0)
    return model_cls(config_cls(**{**SIZES, **overrides})).eval()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("family", ["gpt_neox", "mistral-window"])
def test_random_schedules_match_transformers(tmp_path, family, seed):
    if family == "gpt_neox":
        hf = _hf(transformers.GPTNeoXConfig, transformers.GPTNeoXForCausalLM, rotary_pct=0.5)
    else:  # prompts longer than the 12-token window
        hf = _hf(transformers.MistralConfig, transformers.MistralForCausalLM, num_key_value_heads=2, sliding_window=12)
    hf.save_pretrained(str(tmp_path))
    model = load_ours(tmp_path, model_impl="transformers")
    assert isinstance(model, TransformersCausalLM) and len(model.attention_layers) == 2
    prompts = [[(7 * i + 3 * s) % 256 for i in range(n)] for s, n in enumerate((30, 5, 19))]
    got = run_schedule(model, prompts, random_schedule([len(p) for p in prompts], seed), block_size=8)
    for prompt, logits in zip(prompts, got, strict=True):
        torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=1e-4, rtol=1e-4)


def _wrapped(hf) -> TransformersCausalLM:
    hf.set_attn_implementation(ATTN_IMPLEMENTATION)
    arch = transformers_arch_config({**hf.config.to_dict(), "architectures": [type(hf).__name__]})
    return TransformersCausalLM(hf, arch, TorchAttentionBackend(), torch.float32)


def _llama(**overrides):
    return _hf(transformers.LlamaConfig, transformers.LlamaForCausalLM, num_key_value_heads=2, **overrides)


def _patch_attention_call(hf, layer: int, **extra):
    """Layer `layer`'s attention module called with `extra` keyword arguments (reaching the function)."""
    attn = hf.model.layers[layer].self_attn
    forward = attn.forward
    attn.forward = lambda *args, **kwargs: forward(*args, **{**kwargs, **extra})


def test_probe_builds_one_attention_layer_per_decoder_layer():
    model = _wrapped(_llama(sliding_window=None))
    model.probe()
    assert [(a.num_heads, a.num_kv_heads, a.head_dim, a.sliding_window) for a in model.attention_layers] == \
        [(4, 2, 16, None)] * 2
    assert model.attention_layers[0].scale == pytest.approx(16 ** -0.5)


def test_layer_attending_outside_the_interface_is_refused():
    hf = _llama()
    hf.model.layers[1].self_attn.forward = lambda hidden_states, *a, **k: (torch.zeros_like(hidden_states), None)
    with pytest.raises(UnsupportedModelError, match=r"1 of its 2 layers attend through transformers' "
                                                    r"AttentionInterface"):
        _wrapped(hf).probe()


@pytest.mark.parametrize("extra,reason", [
    (dict(position_bias=torch.zeros(1)), r"takes \['position_bias'\]"),
    (dict(s_aux=torch.zeros(4)), r"takes \['s_aux'\]"),
    (dict(is_causal=False), "non-causal"),
    (dict(attention_mask=torch.zeros(1, 1, 8, 8)), "builds its own attention mask"),  # sees every token
])
def test_what_the_paged_attention_cannot_apply_is_refused(extra, reason):
    hf = _llama()
    _patch_attention_call(hf, 0, **extra)
    with pytest.raises(UnsupportedModelError, match=reason):
        _wrapped(hf).probe()


def test_a_causal_mask_passed_by_the_model_is_accepted():
    hf = _llama()
    causal = torch.ones(8, 8, dtype=torch.bool).tril()[None, None]
    _patch_attention_call(hf, 0, attention_mask=causal)
    _wrapped(hf).probe()


def test_logits_the_model_computes_differently_are_refused():
    hf = _llama()
    forward = hf.forward

    def scaled(*args, **kwargs):  # as a family whose forward rescales logits (MiniCPM-style)
        out = forward(*args, **kwargs)
        out.logits = out.logits * 2
        return out

    hf.forward = scaled
    with pytest.raises(UnsupportedModelError, match="turns the decoder's hidden states into logits"):
        _wrapped(hf).probe()


def test_final_logit_softcapping_is_applied():
    hf = _hf(transformers.Gemma2Config, transformers.Gemma2ForCausalLM, num_key_value_heads=2, head_dim=16,
             final_logit_softcapping=0.5, attn_logit_softcapping=2.0, query_pre_attn_scalar=16)
    model = _wrapped(hf)
    model.probe()  # would refuse if compute_logits missed the cap
    assert model.compute_logits(torch.randn(3, 64) * 100).abs().max() <= 0.5
    assert {a.logit_softcap for a in model.attention_layers} == {2.0}


def test_shapes_that_disagree_with_config_json_are_refused():
    model = _wrapped(_llama())
    model.arch = dataclasses.replace(model.arch, head_dim=8)
    with pytest.raises(UnsupportedModelError, match=r"layer 0 attends with 4 query / 2 KV heads of 16 dims, but "
                                                    r"config.json gives 4 / 2 heads of 8 dims"):
        model.probe()
    hf = _llama()
    arch = transformers_arch_config({**hf.config.to_dict(), "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(UnsupportedModelError, match="transformers reads num_key_value_heads=2 from config.json, "
                                                    "aserve read 4"):
        check_against_arch(hf.config, dataclasses.replace(arch, num_key_value_heads=4))


def test_attention_function_outside_an_aserve_forward_raises():
    q = torch.zeros(1, 4, 3, 16)
    with pytest.raises(RuntimeError, match="runs only inside an aserve model's forward"):
        aserve_paged_attention(torch.nn.Module(), q, q[:, :2], q[:, :2], None)
