"""--cpu-offload-gb (model/weight_offload.py). No GPU here, so the device is the CPU: the hooks still
copy every offloaded parameter to a fresh tensor before its layer runs and point it back at its
host tensor afterwards, which is the mechanism a GPU run uses; the tokens must not change, and the
budget picks whole layers first to last. The flag itself is refused where it means nothing (CPU)."""

from __future__ import annotations

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.config import ConfigError, EngineArgs, GiB
from aserve.model.weight_offload import decoder_layers, offload_weights

PROMPTS = [{"prompt_token_ids": [5, 17, 99, 3, 42, 8]}, {"prompt_token_ids": [300, 11, 7]}]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _layer_bytes(layer) -> int:
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def test_offloaded_layers_run_on_fresh_copies_and_give_the_same_tokens(tiny_llama):
    llm = LLM(model=tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=64)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    runner = llm.llm_engine.core._executor.runner
    num_layers = runner.arch.num_hidden_layers
    layers = decoder_layers(runner.model, num_layers)
    assert layers is not None and len(layers) == num_layers >= 2
    per_layer = _layer_bytes(layers[0])
    report = offload_weights(runner.model, num_layers, per_layer + 1, torch.device("cpu"), pin_memory=False)
    assert report.num_layers == 2 and report.num_bytes == 2 * per_layer  # the layer crossing the budget counts
    hosts = {id(p): p.data_ptr() for layer in layers[:2] for p in layer.parameters()}
    seen_in_forward: list[bool] = []

    def spy(module, args):  # runs after the offload pre-hook: parameters point at the streamed copies
        seen_in_forward.append(all(p.data_ptr() != hosts[id(p)] for p in module.parameters()))

    for layer in layers[:2]:
        layer.register_forward_pre_hook(spy)
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want
    assert seen_in_forward and all(seen_in_forward)
    assert all(p.data_ptr() == hosts[id(p)] for layer in layers[:2] for p in layer.parameters())  # back home
    assert not layers[2:] or not layers[2]._forward_pre_hooks  # later layers untouched


def test_the_flag_is_refused_on_cpu_and_resolved_on_cuda(tiny_llama):
    with pytest.raises(ConfigError, match="--cpu-offload-gb: offloads weights from a GPU to CPU memory; on cpu"):
        EngineArgs(model=tiny_llama, cpu_offload_gb=1).create_config(model_path=tiny_llama)
    with pytest.raises(ConfigError, match="--cpu-offload-gb: must be >= 0"):
        EngineArgs(model=tiny_llama, cpu_offload_gb=-1).validate()
    config = EngineArgs(model=tiny_llama, cpu_offload_gb=1.5).create_config(model_path=tiny_llama, cuda_available=True)
    assert config.device.device == "cuda" and config.cache.cpu_offload_bytes == int(1.5 * GiB)
    assert config.runner.enforce_eager  # no CUDA graphs over streamed weights


def test_offload_with_sleep_mode_is_refused():
    with pytest.raises(ConfigError, match="--cpu-offload-gb: cannot be combined with --enable-sleep-mode"):
        EngineArgs(cpu_offload_gb=1, enable_sleep_mode=True).validate()
