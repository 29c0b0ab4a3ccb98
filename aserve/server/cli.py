"""`aserve` / `python -m aserve.server.cli`: parse flags, build the engine, serve until signalled."""

from __future__ import annotations

import importlib
import logging
import sys

from aserve.config import ConfigError
from aserve.server.args import ServerArgs, make_parser, parse_args
from aserve.server.chat_template import load_flag_template
from aserve.server.launch import PortInUseError, bind_socket, python_log_level, run
from aserve.server.lora import LoRAModulesError

logger = logging.getLogger("aserve.server")


def configure_logging(args: ServerArgs) -> None:
    logging.basicConfig(
        level=python_log_level(args.log_level),
        format="%(levelname)s %(asctime)s [%(name)s] %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )
    logging.getLogger("aserve").setLevel(python_log_level(args.log_level))


class StartupError(Exception):
    """The engine could not be built from the given arguments (bad --model, bad engine argument)."""


def main(argv: list[str] | None = None) -> int:
    """Returns 0 after a graceful shutdown; 2 for bad arguments or a busy port (found before the model
    loads); 1 if the engine fails. `aserve bench ...` and `aserve quantize ...` run aserve.bench.cli and
    aserve.quantize.cli instead (their own codes)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return importlib.import_module("aserve.bench.cli").main(argv[1:])  # lazily: it may import torch
    if argv[:1] == ["quantize"]:
        return importlib.import_module("aserve.quantize.cli").main(argv[1:])
    engine_args, server_args = parse_args(argv)
    configure_logging(server_args)
    if server_args.chat_template:
        if engine_args.tokenizer_mode == "mistral":
            make_parser().error("--chat-template: --tokenizer-mode mistral encodes chats with mistral_common "
                                "(no jinja template); drop one of the two")
        try:
            load_flag_template(server_args.chat_template)  # fail before loading the model
        except ConfigError as exc:
            make_parser().error(str(exc))
    try:
        sock = bind_socket(server_args.host, server_args.port)  # before the model loads: fail in a second
    except PortInUseError as exc:
        print(f"aserve: error: {exc}", file=sys.stderr)
        return 2

    def build_engine():
        # Imported here: importing the server loads no engine internals until an engine is built.
        async_engine = importlib.import_module("aserve.engine.async_engine")
        try:
            if engine_args.data_parallel_size > 1:  # replicas behind one server
                data_parallel = importlib.import_module("aserve.engine.data_parallel")
                return data_parallel.DataParallelEngine.from_engine_args(engine_args)
            return async_engine.AsyncEngine.from_engine_args(engine_args)
        except ValueError as exc:  # ConfigError, ModelSourceError: the message names the argument
            raise StartupError(str(exc)) from exc

    try:
        run(build_engine, server_args, sock)
    except (StartupError, LoRAModulesError) as exc:
        print(f"aserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    except Exception:  # the engine died or could not start
        logger.exception("aserve stopped on an error")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
