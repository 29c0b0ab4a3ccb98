"""The async engine's loop under pipeline parallelism: up to `max_steps_in_flight` steps (one per stage)
run at once, so every stage has work (vLLM's virtual engines).

Each turn: schedule and submit steps until the pipeline is full or nothing more can run (the scheduler
leaves requests already in flight out of later steps), then collect the oldest step, apply it and
deliver its outputs while the later steps still run on the workers. Scheduling, `update`, delivery and
`submit` (which never waits) stay on the event loop; so does `collect` where the executor has a file
descriptor to wait on (the `mp` worker's pipe), else the blocking `collect` goes to a worker thread.
This loop also runs async scheduling (two steps in flight).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import anyio

if TYPE_CHECKING:
    from aserve.engine.async_engine import AsyncEngine


async def run_pipelined(engine: AsyncEngine) -> None:
    """Runs `engine`'s steps until it is stopped and drained; raises what the executor raises (the
    caller's `run` turns it into a dead engine)."""
    core = engine.engine.core
    while not engine._stopping or engine.engine.has_unfinished_requests():  # steps in flight count
        if not engine.engine.has_unfinished_requests():
            await engine._wakeup.wait()
            engine._wakeup = anyio.Event()
            continue
        while not engine._submits_held and (so := core.next_step()) is not None:
            async with engine._executor_lock:
                core.submit(so)
        if not core.num_steps_in_flight:  # unfinished requests, none of which can run now
            await anyio.sleep(0.001)
            continue
        fd = core.reply_fileno()
        if fd is not None:  # the worker's pipe: wait on the loop, then read the reply at once
            await anyio.wait_readable(fd)
        async with engine._executor_lock:
            so, output, seconds = core.collect() if fd is not None else await anyio.to_thread.run_sync(core.collect)
        engine._deliver(core.update(so, output), seconds)
        await anyio.sleep(0)  # let request handlers run between steps
