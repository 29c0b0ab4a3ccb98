"""LoRA adapters through the OpenAI server: `--lora-modules` in both spellings, the adapter's name as
`model` (greedy tokens identical to Hugging Face + PEFT), `/v1/models` listing adapters with their
parent, runtime load / unload behind VLLM_ALLOW_RUNTIME_LORA_UPDATING (API key needed when set), the
LoRA metrics, and every bad adapter a 4xx in OpenAI's format with the server unharmed."""

from __future__ import annotations

import copy
import json

import httpx
import openai
import pytest
import torch

from aserve.server.args import parse_args
from aserve.server.lora import LoRAModulesError
from aserve.server.lora_modules import LoRAModule
from tests.model.lora._lora_models import save_adapter
from tests.server.real_tiny_server import serving
from tests.server.server_harness import quiet_args
from tests.support.tiny_models import GREEDY_STABLE, save_tiny_hf

pytestmark = pytest.mark.timeout(300)

PROMPT = [5, 6, 7, 8, 9, 10, 11]
MAX_NEW = 8
ENGINE = dict(skip_tokenizer_init=True, enable_lora=True, max_loras=2, max_lora_rank=16)


def test_lora_modules_flag_forms(tmp_path):
    _, server = parse_args(["--enable-lora", "--lora-modules", "sql=/a/b",
                            '{"name": "chat", "path": "/c", "base_model_name": "base"}'])
    assert server.lora_modules == (LoRAModule("sql", "/a/b"), LoRAModule("chat", "/c", "base"))
    for argv, words in ((["--lora-modules", "a=/x"], "needs --enable-lora"),
                        (["--enable-lora", "--lora-modules", "nopath"], "name=path"),
                        (["--enable-lora", "--lora-modules", '{"name": "a"}'], "'path'"),
                        (["--enable-lora", "--lora-modules", "{bad"], "not valid JSON"),
                        (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "given twice")):
        with pytest.raises(SystemExit):
            parse_args(argv)


@pytest.fixture(scope="module")
def lora_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    hf = save_tiny_hf(root / "base", "llama", seed=1234, perturb=True, **GREEDY_STABLE)
    save_adapter(hf, root / "sql", seed=21, r=8, lora_alpha=16)
    save_adapter(hf, root / "chat", seed=22, r=16, lora_alpha=16)
    save_adapter(hf, root / "too_big", seed=23, r=32, lora_alpha=32)
    return root, hf


def _peft_greedy(hf, path) -> list[int]:
    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(hf), str(path)).eval()
    ids = torch.tensor([PROMPT])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def _tokens(client: openai.OpenAI, model: str) -> list[int]:
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})
    return [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]


def test_lora_modules_served_by_name(lora_model):
    root, hf = lora_model
    args = quiet_args(lora_modules=(LoRAModule("sql", str(root / "sql")),
                                    LoRAModule("chat", str(root / "chat"), base_model_name="my-base")))
    with serving(str(root / "base"), args, served_model_name="base", **ENGINE) as (_, address):
        client = openai.OpenAI(base_url=f"{address.url}/v1", api_key="x")
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {"base", "sql", "chat"}
        assert cards["sql"].parent == "base" and cards["chat"].parent == "my-base"
        assert cards["sql"].root == str(root / "sql")
        assert _tokens(client, "sql") == _peft_greedy(hf, root / "sql")
        assert _tokens(client, "chat") == _peft_greedy(hf, root / "chat")
        base = _tokens(client, "base")
        assert base != _tokens(client, "sql")
        with pytest.raises(openai.NotFoundError) as err:
            _tokens(client, "nope")
        assert err.value.body["param"] == "model" and err.value.body["code"] == "model_not_found"
        metrics = httpx.get(f"{address.url}/metrics").text
        assert 'vllm:lora_count_total{lora_name="sql",model_name="base"} 2.0' in metrics
        assert 'vllm:lora_time_e2e_requests_total{lora_name="chat",model_name="base"}' in metrics
        assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}' in metrics


def test_runtime_load_and_unload(lora_model, monkeypatch):
    root, hf = lora_model
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    with serving(str(root / "base"), quiet_args(api_key="k"), served_model_name="base", **ENGINE) as (_, address):
        url, auth = address.url, {"Authorization": "Bearer k"}
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k")
        body = {"lora_name": "sql", "lora_path": str(root / "sql")}
        assert httpx.post(f"{url}/v1/load_lora_adapter", json=body).status_code == 401  # the key is needed
        r = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=auth)
        assert r.status_code == 200 and "added successfully" in r.text
        assert _tokens(client, "sql") == _peft_greedy(hf, root / "sql")
        again = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=auth)
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        for bad, words in (({"lora_name": "x", "lora_path": str(root / "missing")}, "no such folder"),
                           ({"lora_name": "x", "lora_path": str(root / "too_big")}, "rank 32"),
                           ({"lora_name": "x", "lora_path": str(root / "base")}, "adapter_config.json"),
                           ({"lora_name": "x"}, "lora_path")):
            r = httpx.post(f"{url}/v1/load_lora_adapter", json=bad, headers=auth)
            assert r.status_code == 400, r.text
            assert words in json.dumps(r.json()["error"]), r.text
        assert "x" not in {m.id for m in client.models.list().data}
        r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=auth)
        assert r.status_code == 200 and "removed successfully" in r.text
        with pytest.raises(openai.NotFoundError):
            _tokens(client, "sql")
        r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "sql"}, headers=auth)
        assert r.status_code == 404 and r.json()["error"]["code"] == "lora_adapter_not_found"
        assert len(_tokens(client, "base")) == MAX_NEW  # the server is unharmed


def test_runtime_updates_need_the_environment_switch(lora_model, monkeypatch):
    root, _ = lora_model
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.delenv("ASERVE_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    with serving(str(root / "base"), quiet_args(), served_model_name="base", **ENGINE) as (_, address):
        r = httpx.post(f"{address.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(root / "sql")})
        assert r.status_code == 404


def test_bad_lora_module_stops_the_start_up(lora_model):
    root, _ = lora_model
    args = quiet_args(lora_modules=(LoRAModule("big", str(root / "too_big")),))
    with pytest.raises(LoRAModulesError, match="big.*rank 32"):
        with serving(str(root / "base"), args, served_model_name="base", **ENGINE):
            pass
