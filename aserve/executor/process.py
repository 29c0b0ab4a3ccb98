"""`mp`: the runner lives in a worker process; steps travel as msgspec msgpack over a pipe.

The worker's death (crash, OOM kill) surfaces as ExecutorDeadError on the next `execute`, which the
engine turns into failed requests and a failing /health, never a hang.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import traceback

import msgspec

from aserve.config import AserveConfig
from aserve.core.batch import RunnerInfo, RunnerOutput, SchedulerOutput
from aserve.executor.base import ExecutorDeadError

logger = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
_decode_so = msgspec.msgpack.Decoder(SchedulerOutput)
_decode_ro = msgspec.msgpack.Decoder(RunnerOutput)
_decode_info = msgspec.msgpack.Decoder(RunnerInfo)

# Message tags (first byte) on the pipe.
_EXECUTE, _SHUTDOWN, _OK, _ERROR = b"E", b"S", b"O", b"X"


def _worker_main(conn, config_bytes: bytes) -> None:
    config: AserveConfig = pickle.loads(config_bytes)
    logging.basicConfig(level=os.environ.get("ASERVE_LOG_LEVEL", "INFO"),
                        format="%(levelname)s %(asctime)s [worker] %(name)s: %(message)s")
    try:
        from aserve.runner.model_runner import ModelRunner

        runner = ModelRunner(config)
        runner.load_model()
        info = runner.initialize_kv_cache()
        runner.capture_graphs()
        conn.send_bytes(_OK + _encoder.encode(info))
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
            return
        try:
            out = runner.execute(_decode_so.decode(body))
            conn.send_bytes(_OK + _encoder.encode(out))
        except BaseException:
            conn.send_bytes(_ERROR + traceback.format_exc().encode())
            return


class ProcessExecutor:
    name = "mp"

    def __init__(self, config: AserveConfig):
        self.config = config
        self._conn = None
        self._proc = None
        self._dead: str | None = None

    def start(self) -> RunnerInfo:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_worker_main, args=(child, pickle.dumps(self.config)),
                                 name="aserve-runner", daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        return _decode_info.decode(self._recv())

    def _recv(self) -> bytes:
        try:
            msg = self._conn.recv_bytes()
        except (EOFError, OSError) as exc:
            code = None
            if self._proc is not None:
                self._proc.join(timeout=2)
                code = self._proc.exitcode
            self._dead = f"model worker process died (exit code {code})"
            raise ExecutorDeadError(self._dead) from exc
        if msg[:1] == _ERROR:
            self._dead = "model worker failed:\n" + msg[1:].decode(errors="replace")
            raise ExecutorDeadError(self._dead)
        return msg[1:]

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerOutput:
        if self._dead is not None:
            raise ExecutorDeadError(self._dead)
        try:
            self._conn.send_bytes(_EXECUTE + _encoder.encode(scheduler_output))
        except (BrokenPipeError, OSError) as exc:
            self._dead = "model worker process is gone"
            raise ExecutorDeadError(self._dead) from exc
        return _decode_ro.decode(self._recv())

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def shutdown(self) -> None:
        if self._conn is not None:
            try:
                self._conn.send_bytes(_SHUTDOWN)
            except OSError:
                pass
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
            self._proc = None
