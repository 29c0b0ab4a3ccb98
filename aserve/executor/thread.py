"""`uni`: the runner lives in this process and runs on the calling thread (the async engine calls it
via `anyio.to_thread`, one step at a time, so the runner's state is never touched concurrently).
Async scheduling's `submit` / `collect` run the steps in order on one thread of their own."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from aserve.config import AserveConfig
from aserve.core.batch import RunnerInfo, RunnerOutput, SchedulerOutput
from aserve.executor.base import ExecutorDeadError
from aserve.lora.errors import LoRAAdapterError
from aserve.lora.request import LoRARequest


def _model_runner(config: AserveConfig) -> Any:
    from aserve.runner.factory import make_runner

    return make_runner(config)


class ThreadExecutor:
    """`runner_factory(config)` makes the runner (default: the real `ModelRunner`; tests hand in a fake
    with the same four methods: load_model, initialize_kv_cache, capture_graphs, execute)."""

    name = "uni"

    def __init__(self, config: AserveConfig, runner_factory: Callable[[AserveConfig], Any] = _model_runner):
        self.config = config
        self.runner_factory = runner_factory
        self.runner = None
        self._dead: BaseException | None = None
        self._stepper: ThreadPoolExecutor | None = None  # submit's thread (async scheduling)
        self._submitted: deque[Future] = deque()

    def start(self) -> RunnerInfo:
        self.runner = self.runner_factory(self.config)
        self.runner.load_model()
        info = self.runner.initialize_kv_cache()
        self.runner.capture_graphs()
        return info

    def execute(self, scheduler_output: SchedulerOutput,
                on_progress: Callable[[RunnerOutput], None] | None = None) -> RunnerOutput:
        """Runs one step. Failures a single request owns come back in `RunnerOutput.failed_requests`;
        anything the runner raises leaves its state unknown, so it is fatal: ExecutorDeadError, now and
        on every later call."""
        if self._dead is not None:
            raise ExecutorDeadError(f"model runner failed earlier: {self._dead!r}")
        try:
            if on_progress is None:
                return self.runner.execute(scheduler_output)
            return self.runner.execute(scheduler_output, on_progress)
        except Exception as exc:
            self._dead = exc
            raise ExecutorDeadError(f"model runner failed: {exc!r}") from exc

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Starts the step on the executor's own thread (after the steps submitted before it)."""
        if self._stepper is None:
            self._stepper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="aserve-step")
        self._submitted.append(self._stepper.submit(self.execute, scheduler_output))

    def collect(self) -> RunnerOutput:
        """The oldest submitted step's output (blocking); failures as `execute`."""
        return self._submitted.popleft().result()

    def reply_fileno(self) -> None:
        return None

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Raises LoRAAdapterError for any failure to load the adapter (the runner's state is unchanged)."""
        if self._dead is not None:
            raise ExecutorDeadError(f"model runner failed earlier: {self._dead!r}")
        try:
            self.runner.add_lora(lora_request)
        except LoRAAdapterError:
            raise
        except Exception as exc:  # noqa: BLE001 - unreadable files etc. belong to the adapter
            raise LoRAAdapterError(f"{type(exc).__name__}: {exc}") from exc

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.runner.remove_lora(lora_int_id)

    def sleep(self, level: int) -> None:
        self._call(self.runner.sleep, level)

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        self._call(self.runner.wake_up, tags)

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A runner call whose failure leaves its state unknown: fatal, as in `execute`."""
        if self._dead is not None:
            raise ExecutorDeadError(f"model runner failed earlier: {self._dead!r}")
        try:
            return fn(*args)
        except Exception as exc:
            self._dead = exc
            raise ExecutorDeadError(f"model runner failed: {exc!r}") from exc

    def shutdown(self) -> None:
        """Releases the runner's memory now (a later engine in this process finds the device free)."""
        if self._stepper is not None:  # the steps already submitted finish first
            self._stepper.shutdown(wait=True)
            self._stepper = None
        runner, self.runner = self.runner, None
        if runner is not None and hasattr(runner, "sleep_state"):  # a real ModelRunner (tests may hand in fakes)
            from aserve.runner.sleep_mode import release_runner

            release_runner(runner)
