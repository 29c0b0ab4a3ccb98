"""Where the model runner lives. The engine talks to it only through plain batch structs."""

from __future__ import annotations

from typing import Protocol

from aserve.config import AserveConfig
from aserve.core.batch import RunnerInfo, RunnerOutput, SchedulerOutput


class ExecutorDeadError(RuntimeError):
    """The runner (thread or worker process) is gone; pending and future requests fail with this."""


class Executor(Protocol):
    def start(self) -> RunnerInfo:
        """Load the model, size and allocate the KV cache, capture graphs. Blocking."""
        ...

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        """Run one step. Blocking: the async engine calls it from a worker thread. Failures one request owns
        come back in `RunnerOutput.failed_requests`; any other failure raises ExecutorDeadError (fatal)."""
        ...

    def shutdown(self) -> None: ...


def cuda_available() -> bool:
    """Whether the runner will find a CUDA device (asked here so the engine never imports torch)."""
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing or broken
        return False


def make_executor(config: AserveConfig) -> Executor:
    """The executor `--distributed-executor-backend` names (not started yet)."""
    if config.parallel.distributed_executor_backend == "mp":
        from aserve.executor.process import ProcessExecutor

        return ProcessExecutor(config)
    from aserve.executor.thread import ThreadExecutor

    return ThreadExecutor(config)
