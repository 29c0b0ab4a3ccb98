"""`--load-format npcache`: the first load writes the numpy cache, later loads read only it, and the
model generates exactly what the ordinary load does (fp32 safetensors and a bf16 PyTorch checkpoint)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.model import npcache
from aserve.model.loader import weight_files

PROMPTS = [{"prompt_token_ids": [5, 17, 99, 42, 7, 300, 12]}, {"prompt_token_ids": [3, 4, 5, 6]}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
COMMON = {"skip_tokenizer_init": True, "max_model_len": 128, "cpu_kvcache_space": 0.02}


def _tokens(path: str, **kwargs) -> list[list[int]]:
    llm = LLM(path, **COMMON, **kwargs)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("checkpoint", ["safetensors", "bf16_pt"])
def test_npcache_written_once_then_read(checkpoint, tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    dtype = "float32"
    if checkpoint == "bf16_pt":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.bfloat16)
        for f in folder.glob("*.safetensors"):
            f.unlink()
        model.save_pretrained(folder, safe_serialization=False)
        dtype = "bfloat16"
    expected = _tokens(str(folder), dtype=dtype)

    calls = []
    real = npcache._write_cache
    monkeypatch.setattr(npcache, "_write_cache", lambda *a: calls.append(1) or real(*a))
    first = _tokens(str(folder), dtype=dtype, load_format="npcache")
    _, files = weight_files(str(folder), "auto")
    cache = npcache.npcache_folder(str(folder), files)
    assert os.path.isfile(os.path.join(cache, "index.json")) and calls == [1]
    second = _tokens(str(folder), dtype=dtype, load_format="npcache")
    assert calls == [1]  # read from the cache, not written again
    assert first == second == expected


def test_a_changed_checkpoint_gets_a_fresh_cache(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("ASERVE_CACHE_DIR", str(tmp_path / "cache"))
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    _, files = weight_files(str(folder), "auto")
    before = npcache.npcache_folder(str(folder), files)
    os.utime(files[0], ns=(1, 1))
    assert npcache.npcache_folder(str(folder), files) != before
