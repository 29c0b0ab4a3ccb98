"""The engine's adapter registry: a name and an id each denote one adapter, for good (prefix-cache
blocks are keyed by id, so an unloaded adapter's id is never given to another one)."""

from __future__ import annotations

import pytest

from aserve.engine.lora_registry import LoRARegistry
from aserve.lora import LoRAAdapterError, LoRARequest


def _loaded(calls: list):
    return lambda req: calls.append(req.lora_name)


def test_ids_are_fresh_and_never_reused_after_unloading():
    reg, calls = LoRARegistry(True, 2), []
    first, second = reg.next_id(), reg.next_id()  # two loads in flight get different ids
    assert first != second
    reg.register(LoRARequest("a", first, "/a"), _loaded(calls))
    reg.unregister("a")
    assert reg.next_id() not in (first, second)
    with pytest.raises(LoRAAdapterError, match="already adapter 'a'"):
        reg.register(LoRARequest("b", first, "/b"), _loaded(calls))
    assert reg.register(LoRARequest("a", first, "/a"), _loaded(calls))  # the same adapter may come back
    assert calls == ["a", "a"]


def test_names_and_ids_denote_one_adapter_and_need_lora_enabled():
    reg, calls = LoRARegistry(True, 1), []
    assert reg.register(LoRARequest("a", 1, "/a"), _loaded(calls))
    assert not reg.register(LoRARequest("a", 1, "/a"), _loaded(calls)) and calls == ["a"]
    with pytest.raises(LoRAAdapterError, match="lora_name 'a'"):
        reg.register(LoRARequest("a", 2, "/a"), _loaded(calls))
    with pytest.raises(LoRAAdapterError, match="--enable-lora"):
        LoRARegistry(False, 1).register(LoRARequest("a", 1, "/a"), _loaded(calls))
