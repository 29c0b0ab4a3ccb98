"""Tiny random BERT encoders (built and saved here with transformers) through aserve's BertModel /
BertForSequenceClassification and poolers vs transformers, several sequences of different lengths
packed into one forward, with token-type ids."""

from __future__ import annotations

import pytest
import torch
import transformers

from aserve.config import ArchConfig
from aserve.config.hf_config import read_hf_config
from aserve.model.attention.bidirectional import EncoderMetadata
from aserve.model.models.bert import BertForSequenceClassification, BertModel
from aserve.config.pooler import PoolerConfig, PoolingType
from aserve.model.pooling.loading import load_pooling_model, pooler_for
from aserve.model.pooling.pooler import ClassifierPooler, Pooler

TINY = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "max_position_embeddings": 64, "type_vocab_size": 2,
        "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}
LENGTHS = [7, 1, 12, 3, 12, 5]


def _save(path, model_cls, seed=0, **overrides):
    config = transformers.BertConfig(**{**TINY, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # zero-initialised biases and unit LayerNorms would hide loading mistakes
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
            elif "LayerNorm.weight" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def _batch(seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, TINY["vocab_size"], (n,), generator=gen) for n in LENGTHS]
    types = [torch.cat([torch.zeros(n // 2, dtype=torch.int64), torch.ones(n - n // 2, dtype=torch.int64)])
             for n in LENGTHS]
    return ids, types


def _ours(model, ids, types):
    meta = EncoderMetadata.from_seq_lens([len(x) for x in ids])
    with torch.no_grad():
        return model(torch.cat(ids), None, meta, torch.cat(types)), meta


def _hf_hidden(hf, ids, types):
    with torch.no_grad():
        return [hf(input_ids=i[None], token_type_ids=t[None]).last_hidden_state[0] for i, t in zip(ids, types)]


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a, b, dim=-1)


def test_arch_config_parses_bert():
    arch = ArchConfig.from_hf_dict({**TINY, "architectures": ["BertModel"], "layer_norm_eps": 1e-7})
    assert arch.is_encoder and arch.attention_bias and arch.hidden_act == "gelu"
    assert arch.family.layer_norm_eps == 1e-7 and arch.family.type_vocab_size == 2
    assert arch.num_key_value_heads == 4 and arch.head_dim == 16 and arch.max_position_embeddings == 64
    llama = ArchConfig.from_hf_dict({**TINY, "architectures": ["LlamaForCausalLM"]})
    assert not llama.is_encoder and llama.hidden_act == "silu"


@pytest.mark.parametrize("pooling", [PoolingType.MEAN, PoolingType.CLS, PoolingType.LAST])
def test_bert_pooling_matches_transformers(tmp_path, pooling):
    hf = _save(tmp_path, transformers.BertModel)
    model = load_pooling_model(str(tmp_path))
    assert isinstance(model, BertModel)
    ids, types = _batch()
    hidden, meta = _ours(model, ids, types)
    ref_rows = _hf_hidden(hf, ids, types)
    torch.testing.assert_close(hidden, torch.cat(ref_rows), atol=2e-5, rtol=1e-4)
    pooled = Pooler(PoolerConfig(pooling_type=pooling, normalize=True))(hidden, meta.query_start_loc)
    pick = {PoolingType.MEAN: lambda h: h.mean(0), PoolingType.CLS: lambda h: h[0], PoolingType.LAST: lambda h: h[-1]}
    ref = torch.stack([pick[pooling](h) for h in ref_rows])
    assert _cos(pooled, ref).min() >= 0.9999
    torch.testing.assert_close(pooled, torch.nn.functional.normalize(ref, dim=-1), atol=1e-5, rtol=1e-4)


def test_bert_default_pooling_is_normalized_cls_and_all_gives_token_rows(tmp_path):
    hf = _save(tmp_path, transformers.BertModel, seed=3)
    model = load_pooling_model(str(tmp_path))
    pooler = pooler_for(model, str(tmp_path))  # no sentence-transformers files: the architecture's default
    assert pooler.config.pooling_type == PoolingType.CLS and pooler.config.normalize
    ids, types = _batch(seed=4)
    hidden, meta = _ours(model, ids, types)
    ref_rows = _hf_hidden(hf, ids, types)
    assert _cos(pooler(hidden, meta.query_start_loc), torch.stack([h[0] for h in ref_rows])).min() >= 0.9999
    rows = Pooler(PoolerConfig(pooling_type=PoolingType.ALL, normalize=False))(hidden, meta.query_start_loc.tolist())
    assert [r.shape[0] for r in rows] == LENGTHS
    for ours, ref in zip(rows, ref_rows, strict=True):
        torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)


def test_bert_matryoshka_dimensions_truncate_before_normalizing(tmp_path):
    _save(tmp_path, transformers.BertModel)
    model = load_pooling_model(str(tmp_path))
    ids, types = _batch()
    hidden, meta = _ours(model, ids, types)
    full = Pooler(PoolerConfig(pooling_type=PoolingType.MEAN, normalize=False))(hidden, meta.query_start_loc)
    short = Pooler(PoolerConfig(pooling_type=PoolingType.MEAN, normalize=True, dimensions=16))(hidden,
                                                                                               meta.query_start_loc)
    torch.testing.assert_close(short, torch.nn.functional.normalize(full[:, :16], dim=-1))
    with pytest.raises(ValueError, match="dimensions=65"):
        Pooler(PoolerConfig(pooling_type=PoolingType.MEAN, dimensions=65))(hidden, meta.query_start_loc)


def test_packed_batch_equals_one_sequence_at_a_time(tmp_path):
    _save(tmp_path, transformers.BertModel)
    model = load_pooling_model(str(tmp_path))
    ids, types = _batch()
    packed, _ = _ours(model, ids, types)
    alone = torch.cat([_ours(model, [i], [t])[0] for i, t in zip(ids, types)])
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_labels", [1, 3])
def test_sequence_classification_logits_match_transformers(tmp_path, num_labels):
    hf = _save(tmp_path, transformers.BertForSequenceClassification, num_labels=num_labels)
    arch = ArchConfig.from_hf_dict(read_hf_config(str(tmp_path)))
    assert arch.architecture == "BertForSequenceClassification" and arch.family.num_labels == num_labels
    model = load_pooling_model(str(tmp_path))
    assert isinstance(model, BertForSequenceClassification)
    ids, types = _batch(seed=5)
    hidden, meta = _ours(model, ids, types)
    with torch.no_grad():
        ref = torch.cat([hf(input_ids=i[None], token_type_ids=t[None]).logits for i, t in zip(ids, types)])
    raw = pooler_for(model, str(tmp_path), task="encode")
    assert isinstance(raw, ClassifierPooler) and not raw.config.softmax
    torch.testing.assert_close(raw(hidden, meta.query_start_loc), ref, atol=2e-5, rtol=1e-4)
    scored = pooler_for(model, str(tmp_path), task="classify")(hidden, meta.query_start_loc)
    expected = ref.sigmoid() if num_labels == 1 else ref.softmax(-1)
    torch.testing.assert_close(scored, expected, atol=1e-5, rtol=1e-4)


def test_checkpoint_names_with_bert_prefix_and_completeness_check(tmp_path):
    hf = _save(tmp_path, transformers.BertModel)
    arch = ArchConfig.from_hf_dict(read_hf_config(str(tmp_path)))
    state = {f"bert.{k}": v for k, v in hf.state_dict().items()}
    state["cls.predictions.bias"] = torch.zeros(3)  # a pre-training head: skipped
    model = BertModel(arch)
    model.load_weights(state.items())
    ids, types = _batch()
    hidden, _ = _ours(model.eval(), ids, types)
    torch.testing.assert_close(hidden, torch.cat(_hf_hidden(hf, ids, types)), atol=2e-5, rtol=1e-4)
    missing = {k: v for k, v in state.items() if "layer.1.attention.self.value" not in k}
    with pytest.raises(ValueError, match=r"missing 2 weight\(s\).*qkv_proj"):
        BertModel(arch).load_weights(missing.items())
    with pytest.raises(ValueError, match="does not match any parameter"):
        BertModel(arch).load_weights([*state.items(), ("encoder.layer.0.extra.weight", torch.zeros(1))])


def test_unsupported_bert_config_is_refused():
    from aserve.config import ConfigError

    with pytest.raises(ConfigError, match="position_embedding_type"):
        ArchConfig.from_hf_dict({**TINY, "architectures": ["BertModel"], "position_embedding_type": "relative_key"})


def test_encoder_metadata_contract():
    meta = EncoderMetadata.from_seq_lens([3, 1, 2])
    assert meta.num_seqs == 3 and meta.num_tokens == 6 and meta.max_seq_len == 3
    assert meta.query_start_loc.tolist() == [0, 3, 4, 6]
    assert meta.positions().tolist() == [0, 1, 2, 0, 0, 1]
    assert EncoderMetadata.from_seq_lens([4, 4]).key_mask is None
    with pytest.raises(ValueError):
        EncoderMetadata.from_seq_lens([2, 0])
