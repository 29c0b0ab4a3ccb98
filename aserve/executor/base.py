"""Where the model runner lives. The engine talks to it only through plain batch structs."""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from aserve.config import AserveConfig
from aserve.core.batch import RunnerInfo, RunnerOutput, SchedulerOutput
from aserve.lora.request import LoRARequest


class ExecutorDeadError(RuntimeError):
    """The runner (thread or worker process) is gone; pending and future requests fail with this."""


class Executor(Protocol):
    def start(self) -> RunnerInfo:
        """Load the model, size and allocate the KV cache, capture graphs. Blocking."""
        ...

    def execute(self, scheduler_output: SchedulerOutput,
                on_progress: Callable[[RunnerOutput], None] | None = None) -> RunnerOutput:
        """Run one step. Blocking: the async engine calls it from a worker thread. Failures one request owns
        come back in `RunnerOutput.failed_requests`; any other failure raises ExecutorDeadError (fatal).
        A multi-step call (`scheduler_output.decode_steps`) with `on_progress` streams: each decode step's
        output but the last is passed to `on_progress` (on the calling thread) while the call runs."""
        ...

    # Several steps in flight (pipeline parallelism, async scheduling): a step split in two.
    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Start a step without waiting for its output; never blocks (the async engine calls it on its event
        loop): the step is handed to a sender thread or a queue."""
        ...

    def collect(self) -> RunnerOutput:
        """The output of the oldest step `submit` started and no `collect` returned; failures as `execute`."""
        ...

    def reply_fileno(self) -> int | None:
        """A file descriptor that turns readable when `collect` has a reply to read (or a worker died), so
        an event loop can wait for it without a thread; None when there is none (collect then blocks)."""
        ...

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter into the runner's host cache (blocking; never concurrently with
        `execute`). Raises LoRAAdapterError (the adapter's fault: the runner is unharmed) or
        ExecutorDeadError."""
        ...

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter from the runner's caches; False if it held none with that id."""
        ...

    def sleep(self, level: int) -> None:
        """Sleep mode (never concurrently with `execute`, with no request running): release the KV
        cache (level 1) and the weights (level 2). Any failure is ExecutorDeadError."""
        ...

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        """Bring back what `tags` names ("weights", "kv_cache"; None: both). Any failure (a checkpoint
        that no longer loads) is ExecutorDeadError."""
        ...

    def shutdown(self) -> None: ...


def cuda_available() -> bool:
    """Whether the runner will find a CUDA device, asked without importing torch (1-2 s that the server
    process would spend before the worker even starts): a CPU-only torch build (its `torch/version.py`
    says `cuda = None`) has none; otherwise the CUDA driver is asked for a device count (it honours
    CUDA_VISIBLE_DEVICES, as torch does). Falls back to `torch.cuda.is_available()` where neither answers."""
    build = _torch_build_info()
    if build is not None and build.get("cuda") is None and build.get("hip") is None:
        return False
    if build is not None and build.get("hip") is None:
        count = _cuda_driver_device_count()
        if count is not None:
            return count > 0
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing or broken
        return False


def local_gpu_count() -> int | None:
    """This machine's CUDA devices (honouring CUDA_VISIBLE_DEVICES), asked of the driver without torch;
    0 with a CPU-only torch build; None when the driver does not answer."""
    build = _torch_build_info()
    if build is not None and build.get("cuda") is None:
        return 0
    return _cuda_driver_device_count()


def _torch_build_info() -> dict | None:
    """The variables of the installed torch's `version.py` (without importing torch), or None."""
    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.submodule_search_locations:
            return None
        source = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
        namespace: dict = {}
        exec(compile(source, "torch/version.py", "exec"), namespace)  # a few assignments, written by torch's build
        return namespace
    except Exception:
        return None


def _cuda_driver_device_count() -> int | None:
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0  # no driver: no device
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0:
        return 0
    if driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return None
    return count.value


def make_executor(config: AserveConfig) -> Executor:
    """The executor `--distributed-executor-backend` names (not started yet)."""
    if config.parallel.distributed_executor_backend == "mp":
        from aserve.executor.process import ProcessExecutor

        return ProcessExecutor(config)
    if config.parallel.distributed_executor_backend == "ray":
        from aserve.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    from aserve.executor.thread import ThreadExecutor

    return ThreadExecutor(config)
