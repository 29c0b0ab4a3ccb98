"""Mixture-of-experts families over the paged KV cache equal Hugging Face transformers (fp32): Mixtral,
Qwen2-MoE (shared expert, dense and sparse layers mixed), Qwen3-MoE (q/k norm, `norm_topk_prob` both
ways); per-expert checkpoint tensors stacked by the loader (a missing one reported), their config
fields parsed once, and the experts' Linear methods (bf16 CPU kernels, int8) within rounding."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from aserve.config import ArchConfig, ConfigError
from aserve.config.families import MoeFields
from aserve.model.layers.moe import FusedMoE
from aserve.model.models.moe import SparseMoeBlock
from tests.model._parity import parity, teacher_forced_parity
from tests.model._tiny_models import hf_logits, load_ours, random_schedule, run_schedule
from tests.support.tiny_models import GREEDY_STABLE, VOCAB, save_tiny_hf


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


def _logits(model, lengths=(37, 6, 50, 21), seed=4):
    prompts = _prompts(list(lengths), seed)
    return prompts, run_schedule(model, prompts, random_schedule(list(lengths), seed=seed + 1), block_size=16,
                                 seed=seed + 2)


@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        pytest.param("mixtral", {}, id="mixtral"),
        pytest.param("mixtral", {"sliding_window": 8, "tie_word_embeddings": True, "num_local_experts": 6},
                     id="mixtral-window-tied-6-experts"),
        # Layers 0, 2, 3 dense (step 2 makes 1 and 3 sparse; 3 is mlp-only): dense and sparse mixed.
        pytest.param("qwen2_moe", {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]},
                     id="qwen2-moe-shared-sparse-step-mlp-only"),
        pytest.param("qwen2_moe", {"norm_topk_prob": True, "mlp_only_layers": [0]}, id="qwen2-moe-norm-topk"),
        pytest.param("qwen3_moe", {}, id="qwen3-moe-norm-topk"),
        pytest.param("qwen3_moe", {"norm_topk_prob": False, "attention_bias": True, "num_experts": 4},
                     id="qwen3-moe-unnormalized-bias"),
    ],
)
def test_moe_matches_transformers(tmp_path, family, overrides):
    hf = save_tiny_hf(tmp_path, family, seed=3, **overrides)
    prompts, logits = _logits(load_ours(tmp_path))
    for tokens, got in zip(prompts, logits, strict=True):
        torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


def test_layer_kinds_follow_sparse_step_and_mlp_only_layers(tmp_path):
    save_tiny_hf(tmp_path, "qwen2_moe", num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])
    ours = load_ours(tmp_path)
    kinds = [type(layer.mlp).__name__ for layer in ours.model.layers]
    assert kinds == ["LlamaMLP", "SparseMoeBlock", "LlamaMLP", "LlamaMLP"]
    block = ours.model.layers[1].mlp
    assert block.shared_expert is not None and block.experts.gate_up_proj.shape == (8, 96, 64)
    assert ours.model.layers[0].mlp.gate_up_proj.output_size == 2 * 96  # dense: intermediate_size


def _drop_and_save(path, transform):
    file = next(path.glob("*.safetensors"))
    save_file(transform(load_file(str(file))), str(file), metadata={"format": "pt"})


def test_missing_expert_tensor_is_reported(tmp_path):
    save_tiny_hf(tmp_path, "mixtral")
    _drop_and_save(tmp_path, lambda t: {k: v for k, v in t.items()
                                        if k != "model.layers.1.block_sparse_moe.experts.2.w3.weight"})
    with pytest.raises(ValueError, match=r"missing 1 weight\(s\): model\.layers\.1\.mlp\.experts\.2\.w3\.weight"):
        load_ours(tmp_path)


def test_expert_id_out_of_range_is_refused(tmp_path):
    save_tiny_hf(tmp_path, "qwen3_moe", num_experts=4)
    _drop_and_save(tmp_path, lambda t: {**t, "model.layers.0.mlp.experts.4.down_proj.weight":
                                        t["model.layers.0.mlp.experts.0.down_proj.weight"].clone()})
    with pytest.raises(ValueError, match="experts.4.down_proj.weight.*expert 4 out of range"):
        load_ours(tmp_path)


def test_stacked_expert_checkpoint_loads(tmp_path):
    """transformers' in-memory form (`experts.gate_up_proj [E, 2I, H]`, `experts.down_proj`) loads whole."""
    hf = save_tiny_hf(tmp_path, "qwen3_moe", num_experts=4)

    def stack(tensors):
        out = {k: v for k, v in tensors.items() if ".experts." not in k}
        for layer in range(2):
            p = f"model.layers.{layer}.mlp.experts"
            out[f"{p}.gate_up_proj"] = torch.stack([torch.cat([tensors[f"{p}.{e}.gate_proj.weight"],
                                                               tensors[f"{p}.{e}.up_proj.weight"]]) for e in range(4)])
            out[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(4)])
        return out

    _drop_and_save(tmp_path, stack)
    prompts, logits = _logits(load_ours(tmp_path), lengths=(9, 14))
    for tokens, got in zip(prompts, logits, strict=True):
        torch.testing.assert_close(got, hf_logits(hf, tokens), atol=1e-4, rtol=1e-4)


_BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2}


def test_family_fields_parsed_once():
    mixtral = ArchConfig.from_hf_dict({**_BASE, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                                       "sliding_window": 16})
    assert mixtral.family == MoeFields(8, 2, 96, 0, True, 1, ())
    assert mixtral.layer_sliding_windows == (16,) * 4 and mixtral.rope_theta == 1e6
    qwen2 = ArchConfig.from_hf_dict({**_BASE, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 6,
                                     "num_experts_per_tok": 3, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 48, "decoder_sparse_step": 2,
                                     "mlp_only_layers": [3], "use_sliding_window": True, "sliding_window": 8,
                                     "max_window_layers": 3})
    assert qwen2.family == MoeFields(6, 3, 32, 48, False, 2, (3,))
    assert [qwen2.family.is_sparse(i) for i in range(4)] == [False, True, False, False]
    assert qwen2.attention_bias  # qkv_bias defaults to True
    assert qwen2.layer_sliding_windows == (8, None, 8, None)  # Qwen2MoeConfig: even layers below max_window_layers
    qwen3 = ArchConfig.from_hf_dict({**_BASE, "architectures": ["Qwen3MoeForCausalLM"], "num_local_experts": 4,
                                     "moe_intermediate_size": 32, "num_experts_per_tok": 2,
                                     "shared_expert_intermediate_size": 64, "norm_topk_prob": True})
    assert qwen3.family == MoeFields(4, 2, 32, 0, True, 1, ())  # Qwen3-MoE has no shared expert


@pytest.mark.parametrize(("key", "value"), [("scoring_func", "sigmoid"), ("routed_scaling_factor", 2.5),
                                            ("n_group", 4), ("hidden_act", "gelu"), ("num_experts_per_tok", 9)])
def test_unimplemented_router_options_are_refused(key, value):
    cfg = {**_BASE, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8, key: value}
    with pytest.raises(ConfigError, match=key):
        ArchConfig.from_hf_dict(cfg)


@pytest.fixture(scope="module")
def qwen2_moe_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_moe")
    save_tiny_hf(path, "qwen2_moe", seed=5, num_hidden_layers=3, mlp_only_layers=[1], moe_intermediate_size=64)
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_quantizes_the_experts(qwen2_moe_dir, dtype):
    """--quantization int8 reaches every expert's projections (through the Linear method hook)."""
    want = _logits(load_ours(qwen2_moe_dir), lengths=(19, 4))[1]
    ours = load_ours(qwen2_moe_dir, dtype, quantization="int8")
    for layer in (ours.model.layers[0], ours.model.layers[2]):
        experts = layer.mlp.experts
        assert experts.quant_method.name == "int8" and len(experts.down_experts) == 8
        assert all(hasattr(p, "int8_weight") for p in (*experts.gate_up_experts, *experts.down_experts))
    for got, ref in zip(_logits(ours, lengths=(19, 4))[1], want, strict=True):
        torch.testing.assert_close(got.float(), ref, atol=0.2, rtol=0.05)


@pytest.mark.parametrize(("family", "overrides"), [("mixtral", {}), ("qwen2_moe", {"mlp_only_layers": [1]}),
                                                   ("qwen3_moe", {})])
def test_bf16_is_as_faithful_as_transformers_bf16(tmp_path, family, overrides):
    """As tests/model/test_family_bf16.py: the CPU bf16 experts (C kernels or oneDNN per expert)."""
    hf = save_tiny_hf(tmp_path, family, seed=5, **{**GREEDY_STABLE, **overrides})
    rng = random.Random(9)
    sequences = [[rng.randrange(3, 500) for _ in range(40)] for _ in range(8)]
    ours = teacher_forced_parity(load_ours(tmp_path, "float32"), load_ours(tmp_path, "bfloat16"), sequences, start=8)
    theirs = parity([hf_logits(hf, s) for s in sequences], [hf_logits(hf.to(torch.bfloat16), s) for s in sequences],
                    start=8)
    assert ours.top1_agreement >= theirs.top1_agreement - 0.01, f"aserve {ours}; transformers {theirs}"
    assert ours.mean_kl <= 2 * theirs.mean_kl + 1e-3, f"aserve {ours}; transformers {theirs}"


def test_compiled_graph_calls_the_experts_as_one_op(qwen2_moe_dir):
    """CPU -O3 compiles the decode forward with fullgraph=True; the expert loop is one opaque op there."""
    ours = load_ours(qwen2_moe_dir, "bfloat16")
    block: SparseMoeBlock = ours.model.layers[0].mlp
    assert isinstance(block.experts, FusedMoE)
    x = torch.randn(3, 64).to(torch.bfloat16)
    with torch.no_grad():
        want = block(x).float()
        got = torch.compile(block, fullgraph=True, backend="aot_eager")(x).float()
    torch.testing.assert_close(got, want, atol=0.02, rtol=0.02)  # eager may keep float32 where the op rounds
