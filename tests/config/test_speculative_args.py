"""Speculative decoding's configuration (issue 22): --speculative-config (JSON / dict), the seeds' older
flags mapped onto it, validation before any model file is read, and resolution into SpeculativeConfig."""

from __future__ import annotations

import json
import logging

import pytest

from aserve.config import ConfigError, EngineArgs
from aserve.config.speculative import SpeculativeConfig, draft_model_name
from aserve.server.args import parse_args
from tests.config.conftest import LLAMA

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def _resolve(model_dir: str, **kwargs):
    return EngineArgs(model=model_dir, **kwargs).create_config(model_path=model_dir)


def _draft_dir(tmp_path, name="draft", **overrides) -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA, "num_hidden_layers": 1, **overrides}))
    return str(folder)


def test_speculation_is_off_by_default(model_dir):
    cfg = _resolve(model_dir)
    assert cfg.speculative is None and cfg.scheduler.num_lookahead_slots == 0
    assert EngineArgs().speculative_config is None


def test_json_and_dict_forms_resolve_to_the_same_ngram_config(model_dir):
    expected = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
    engine, _ = parse_args(["--model", model_dir, "--speculative-config", json.dumps(NGRAM)])
    assert engine.speculative_config == NGRAM  # the CLI parses the JSON object
    assert engine.create_config(model_path=model_dir).speculative == expected
    assert _resolve(model_dir, speculative_config=NGRAM).speculative == expected
    assert _resolve(model_dir, speculative_config=json.dumps(NGRAM)).speculative == expected  # LLM(..., str)
    offline = EngineArgs.from_kwargs(model=model_dir, speculative_config=dict(NGRAM))  # LLM(...)'s path
    assert offline.create_config(model_path=model_dir).speculative == expected
    assert expected.num_lookahead_slots == 0


@pytest.mark.parametrize("spec, lo_hi", [
    ({"method": "ngram", "num_speculative_tokens": 3}, (5, 5)),  # vLLM: neither given -> 5 and 5
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}, (4, 4)),  # one -> both
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}, (2, 2)),
    ({"model": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": 6}, (6, 6)),  # inferred
    ({"model": "ngram", "num_speculative_tokens": 3}, (5, 5)),
    ({"num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}, (1, 3)),  # no model: ngram
])
def test_ngram_inference_and_lookup_defaults_follow_vllm(model_dir, spec, lo_hi):
    s = _resolve(model_dir, speculative_config=spec).speculative
    assert s.method == "ngram" and (s.prompt_lookup_min, s.prompt_lookup_max) == lo_hi
    assert s.draft_model_path is None and s.draft_arch is None


def test_every_key_resolves(model_dir):
    spec = {**NGRAM, "max_model_len": 100, "disable_by_batch_size": 8,
            "acceptance_method": "typical_acceptance_sampler", "posterior_threshold": 0.2, "posterior_alpha": 0.5,
            "disable_logprobs": True, "draft_tensor_parallel_size": 1, "quantization": None}
    s = _resolve(model_dir, speculative_config=spec).speculative
    assert (s.max_model_len, s.disable_by_batch_size, s.acceptance_method) == (100, 8, "typical_acceptance_sampler")
    assert (s.posterior_threshold, s.posterior_alpha, s.disable_logprobs) == (0.2, 0.5, True)
    # a cap at or past the target's context never binds: None
    assert _resolve(model_dir, speculative_config={**NGRAM, "max_model_len": 512}).speculative.max_model_len is None


def test_disable_mqa_scorer_is_accepted_with_a_warning(model_dir, caplog):
    with caplog.at_level(logging.WARNING, logger="aserve.config"):
        s = _resolve(model_dir, speculative_config={**NGRAM, "disable_mqa_scorer": True}).speculative
    assert s.method == "ngram"
    assert [r.getMessage() for r in caplog.records if "disable_mqa_scorer" in r.getMessage()] != []


def test_old_flags_map_onto_speculative_config(model_dir, caplog):
    argv = ["--model", model_dir, "--speculative-model", "[ngram]", "--num-speculative-tokens", "4",
            "--ngram-prompt-lookup-max", "4", "--ngram-prompt-lookup-min", "2", "--speculative-max-model-len", "200",
            "--speculative-disable-by-batch-size", "4", "--speculative-draft-tensor-parallel-size", "1",
            "--spec-decoding-acceptance-method", "typical_acceptance_sampler",
            "--typical-acceptance-sampler-posterior-threshold", "0.1",
            "--typical-acceptance-sampler-posterior-alpha", "0.2", "--disable-logprobs-during-spec-decoding",
            "--speculative-disable-mqa-scorer"]
    with caplog.at_level(logging.WARNING, logger="aserve.config"):
        engine, _ = parse_args(argv)
    assert engine.speculative_config == {
        "model": "[ngram]", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
        "max_model_len": 200, "disable_by_batch_size": 4, "draft_tensor_parallel_size": 1,
        "acceptance_method": "typical_acceptance_sampler", "posterior_threshold": 0.1, "posterior_alpha": 0.2,
        "disable_logprobs": True, "disable_mqa_scorer": True}
    assert any("--speculative-model is deprecated" in r.getMessage() for r in caplog.records)
    s = engine.create_config(model_path=model_dir).speculative
    assert s == SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2,
                                  max_model_len=200, disable_by_batch_size=4,
                                  acceptance_method="typical_acceptance_sampler", posterior_threshold=0.1,
                                  posterior_alpha=0.2, disable_logprobs=True)
    # vLLM v0's form, through LLM(...)'s path: --speculative-model [ngram] -k 4 --ngram-prompt-lookup-max 4
    args = EngineArgs.from_kwargs(model=model_dir, speculative_model="[ngram]", num_speculative_tokens=4,
                                  ngram_prompt_lookup_max=4)
    s = args.create_config(model_path=model_dir).speculative
    assert (s.method, s.num_speculative_tokens, s.prompt_lookup_min, s.prompt_lookup_max) == ("ngram", 4, 4, 4)
    # the old flags add to --speculative-config's keys
    engine, _ = parse_args(["--speculative-config", '{"method": "ngram"}', "--num-speculative-tokens", "3"])
    assert engine.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    # refused values of old flags are refused through the key they set
    with pytest.raises(ConfigError, match="quantization"):
        EngineArgs.from_kwargs(speculative_model="x", num_speculative_tokens=2,
                               speculative_model_quantization="awq").validate()


def test_an_old_flag_contradicting_the_config_names_both():
    with pytest.raises(ConfigError, match="--speculative-config") as err:
        EngineArgs.from_kwargs(speculative_config=NGRAM, num_speculative_tokens=5)
    assert "--num-speculative-tokens" in str(err.value)
    with pytest.raises(SystemExit):
        parse_args(["--speculative-config", json.dumps(NGRAM), "--ngram-prompt-lookup-max", "7"])
    # the same value both ways is fine
    assert EngineArgs.from_kwargs(speculative_config=NGRAM, num_speculative_tokens=4).speculative_config == NGRAM


@pytest.mark.parametrize("spec, words", [
    ({"method": "eagle", "model": "x", "num_speculative_tokens": 2}, "EAGLE needs trained draft heads"),
    ({"method": "eagle3", "model": "x", "num_speculative_tokens": 2}, "EAGLE-3 needs trained draft heads"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "Medusa needs trained draft heads"),
    ({"method": "mlp_speculator", "num_speculative_tokens": 2}, "MLP speculators"),
    ({"method": "deepseek_mtp", "num_speculative_tokens": 1}, "use ngram or draft_model"),
    ({"method": "mtp", "num_speculative_tokens": 1}, "multi-token prediction"),
    ({"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B", "num_speculative_tokens": 2}, "EAGLE"),
    ({"method": "lookahead", "num_speculative_tokens": 2}, "unknown method 'lookahead'"),
    ({**NGRAM, "prompt_lookup_window": 3}, "unknown key(s) ['prompt_lookup_window']"),
    ({"num_speculative_tokens": 2}, "give 'method'"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer in [1, 16]"),
    ({**NGRAM, "num_speculative_tokens": 17}, "[1, 16]"),
    ({**NGRAM, "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({**NGRAM, "prompt_lookup_min": 0}, "prompt_lookup_min must be an integer >= 1"),
    ({**NGRAM, "prompt_lookup_min": 5}, "prompt_lookup_min (5) must be <= prompt_lookup_max (4)"),
    ({**NGRAM, "acceptance_method": "greedy"}, "acceptance_method must be one of"),
    ({**NGRAM, "posterior_threshold": 0}, "posterior_threshold must be a number in (0, 1]"),
    ({**NGRAM, "posterior_threshold": 1.5}, "posterior_threshold"),
    ({**NGRAM, "posterior_alpha": -0.1}, "posterior_alpha must be a number >= 0"),
    ({**NGRAM, "disable_by_batch_size": 0}, "disable_by_batch_size must be an integer >= 1"),
    ({**NGRAM, "max_model_len": 0}, "max_model_len must be an integer >= 1"),
    ({**NGRAM, "disable_logprobs": "yes"}, "disable_logprobs must be true or false"),
    ({**NGRAM, "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size: only 1"),
    ({**NGRAM, "quantization": "awq"}, "quantized draft models are not implemented"),
    ({**NGRAM, "model": "some/draft"}, "method 'ngram' takes no draft model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"model": "some/draft", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "apply to method 'ngram' only"),
    ("[1, 2]", "expected a JSON object"),
    ("{method: ngram}", "not valid JSON"),
])
def test_bad_speculative_configs_are_refused_before_any_model_file(spec, words):
    with pytest.raises(ConfigError, match="--speculative-config") as err:
        EngineArgs(model="/no/such/model", speculative_config=spec).validate()
    assert words in str(err.value)


@pytest.mark.parametrize("kwargs, words", [
    ({"task": "embed"}, "pooling model"),
    ({"runner": "pooling"}, "pooling model"),
    ({"model_impl": "transformers"}, "--model-impl transformers"),
    ({"tensor_parallel_size": 2, "speculative_config": {"model": "d", "num_speculative_tokens": 2}},
     "draft model with --tensor-parallel-size 2"),
])
def test_combinations_speculation_cannot_serve_are_refused(kwargs, words):
    kwargs = {"speculative_config": NGRAM, **kwargs}
    with pytest.raises(ConfigError, match="--speculative-config") as err:
        EngineArgs(**kwargs).validate()
    assert words in str(err.value)
    # ngram with tensor parallelism is fine (the lookup runs on the host)
    EngineArgs(speculative_config=NGRAM, tensor_parallel_size=2).validate()


def test_a_model_resolved_to_pooling_is_refused(write_model_dir):
    path = write_model_dir(architectures=["BertModel"], type_vocab_size=2, layer_norm_eps=1e-12,
                           hidden_act="gelu")
    with pytest.raises(ConfigError, match="--speculative-config: .*pooling task"):
        _resolve(path, speculative_config=NGRAM)


def test_draft_model_resolves_its_arch_and_caps_the_length(model_dir, tmp_path):
    draft = _draft_dir(tmp_path, max_position_embeddings=256)
    spec = {"model": draft, "num_speculative_tokens": 3}
    args = EngineArgs(model=model_dir, speculative_config=spec, num_lookahead_slots=1)
    assert draft_model_name(args) == draft
    cfg = args.create_config(model_path=model_dir)
    s = cfg.speculative
    assert (s.method, s.draft_model_path, s.num_lookahead_slots) == ("draft_model", draft, 3)
    assert s.draft_arch.num_hidden_layers == 1 and s.draft_arch.vocab_size == 100
    assert (s.prompt_lookup_min, s.prompt_lookup_max) == (0, 0)
    assert s.max_model_len == 256  # the draft's context caps it (the target's is 512)
    assert cfg.scheduler.num_lookahead_slots == 3
    capped = {**spec, "method": "draft_model", "max_model_len": 300}
    assert _resolve(model_dir, speculative_config=capped).speculative.max_model_len == 256
    capped["max_model_len"] = 100
    assert _resolve(model_dir, speculative_config=capped).speculative.max_model_len == 100
    # the model source's resolved folder wins over the `model` string (a Hub id here)
    args = EngineArgs(model=model_dir, speculative_config={"model": "org/tiny-draft", "num_speculative_tokens": 2})
    assert draft_model_name(args) == "org/tiny-draft"
    assert args.create_config(model_path=model_dir, draft_model_path=draft).speculative.draft_model_path == draft
    assert draft_model_name(EngineArgs(speculative_config=NGRAM)) is None
    assert draft_model_name(EngineArgs()) is None


def test_draft_with_another_vocabulary_is_refused_naming_both_sizes(model_dir, tmp_path):
    draft = _draft_dir(tmp_path, vocab_size=120)
    with pytest.raises(ConfigError, match="--speculative-config") as err:
        _resolve(model_dir, speculative_config={"model": draft, "num_speculative_tokens": 2})
    assert "vocab_size 120" in str(err.value) and "target 100" in str(err.value) and draft in str(err.value)


@pytest.mark.parametrize("overrides, words", [
    ({"architectures": ["FalconForCausalLM"]}, "not a causal LM family aserve implements natively"),
    ({"architectures": ["BertModel"]}, "'BertModel'"),
])
def test_draft_must_be_a_native_causal_family(model_dir, tmp_path, overrides, words):
    draft = _draft_dir(tmp_path, **overrides)
    with pytest.raises(ConfigError, match="--speculative-config") as err:
        _resolve(model_dir, speculative_config={"model": draft, "num_speculative_tokens": 2})
    assert words in str(err.value)


def test_draft_folder_without_config_is_refused(model_dir, tmp_path):
    with pytest.raises(ConfigError, match="--speculative-config: draft model .*no config.json"):
        _resolve(model_dir, speculative_config={"model": str(tmp_path / "nowhere"), "num_speculative_tokens": 2})


def test_speculative_max_model_len_past_the_targets_is_refused(model_dir):
    with pytest.raises(ConfigError, match="max_model_len \\(600\\) must be <= the target's max_model_len \\(512\\)"):
        _resolve(model_dir, speculative_config={**NGRAM, "max_model_len": 600})


def test_transformers_backend_target_is_refused(write_model_dir):
    path = write_model_dir(architectures=["FalconForCausalLM"], model_type="falcon")
    with pytest.raises(ConfigError, match="--speculative-config: .*Transformers backend"):
        _resolve(path, speculative_config=NGRAM)


def test_num_lookahead_slots_is_the_max_of_the_flag_and_the_draft(model_dir, tmp_path):
    engine, _ = parse_args(["--num-lookahead-slots", "2"])
    assert engine.num_lookahead_slots == 2
    assert _resolve(model_dir, num_lookahead_slots=2).scheduler.num_lookahead_slots == 2
    assert _resolve(model_dir, num_lookahead_slots=2, speculative_config=NGRAM).scheduler.num_lookahead_slots == 2
    draft = _draft_dir(tmp_path)
    spec = {"model": draft, "num_speculative_tokens": 5}
    assert _resolve(model_dir, num_lookahead_slots=2, speculative_config=spec).scheduler.num_lookahead_slots == 5
    assert _resolve(model_dir, num_lookahead_slots=7, speculative_config=spec).scheduler.num_lookahead_slots == 7
    with pytest.raises(ConfigError, match="--num-lookahead-slots: must be >= 0"):
        EngineArgs(num_lookahead_slots=-1).validate()
