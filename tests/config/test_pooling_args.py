"""--task / --runner / --override-pooler-config: which task a model folder serves, how it pools, and the
scheduling a pooling model needs (whole prompts for encoders and non-LAST pooling)."""

from __future__ import annotations

import json

import pytest

from aserve.config import ConfigError, EngineArgs
from aserve.config.pooler import PoolingType
from aserve.server.args import parse_args

BERT = {"architectures": ["BertModel"], "vocab_size": 300, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 512, "type_vocab_size": 2,
        "torch_dtype": "float32"}


def _st_files(path, mode="pooling_mode_mean_tokens", max_seq_length=128):
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({mode: True}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))


def test_task_auto_serves_encoders_as_embedders_and_causal_lms_as_generators(write_model_dir):
    bert = write_model_dir(**BERT)
    cfg = EngineArgs(model=bert).create_config()
    assert cfg.is_pooling and cfg.pooling.task == "embed" and cfg.pooling.pooler.pooling_type == PoolingType.CLS
    # an encoder needs each prompt whole: no chunked prefill, no prefix-cache hits
    assert not cfg.scheduler.enable_chunked_prefill and not cfg.cache.enable_prefix_caching
    assert cfg.scheduler.max_num_batched_tokens >= cfg.model.max_model_len

    llama = write_model_dir(architectures=["LlamaForCausalLM"])
    assert not EngineArgs(model=llama).create_config().is_pooling
    emb = EngineArgs(model=llama, runner="pooling").create_config()  # a decoder embedder: LAST, chunked OK
    assert emb.pooling.task == "embed" and emb.pooling.pooler.pooling_type == PoolingType.LAST
    assert emb.pooling.pooler.normalize and emb.scheduler.enable_chunked_prefill and emb.cache.enable_prefix_caching
    assert EngineArgs(model=llama, task="embedding").create_config().pooling.task == "embed"  # vLLM's old name

    bare = write_model_dir(architectures=["Qwen2Model"])  # gte-Qwen2 style: a bare decoder pools
    cfg = EngineArgs(model=bare).create_config()
    assert cfg.pooling.task == "embed" and cfg.model.arch.architecture == "Qwen2ForCausalLM"
    with pytest.raises(ConfigError, match="--task"):
        EngineArgs(model=bare, task="generate").create_config()

    cls = write_model_dir(**{**BERT, "architectures": ["BertForSequenceClassification"], "num_labels": 1})
    cfg = EngineArgs(model=cls).create_config()
    assert cfg.pooling.task == "classify" and cfg.pooling.is_classifier and cfg.pooling.pooler.softmax
    assert EngineArgs(model=cls, task="score").create_config().pooling.is_classifier
    assert not EngineArgs(model=cls, task="embed").create_config().pooling.is_classifier


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"task": "generate"}, "--task"),  # an encoder cannot generate
    ({"task": "classify"}, "--task"),  # no classifier head
    ({"enable_chunked_prefill": True}, "--enable-chunked-prefill"),
    ({"tensor_parallel_size": 2}, "--tensor-parallel-size"),
    ({"enable_lora": True}, "--enable-lora"),
    ({"model_impl": "transformers"}, "--model-impl"),
    ({"kv_cache_dtype": "fp8", "calculate_kv_scales": True}, "--calculate-kv-scales"),
])
def test_what_a_pooling_model_cannot_do_is_refused_naming_the_flag(write_model_dir, kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        EngineArgs(model=write_model_dir(**BERT), **kwargs).create_config()


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"task": "reward"}, "--task"), ({"task": "nope"}, "--task"), ({"runner": "draft"}, "--runner"),
    ({"runner": "generate", "task": "embed"}, "--runner"), ({"runner": "pooling", "task": "generate"}, "--runner"),
    ({"override_pooler_config": {"pooling_type": "MAX"}}, "--override-pooler-config"),
    ({"override_pooler_config": {"bogus": 1}}, "--override-pooler-config"),
])
def test_bad_pooling_flags_are_refused_before_any_model_work(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        EngineArgs(model="/nonexistent", **kwargs).validate()


def test_override_pooler_config_overrides_the_folder_files(write_model_dir, tmp_path):
    folder = write_model_dir(**BERT)
    _st_files(tmp_path)
    cfg = EngineArgs(model=folder).create_config()
    assert cfg.pooling.pooler.pooling_type == PoolingType.MEAN and cfg.pooling.pooler.normalize
    assert cfg.model.max_model_len == 128  # sentence_bert_config.json's max_seq_length caps the context
    over = EngineArgs(model=folder, override_pooler_config={"pooling_type": "cls", "normalize": False}).create_config()
    assert over.pooling.pooler.pooling_type == PoolingType.CLS and not over.pooling.pooler.normalize
    # vLLM's newer spelling and the CLI's JSON
    args = EngineArgs.from_kwargs(model=folder, pooler_config={"pooling_type": "LAST"})
    assert args.create_config().pooling.pooler.pooling_type == PoolingType.LAST
    engine_args, _ = parse_args(["--model", folder, "--task", "embed", "--override-pooler-config",
                                 '{"pooling_type": "CLS", "dimensions": 32}'])
    cfg = engine_args.create_config()
    assert cfg.pooling.pooler.pooling_type == PoolingType.CLS and cfg.pooling.pooler.dimensions == 32


def test_matryoshka_dimensions_come_from_config_json(write_model_dir):
    cfg = EngineArgs(model=write_model_dir(**BERT, matryoshka_dimensions=[32, 64])).create_config()
    assert cfg.pooling.is_matryoshka and cfg.pooling.matryoshka_dimensions == (32, 64)
    assert not EngineArgs(model=write_model_dir(**BERT)).create_config().pooling.is_matryoshka
