"""`aserve quantize`'s arguments: seed 004's spellings, and every bad argument refused before any work
(exit code 2, a message naming the argument)."""

from __future__ import annotations

import json
import sys

import pytest

from aserve.quantize.cli import parse_args
from aserve.server.cli import main as aserve_main
from tests.support.tiny_models import GREEDY_STABLE, save_tiny_hf


def run(argv, capsys) -> tuple[int, str]:
    code = aserve_main(["quantize", *argv])
    return code, capsys.readouterr().err


def test_seed_spellings_parse():
    args = parse_args(["-i", "m", "-o", "out", "-quant_type", "smooth_quant", "-sq", "0.75", "-token", "ids.txt",
                       "-tp", "2", "-t", "fp16", "--multi-query-mode"])
    assert (args.quant_type, args.smoothing_strength, args.calib_token_ids, args.tensor_parallel_size, args.dtype,
            args.multi_query_mode) == ("smooth_quant", 0.75, "ids.txt", 2, "fp16", True)
    assert parse_args(["-i", "m", "-o", "o", "--quant-type", "gptq", "--tokenids_path", "f"]).calib_token_ids == "f"
    args = parse_args(["-i", "m", "-o", "o", "--quant-type", "awq"])
    assert (args.group_size, args.group_size_given, args.num_calib_samples) == (128, False, 64)


def test_unknown_quant_type_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        aserve_main(["quantize", "-i", "m", "-o", "o", "--quant-type", "int3"])
    assert info.value.code == 2
    assert "--quant-type" in capsys.readouterr().err


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2")
    save_tiny_hf(path, "gpt2", seed=0, **GREEDY_STABLE)
    return str(path)


@pytest.fixture(scope="module")
def unknown_arch(tmp_path_factory):
    path = tmp_path_factory.mktemp("unknown")
    (path / "config.json").write_text(json.dumps({"architectures": ["FooForCausalLM"], "model_type": "foo"}))
    return str(path)


def test_missing_input(tmp_path, capsys):
    code, err = run(["-i", str(tmp_path / "nope"), "-o", str(tmp_path / "out"), "--quant-type", "gptq"], capsys)
    assert code == 2 and "-i:" in err and "no such file or folder" in err


def test_unsupported_architectures(gpt2_folder, unknown_arch, tmp_path, capsys):
    code, err = run(["-i", gpt2_folder, "-o", str(tmp_path / "a"), "--quant-type", "gptq"], capsys)
    assert code == 2 and "-i: GPT2LMHeadModel cannot be quantized here" in err and "Conv1D" in err
    code, err = run(["-i", unknown_arch, "-o", str(tmp_path / "b"), "--quant-type", "fp8"], capsys)
    assert code == 2 and "architecture 'FooForCausalLM' is not supported" in err


def test_output_must_be_new_or_empty(trained_llama, tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    code, err = run(["-i", trained_llama, "-o", str(tmp_path / "full"), "--quant-type", "fp8"], capsys)
    assert code == 2 and "-o:" in err and "not an empty folder" in err
    code, err = run(["-i", trained_llama, "-o", str(tmp_path / "no" / "such" / "out"), "--quant-type", "fp8"], capsys)
    assert code == 2 and "-o: the parent folder" in err


@pytest.mark.parametrize("extra, needle", [
    (["--quant-type", "gptq", "--group-size", "96"],
     "--group-size 96: model.layers.0.self_attn.q_proj's 128 inputs are not a multiple of it"),
    (["--quant-type", "awq", "-tp", "2", "--group-size", "128"],
     "--group-size 128: model.layers.0.self_attn.o_proj's 128 inputs (64 per GPU at -tp 2)"),
    (["--quant-type", "gptq", "-tp", "3"], "-tp 3: the model's 4 attention heads do not split over 3 GPUs"),
    (["--quant-type", "fp8", "--group-size", "64"], "--group-size: applies to ['awq', 'gptq']"),
    (["--quant-type", "gptq", "--group-size", "0"], "--group-size: 0 must be positive"),
    (["--quant-type", "gptq", "-sq", "0.5"], "-sq: the smoothing strength applies to --quant-type smooth_quant only"),
    (["--quant-type", "smooth_quant", "-sq", "1.5"], "-sq: 1.5 is outside 0..1"),
    (["--quant-type", "gptq", "-t", "int8"], "-t: 'int8' is not one of fp16, bf16"),
    (["--quant-type", "gptq", "--num-calib-samples", "0"], "--num-calib-samples: must be at least 1"),
    (["--quant-type", "fp8", "--calib-dataset", "x.jsonl"], "--calib-dataset: --quant-type fp8 needs no calibration"),
    (["--quant-type", "gptq", "--calib-dataset", "x.jsonl", "-token", "y"], "give one calibration source, not both"),
])
def test_bad_arguments_named_before_work(trained_llama, tmp_path, capsys, extra, needle):
    code, err = run(["-i", trained_llama, "-o", str(tmp_path / "out"), *extra], capsys)
    assert code == 2, err
    assert needle in err
    assert not (tmp_path / "out").exists()


def test_group_size_that_fits_every_shard_is_accepted_with_tp(trained_llama, tmp_path, capsys, monkeypatch):
    from aserve.quantize import plan

    plan_of = plan.make_plan(parse_args(["-i", trained_llama, "-o", str(tmp_path / "o"), "--quant-type", "gptq",
                                         "--group-size", "64", "-tp", "2"]))
    assert (plan_of.group_size, plan_of.tensor_parallel_size, plan_of.calibration_source) == (64, 2, "built-in set")
    assert plan_of.dtype == "bfloat16"  # -t auto on an fp32 checkpoint
    # without --group-size: 128 where it fits every input and shard, else 64 (o_proj: 64 inputs per GPU at -tp 2)
    for tp, want in ((1, 128), (2, 64)):
        chosen = plan.make_plan(parse_args(["-i", trained_llama, "-o", str(tmp_path / "o"), "--quant-type", "awq",
                                            "-tp", str(tp)]))
        assert chosen.group_size == want
    assert plan.make_plan(parse_args(["-i", trained_llama, "-o", str(tmp_path / "o"), "--quant-type", "fp8"])
                          ).group_size == -1


def test_multi_query_mode_checks_the_model(gpt2_folder, trained_llama, tmp_path, capsys):
    from aserve.quantize import plan

    ok = plan.make_plan(parse_args(["-i", trained_llama, "-o", str(tmp_path / "o"), "--quant-type", "fp8",
                                    "--multi-query-mode"]))
    assert ok.quant_type == "fp8"  # 2 KV heads for 4 query heads: grouped-query
    mha = tmp_path / "mha"
    save_tiny_hf(mha, "llama", seed=0, **{**GREEDY_STABLE, "num_key_value_heads": 4, "num_attention_heads": 4})
    code, err = run(["-i", str(mha), "-o", str(tmp_path / "out"), "--quant-type", "fp8", "--multi-query-mode"], capsys)
    assert code == 2 and "--multi-query-mode: the model has 4 key/value heads for 4 query heads" in err


def test_calibration_ids_outside_the_vocabulary(trained_llama, tmp_path, capsys):
    ids = tmp_path / "ids.txt"
    ids.write_text("5 6 7\n8 512 9\n")
    code, err = run(["-i", trained_llama, "-o", str(tmp_path / "out"), "--quant-type", "gptq", "-token", str(ids)],
                    capsys)
    assert code == 2
    assert "--calib-token-ids" in err and "line 2 has token id 512 outside the model's vocabulary (0..511)" in err


def test_missing_library_is_named(trained_llama, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "llmcompressor", None)  # import fails as if not installed
    code, err = run(["-i", trained_llama, "-o", str(tmp_path / "out"), "--quant-type", "gptq"], capsys)
    assert code == 2 and "pip install 'aserve[quantize]'" in err
