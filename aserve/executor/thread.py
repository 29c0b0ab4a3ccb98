"""`uni`: the runner lives in this process and runs on the calling thread (the async engine calls it
via `anyio.to_thread`, one step at a time, so the runner's state is never touched concurrently)."""

from __future__ import annotations

from aserve.config import AserveConfig
from aserve.core.batch import RunnerInfo, RunnerOutput, SchedulerOutput
from aserve.executor.base import ExecutorDeadError


class ThreadExecutor:
    name = "uni"

    def __init__(self, config: AserveConfig, **runner_kwargs):
        self.config = config
        self.runner_kwargs = runner_kwargs
        self.runner = None
        self._dead: BaseException | None = None

    def start(self) -> RunnerInfo:
        from aserve.runner.model_runner import ModelRunner

        self.runner = ModelRunner(self.config, **self.runner_kwargs)
        self.runner.load_model()
        info = self.runner.initialize_kv_cache()
        self.runner.capture_graphs()
        return info

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        if self._dead is not None:
            raise ExecutorDeadError(f"model runner failed earlier: {self._dead!r}")
        try:
            return self.runner.execute(scheduler_output)
        except Exception as exc:  # a failed step leaves runner state unknown: fail everything after it
            self._dead = exc
            raise ExecutorDeadError(f"model runner failed: {exc!r}") from exc

    def shutdown(self) -> None:
        self.runner = None
