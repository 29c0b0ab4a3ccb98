"""`uni`: the runner lives in this process and runs on the calling thread (the async engine calls it
via `anyio.to_thread`, one step at a time, so the runner's state is never touched concurrently)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aserve.config import AserveConfig
from aserve.core.batch import RunnerInfo, RunnerOutput, SchedulerOutput
from aserve.executor.base import ExecutorDeadError


def _model_runner(config: AserveConfig) -> Any:
    from aserve.runner.model_runner import ModelRunner

    return ModelRunner(config)


class ThreadExecutor:
    """`runner_factory(config)` makes the runner (default: the real `ModelRunner`; tests hand in a fake
    with the same four methods: load_model, initialize_kv_cache, capture_graphs, execute)."""

    name = "uni"

    def __init__(self, config: AserveConfig, runner_factory: Callable[[AserveConfig], Any] = _model_runner):
        self.config = config
        self.runner_factory = runner_factory
        self.runner = None
        self._dead: BaseException | None = None

    def start(self) -> RunnerInfo:
        self.runner = self.runner_factory(self.config)
        self.runner.load_model()
        info = self.runner.initialize_kv_cache()
        self.runner.capture_graphs()
        return info

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Runs one step. Failures a single request owns come back in `RunnerOutput.failed_requests`;
        anything the runner raises leaves its state unknown, so it is fatal: ExecutorDeadError, now and
        on every later call."""
        if self._dead is not None:
            raise ExecutorDeadError(f"model runner failed earlier: {self._dead!r}")
        try:
            return self.runner.execute(scheduler_output)
        except Exception as exc:
            self._dead = exc
            raise ExecutorDeadError(f"model runner failed: {exc!r}") from exc

    def shutdown(self) -> None:
        self.runner = None
