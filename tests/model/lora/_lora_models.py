"""Test helper: tiny HF models with PEFT LoRA adapters (random non-zero A and B), our model with a
`LoRAModelManager`, and a paged driver that runs steps mixing adapters inside the forward context."""

from __future__ import annotations

import copy
import random
import warnings
from pathlib import Path

import torch

from aserve.config import LoRAConfig
from aserve.lora import LoRARequest
from aserve.model.forward_context import ForwardContext, set_forward_context
from aserve.model.lora.manager import LoRAModelManager
from tests.model._paged_batch import PagedBatch
from tests.support.tiny_models import VOCAB

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(hf_model, path: Path, seed: int, r: int = 8, lora_alpha: int = 16, **kwargs):
    """Save a PEFT LoRA adapter for a copy of `hf_model` (`init_lora_weights=False`: B is not zero) and
    return the PEFT model (eval, fp32), the reference for it."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=kwargs.pop("target_modules", ALL_TARGETS),
                        init_lora_weights=False, lora_dropout=0.0, **kwargs)
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # PEFT warns about lora_bias on bias-free layers and 1-D bias tensors
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(copy.deepcopy(hf_model), config).eval()
    if config.lora_bias:  # nn.Linear's init gives the bias small values; make it matter
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name and name.endswith("bias"):
                    p.normal_(0, 0.3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peft_model.save_pretrained(str(path))
    return peft_model


def lora_config(**kwargs) -> LoRAConfig:
    return LoRAConfig(**{"enable_lora": True, "max_loras": 3, "max_lora_rank": 16, "max_cpu_loras": 4, **kwargs})


def request(lora_id: int, path: Path) -> LoRARequest:
    return LoRARequest(f"adapter{lora_id}", lora_id, str(path))


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


def run_lora_schedule(model, manager: LoRAModelManager, prompts_: list[list[int]], adapter_ids: list[int],
                      steps: list[list[tuple[int, int]]], requests: dict[int, LoRARequest],
                      block_size: int = 8) -> list[torch.Tensor]:
    """As tests/model/_tiny_models.run_schedule, sequence i running with adapter `adapter_ids[i]` (0 =
    base): each step's per-token adapter ids go through `manager.prepare_step` and the forward runs in
    the forward context. Returns each sequence's float32 logits for every position."""
    arch = model.arch
    batch = PagedBatch(arch.num_hidden_layers, arch.num_key_value_heads, arch.head_dim, block_size, 64,
                       dtype=model.dtype)
    model.bind_kv_caches(batch.kv_caches)
    done = [0] * len(prompts_)
    out: list[list[torch.Tensor]] = [[] for _ in prompts_]
    with torch.no_grad():
        for step in steps:
            chunks = []
            for seq, n in sorted(step, key=lambda c: c[1] != 1):
                chunks.append((seq, prompts_[seq][done[seq]:done[seq] + n]))
                done[seq] += n
            input_ids, positions, meta = batch.step(chunks)
            token_ids = [adapter_ids[seq] for seq, tokens in chunks for _ in tokens]
            mapping = manager.prepare_step(token_ids, requests)
            with set_forward_context(ForwardContext(lora=mapping)):
                logits = model.compute_logits(model(input_ids, positions, meta)).float()
            for i, (seq, _) in enumerate(chunks):
                out[seq].append(logits[meta.query_start_loc_cpu[i]:meta.query_start_loc_cpu[i + 1]])
    return [torch.cat(parts) for parts in out]


def reference_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()
