"""GPU memory accounting without a GPU (`runner/kv_memory.profile_num_blocks`, `executor/thread.py`
shutdown): torch.cuda's memory queries are replaced by a fake card whose free memory reflects this
process's allocations, the allocator's cache and other processes. The KV cache is sized from the free
memory after the profile pass, so a second engine in this process or another process on the card (an
`mp` worker of another engine) is never promised memory it does not have; an engine's shutdown hands
its memory back."""

from __future__ import annotations

import pytest
import torch

from aserve.runner.kv_memory import profile_num_blocks

GiB = 1 << 30
BLOCK = 64 << 20  # 64 MiB per KV block


class FakeCard:
    """One device: `others` bytes held by other processes, this process's allocated bytes, the
    caching allocator's reserve (freed blocks it keeps until empty_cache) and its peak."""

    def __init__(self, total: int, others: int = 0, context: int = GiB // 2):
        self.total, self.others, self.context = total, others, context
        self.allocated = self.reserved = self.peak = 0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.reserved = max(self.reserved, self.allocated)
        self.peak = max(self.peak, self.allocated)

    def free(self, n: int) -> None:
        self.allocated -= n  # stays reserved in the allocator's cache

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(cuda, "empty_cache", lambda: setattr(self, "reserved", self.allocated))
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: setattr(self, "peak", self.allocated))
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: self.allocated)
        monkeypatch.setattr(cuda, "mem_get_info",
                            lambda device=None: (self.total - self.others - self.context - self.reserved, self.total))


def _profile_step(card: FakeCard, activations: int):
    def run():
        card.alloc(activations)
        card.free(activations)
    return run


def test_kv_budget_is_the_utilization_share_minus_what_is_in_use_and_the_activation_peak(monkeypatch):
    card = FakeCard(80 * GiB)
    card.install(monkeypatch)
    card.alloc(10 * GiB)  # weights
    blocks = profile_num_blocks(_profile_step(card, 5 * GiB), torch.device("cuda", 0), 0.9, BLOCK)
    # 72 GiB allowed - (10 weights + 0.5 context) in use - 5 activation peak = 56.5 GiB
    assert blocks == int((72 - 10.5 - 5) * GiB // BLOCK)
    card.alloc(blocks * BLOCK)
    assert card.allocated + card.context + 5 * GiB <= 0.9 * card.total  # fits at the peak of a step


def test_a_second_engine_or_another_process_on_the_card_is_accounted_for(monkeypatch):
    """The old sizing (total x utilization - this process's peak) promised a second engine 57 GiB of a
    card whose first engine already held 45: the worker died of CUDA OOM. Free memory tells the truth."""
    card = FakeCard(80 * GiB, others=45 * GiB)  # the first engine (its mp worker is another process)
    card.install(monkeypatch)
    card.alloc(10 * GiB)
    blocks = profile_num_blocks(_profile_step(card, 5 * GiB), torch.device("cuda", 0), 0.9, BLOCK)
    assert blocks * BLOCK <= card.total * 0.9 - card.others - card.context - card.allocated - 5 * GiB
    assert blocks == int((72 - 45 - 10.5 - 5) * GiB // BLOCK)


def test_the_allocators_cache_from_the_profile_pass_does_not_shrink_the_cache(monkeypatch):
    card = FakeCard(80 * GiB)
    card.install(monkeypatch)
    card.alloc(10 * GiB)
    card.alloc(3 * GiB)  # an earlier pass left reserved-but-free memory behind
    card.free(3 * GiB)
    blocks = profile_num_blocks(_profile_step(card, 5 * GiB), torch.device("cuda", 0), 0.9, BLOCK)
    assert blocks == int((72 - 10.5 - 5) * GiB // BLOCK)


def test_no_room_names_the_flags(monkeypatch):
    card = FakeCard(80 * GiB, others=60 * GiB)
    card.install(monkeypatch)
    card.alloc(10 * GiB)
    with pytest.raises(RuntimeError, match="raise --gpu-memory-utilization, stop what else holds the GPU"):
        profile_num_blocks(_profile_step(card, 5 * GiB), torch.device("cuda", 0), 0.9, BLOCK)


def test_shutdown_releases_the_runners_memory(tiny_llama, monkeypatch):
    """The thread executor's shutdown drops the model, the KV cache and the graphs and empties the
    allocator's cache, so a second engine in this process can size its cache from a free device."""
    from aserve import LLM
    from aserve.runner import sleep_mode

    llm = LLM(tiny_llama, dtype="float32", skip_tokenizer_init=True, max_model_len=64, cpu_kvcache_space=0.02)
    executor = llm.llm_engine.core._executor
    runner = executor.runner
    freed = []
    monkeypatch.setattr(sleep_mode, "_free_memory", lambda device: freed.append(device))
    llm.llm_engine.shutdown()
    assert executor.runner is None and freed == [runner.device]
    assert runner.model is None and runner.kv_caches == [] and runner.graph_runner is None
