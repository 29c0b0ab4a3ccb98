"""`mp`: the runner lives in worker processes; steps travel as msgspec msgpack over one pipe per worker.

With `--tensor-parallel-size N` and `--pipeline-parallel-size P` there are N x P workers, one per rank,
which meet in `torch.distributed` at a localhost port chosen here (gloo on CPU, NCCL on CUDA). Every
step's `SchedulerOutput` goes to every rank (they all run the same step; the last stage's ranks sample
the same tokens from the gathered logits); the first rank of the last stage returns the `RunnerOutput`
(`rank_worker.output_rank`), the others answer with an empty acknowledgement. `submit` / `collect`
split a step so that several are in flight (pipeline parallelism, async scheduling): each worker's pipe
keeps them in order, and `collect` returns the oldest step's output. `submit` writes a small step itself
and hands a large one to a sender thread: written from the caller's thread, a large step could block on a
worker that is itself blocked writing a large reply the caller has not read yet. `reply_fileno` lets the
async engine's event loop wait for a reply itself (no thread hand-off per step).

Any worker's death (crash, OOM kill) or error, at start-up or in a step, is fatal: ExecutorDeadError,
which the engine turns into failed requests and a failing /health, never a hang. While waiting for a
reply the executor also watches every worker's process sentinel, so a rank that dies while its peers
block in a collective is noticed at once (the peers are then killed); a rank that never reaches the
rendezvous makes the others fail after the rendezvous timeout (`ASERVE_DIST_TIMEOUT_S`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import queue
import select
import threading
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import NoReturn

import msgspec

from aserve.config import AserveConfig
from aserve.core.batch import RunnerInfo, RunnerOutput, SchedulerOutput
from aserve.distributed.rendezvous import Rendezvous, local_rendezvous
from aserve.executor.base import ExecutorDeadError
from aserve.executor.rank_worker import RankWorker, output_rank
from aserve.lora.errors import LoRAAdapterError
from aserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
_decode_ro = msgspec.msgpack.Decoder(RunnerOutput)
_decode_info = msgspec.msgpack.Decoder(RunnerInfo)

# Message tags (first byte) on the pipe.
_EXECUTE, _SHUTDOWN, _OK, _ERROR = b"E", b"S", b"O", b"X"
_ADD_LORA, _REMOVE_LORA, _ADAPTER_ERROR = b"L", b"R", b"A"  # an adapter error leaves the worker running
_SLEEP, _WAKE_UP = b"Z", b"W"  # sleep mode: a failure is fatal, as in a step
# A streamed multi-step call: rank 0 sends each decode step's output but the last as a progress message.
_EXECUTE_STREAMED, _PROGRESS = b"e", b"P"
# A step this small is written by `submit` itself: with at most a few steps in flight it fits the pipe's
# buffer, so the write cannot wait on the worker (larger ones go through the sender thread).
_DIRECT_SEND_BYTES = 32768


def _worker_main(conn, config_bytes: bytes, rank: int, rendezvous: Rendezvous | None) -> None:
    config: AserveConfig = pickle.loads(config_bytes)
    world_size = rendezvous.world_size if rendezvous is not None else 1
    tag = f"worker {rank}" if world_size > 1 else "worker"
    if config.parallel.data_parallel_size > 1:
        tag = f"replica {config.parallel.data_parallel_rank} {tag}"
    logging.basicConfig(level=os.environ.get("ASERVE_LOG_LEVEL", "INFO"),
                        format=f"%(levelname)s %(asctime)s [{tag}] %(name)s: %(message)s")
    worker = RankWorker(config, rank, rendezvous)
    try:
        conn.send_bytes(_OK + worker.start())
    except BaseException:
        conn.send_bytes(_ERROR + traceback.format_exc().encode())
        return
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the engine went away
        tag, body = msg[:1], msg[1:]
        if tag == _SHUTDOWN:
            worker.shutdown()
            return
        if tag in (_ADD_LORA, _REMOVE_LORA):
            reply = worker.add_lora(body) if tag == _ADD_LORA else worker.remove_lora(int(body))
            conn.send_bytes(_OK + (b"1" if reply.ok else b"0") if reply.error is None
                            else _ADAPTER_ERROR + reply.error.encode())
            continue
        try:
            if tag == _SLEEP:
                worker.sleep(int(body))
                conn.send_bytes(_OK)
            elif tag == _WAKE_UP:
                worker.wake_up(body)
                conn.send_bytes(_OK)
            else:
                progress = (lambda step: conn.send_bytes(_PROGRESS + step)) if tag == _EXECUTE_STREAMED else None
                conn.send_bytes(_OK + worker.execute(body, progress))
        except BaseException:
            conn.send_bytes(_ERROR + traceback.format_exc().encode())
            return


class ProcessExecutor:
    name = "mp"

    def __init__(self, config: AserveConfig):
        self.config = config
        self.world_size = config.parallel.world_size
        self.output_rank = output_rank(config)
        self._conns: list = []
        self._procs: list = []
        self._pollers: dict[int, select.poll] = {}  # _has_data's, by rank
        self._dead: str | None = None
        self._outbox: queue.Queue[bytes | None] | None = None  # submit's messages (sender thread)
        self._sender: threading.Thread | None = None
        self._send_lock = threading.Lock()
        self._queued_sends = 0

    def start(self) -> RunnerInfo:
        """Start one worker per rank and wait for all of them; the output rank's RunnerInfo (the ranks
        agreed on the KV block count). Raises ExecutorDeadError (with the failing rank's traceback) if any rank
        fails or dies while starting; the others are stopped."""
        ctx = mp.get_context("spawn")
        rendezvous = local_rendezvous(self.world_size, self.config.device.device) if self.world_size > 1 else None
        config_bytes = pickle.dumps(self.config)
        for rank in range(self.world_size):
            parent, child = ctx.Pipe(duplex=True)
            name = "aserve-runner" if self.world_size == 1 else f"aserve-runner-{rank}"
            proc = ctx.Process(target=_worker_main, args=(child, config_bytes, rank, rendezvous), name=name,
                               daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        if rendezvous is not None:
            logger.info("Started %d workers: %d tensor-parallel x %d pipeline stages (%s at %s)", self.world_size,
                        self.config.parallel.tensor_parallel_size, self.config.parallel.pipeline_parallel_size,
                        rendezvous.backend, rendezvous.init_method)
        return _decode_info.decode(self._recv_all())

    def _recv_all(self, every: bool = False, on_progress: Callable[[RunnerOutput], None] | None = None):
        """One reply from every rank: the output rank's body (`every`: the list of bodies, in rank order).
        The output rank's progress messages before its reply go to `on_progress`. Watches every
        worker's sentinel meanwhile."""
        pending = set(range(len(self._conns)))
        replies: dict[int, bytes] = {}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while pending:
            only = next(iter(pending)) if len(pending) == 1 else None
            if only is not None and self._has_data(only):  # the reply is there (the event loop waited for it)
                ready = [self._conns[only]]
            else:
                ready = wait([self._conns[r] for r in pending] + list(sentinels))
            for rank in sorted(pending):
                conn = self._conns[rank]
                if conn in ready or conn.poll():
                    body = self._recv_one(rank)
                    if body[:1] == _PROGRESS and on_progress is not None:
                        try:
                            on_progress(_decode_ro.decode(body[1:]))
                        except BaseException as exc:  # the engine could not take the step: fatal, never half-read
                            self._fail(f"a streamed decode step could not be delivered: {exc!r}", exc)
                        continue
                    replies[rank] = body
                    pending.discard(rank)
            for sentinel in ready:
                rank = sentinels.get(sentinel)
                if rank is not None and not self._conns[rank].poll():  # died without a last word
                    self._fail(f"{self._who(rank)} process died (exit code {self._exit_code(rank)})")
        return [replies[r] for r in range(len(self._conns))] if every else replies[self.output_rank]

    def _has_data(self, rank: int) -> bool:
        """Whether rank's pipe is readable now: one poll(2) on a poller kept per pipe (Connection.poll builds
        a selector per call)."""
        poller = self._pollers.get(rank)
        if poller is None:
            poller = self._pollers[rank] = select.poll()
            poller.register(self._conns[rank].fileno(), select.POLLIN)
        return bool(poller.poll(0))

    def _recv_one(self, rank: int) -> bytes:
        try:
            msg = self._conns[rank].recv_bytes()
        except (EOFError, OSError) as exc:
            self._fail(f"{self._who(rank)} process died (exit code {self._exit_code(rank)})", exc)
        if msg[:1] == _ERROR:
            self._fail(f"{self._who(rank)} failed:\n" + msg[1:].decode(errors="replace"))
        return msg if msg[:1] in (_ADAPTER_ERROR, _PROGRESS) else msg[1:]

    def _who(self, rank: int) -> str:
        return "model worker" if self.world_size == 1 else f"model worker (rank {rank})"

    def _exit_code(self, rank: int) -> int | None:
        proc = self._procs[rank]
        proc.join(timeout=2)
        return proc.exitcode

    def _fail(self, message: str, cause: BaseException | None = None) -> NoReturn:
        """Dead for good: record why, stop every other worker (they may be blocked in a collective
        waiting for the one that failed), raise ExecutorDeadError."""
        self._dead = message
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        raise ExecutorDeadError(message) from cause

    def _broadcast(self, body: bytes) -> None:
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(body)
            except (BrokenPipeError, OSError) as exc:
                self._fail(f"{self._who(rank)} process is gone", exc)

    def execute(self, scheduler_output: SchedulerOutput,
                on_progress: Callable[[RunnerOutput], None] | None = None) -> RunnerOutput:
        streamed = on_progress is not None and bool(scheduler_output.decode_steps)
        self._broadcast((_EXECUTE_STREAMED if streamed else _EXECUTE) + _encoder.encode(scheduler_output))
        return _decode_ro.decode(self._recv_all(on_progress=on_progress if streamed else None))

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Starts a step without waiting for it (pipeline parallelism); `collect` returns its output.
        Only `submit` / `collect` may be used once `submit` was called (the sender thread writes the pipes)."""
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)
        if self._sender is None:
            self._outbox = queue.Queue()
            self._sender = threading.Thread(target=self._send_loop, name="aserve-step-sender", daemon=True)
            self._sender.start()
        body = _EXECUTE + _encoder.encode(scheduler_output)
        with self._send_lock:
            if len(body) <= _DIRECT_SEND_BYTES and self._queued_sends == 0:  # fits the pipe's buffer: no wait
                try:
                    for conn in self._conns:
                        conn.send_bytes(body)
                except (OSError, ValueError):
                    pass  # the worker is gone: collect reports it
                return
            self._queued_sends += 1  # after the sender's queue, in order
        self._outbox.put(body)

    def reply_fileno(self) -> int | None:
        """The worker's pipe with one worker (readable once its reply, or its end, is there: `collect` then
        reads a whole message, which the worker writes at once); None with several ranks."""
        return self._conns[0].fileno() if len(self._conns) == 1 and self._dead is None else None

    def _send_loop(self) -> None:
        """The sender thread: every rank gets each message in order; a broken pipe ends it (the worker's
        death is reported by `collect`, which watches the processes)."""
        while (body := self._outbox.get()) is not None:
            try:
                for conn in self._conns:
                    conn.send_bytes(body)
            except (OSError, ValueError):
                return
            finally:
                with self._send_lock:
                    self._queued_sends -= 1

    def collect(self) -> RunnerOutput:
        """The output of the oldest step `submit` started and no `collect` returned yet (blocking)."""
        return _decode_ro.decode(self._recv_all())

    def _adapter_call(self, body: bytes) -> bytes:
        """Every rank runs it; LoRAAdapterError if any rank refused the adapter (rank order)."""
        self._broadcast(body)
        replies = self._recv_all(every=True)
        refused = [r for r in replies if r[:1] == _ADAPTER_ERROR]
        if refused:
            raise LoRAAdapterError(refused[0][1:].decode(errors="replace"))
        return replies[0]

    def add_lora(self, lora_request: LoRARequest) -> None:
        self._adapter_call(_ADD_LORA + _encoder.encode(lora_request))

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._adapter_call(_REMOVE_LORA + str(int(lora_int_id)).encode()) == b"1"

    def sleep(self, level: int) -> None:
        self._broadcast(_SLEEP + str(int(level)).encode())
        self._recv_all()

    def wake_up(self, tags: tuple[str, ...] | None = None) -> None:
        self._broadcast(_WAKE_UP + _encoder.encode(None if tags is None else list(tags)))
        self._recv_all()

    @property
    def pid(self) -> int | None:
        """Rank 0's worker process id (None before start / after shutdown)."""
        return self._procs[0].pid if self._procs else None

    @property
    def pids(self) -> list[int]:
        """Every rank's worker process id, in rank order."""
        return [proc.pid for proc in self._procs]

    def shutdown(self) -> None:
        if self._sender is not None:  # the steps already submitted go first
            self._outbox.put(None)
            self._sender.join(timeout=10)
            self._sender = None
        for conn in self._conns:
            try:
                conn.send_bytes(_SHUTDOWN)
            except OSError:
                pass
            conn.close()
        self._conns = []
        self._pollers = {}
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs = []
