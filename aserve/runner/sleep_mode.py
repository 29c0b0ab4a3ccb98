"""Sleep mode on the runner's side (vLLM's `--enable-sleep-mode`): release the KV cache, and at level 2
the weights, between steps while no request is running; bring them back on wake-up.

Level 1 drops every reference to the KV cache tensors (the runner's lists, the attention layers'
bindings, a draft model's cache, the compiled decode / CUDA graphs that captured them), so the memory
goes back to the OS (CPU: the tensors came from calloc, large ones are unmapped on free) or to the
device. On CPU the weights already live in host memory and stay; on CUDA level 1 moves the models'
parameters and buffers to host memory (vLLM's offload) and waking moves them back. Level 2 drops the
weights (the model, its LoRA wrapper, a draft model); waking them reloads them from the checkpoint, as
at start-up.

Waking the KV cache allocates the same shapes as at start-up (the scheduler keeps its block pool; the
contents are gone, so the engine resets its prefix cache). Once both parts are awake the cache is bound
to the model again and graphs are recaptured. Tags: `"weights"`, `"kv_cache"` (None: both).
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch

from aserve.core.batch import SLEEP_TAGS

logger = logging.getLogger(__name__)


class RunnerSleep:
    """What the runner has released. `kv_blocks` (num_blocks, num_cpu_blocks) is set by the runner's
    `initialize_kv_cache` when it allocates cache tensors, and reused on every wake-up."""

    def __init__(self) -> None:
        self.kv_blocks: tuple[int, int] | None = None
        self.kv_released = False
        self.weights_released = False
        self.weights_offloaded = False  # CUDA level 1: the weights wait in host memory

    @property
    def is_sleeping(self) -> bool:
        return self.kv_released or self.weights_released or self.weights_offloaded

    def sleep(self, runner: Any, level: int, announce: bool = True) -> None:
        """Release the KV cache (level 1) and the weights (level 2). ValueError for another level.
        The engine sleeps only with no unfinished request, so any request state the runner still holds
        belongs to finished requests whose end it has not been told yet: it is dropped."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        runner.forget_requests()
        runner.compiled_decode = runner.cpu_step = None  # all three hold the cache tensors
        runner.graph_runner = None
        if runner.model is not None and runner.kv_caches:
            runner.model.unbind_kv_caches()
        proposer = runner.proposer
        if proposer is not None and proposer.kv_caches:
            proposer.model.unbind_kv_caches()
            proposer.kv_caches, proposer.cpu_kv_caches = [], []
        runner.kv_caches, runner.cpu_kv_caches = [], []
        self.kv_released = True
        if level == 2:
            runner.model = runner.lora = runner.proposer = None
            self.weights_released = True
        elif runner.device.type == "cuda" and runner.model is not None:
            _move_weights(runner, torch.device("cpu"))
            self.weights_offloaded = True
        _free_memory(runner.device)
        if announce:
            logger.info("Sleeping (level %d): released the KV cache%s", level, " and the weights" if level == 2 else "")

    def wake_up(self, runner: Any, tags: tuple[str, ...] | None = None) -> None:
        """Bring back the parts `tags` names (None: all). Reloading weights can raise what start-up's
        `load_model` raises."""
        tags = SLEEP_TAGS if tags is None else tags
        was_sleeping = self.is_sleeping
        unknown = [t for t in tags if t not in SLEEP_TAGS]
        if unknown:
            raise ValueError(f"unknown wake-up tags {unknown}: use {list(SLEEP_TAGS)}")
        if "weights" in tags and self.weights_released:
            runner.load_model()
            self.weights_released = False
        if "weights" in tags and self.weights_offloaded:
            _move_weights(runner, runner.device)
            self.weights_offloaded = False
        if "kv_cache" in tags and self.kv_released:
            if self.kv_blocks is not None:  # None: a runner with no cache tensors (an encoder)
                runner.allocate_kv_caches(*self.kv_blocks)
            self.kv_released = False
        if was_sleeping and not self.is_sleeping:
            if self.kv_blocks is not None:
                runner.bind_kv_caches(*self.kv_blocks)
            runner.capture_graphs()
            logger.info("Awake: the KV cache and the weights are back")


def release_runner(runner: Any) -> None:
    """At shutdown: drop the KV cache, the weights and the graphs (as sleep level 2) and hand the
    memory back, so a later engine in this process finds the device free."""
    RunnerSleep().sleep(runner, 2, announce=False)


def _move_weights(runner: Any, device: torch.device) -> None:
    """The target's and a draft model's parameters and buffers to `device`."""
    runner.model.to(device)
    draft = getattr(runner.proposer, "model", None)
    if draft is not None:
        draft.to(device)


def _free_memory(device: torch.device) -> None:
    gc.collect()  # tensors held in reference cycles (modules) go now, not at the next collection
    if device.type == "cuda":
        torch.cuda.empty_cache()
