"""`aserve` / `python -m aserve.server.cli`: parse flags, build the engine, serve until signalled."""

from __future__ import annotations

import importlib
import logging
import sys

from aserve.config import ConfigError
from aserve.server.args import ServerArgs, make_parser, parse_args
from aserve.server.launch import python_log_level, run
from aserve.server.chat_template import load_flag_template

logger = logging.getLogger("aserve.server")


def configure_logging(args: ServerArgs) -> None:
    logging.basicConfig(level=python_log_level(args.log_level),
                        format="%(levelname)s %(asctime)s [%(name)s] %(message)s", datefmt="%m-%d %H:%M:%S")
    logging.getLogger("aserve").setLevel(python_log_level(args.log_level))


def main(argv: list[str] | None = None) -> int:
    """Returns 0 after a graceful shutdown; 2 for bad arguments; 1 if the engine fails."""
    engine_args, server_args = parse_args(argv)
    configure_logging(server_args)
    if server_args.chat_template:
        try:
            load_flag_template(server_args.chat_template)  # fail before loading the model
        except ConfigError as exc:
            make_parser().error(str(exc))

    def build_engine():
        # Imported here: the server package imports no engine internals at module level.
        async_engine = importlib.import_module("aserve.engine.async_engine")
        return async_engine.AsyncEngine.from_engine_args(engine_args)

    try:
        run(build_engine, server_args)
    except ConfigError as exc:
        make_parser().error(str(exc))
    except KeyboardInterrupt:
        return 0
    except BaseException as exc:  # the engine died or could not start
        if isinstance(exc, SystemExit):
            raise
        logger.exception("aserve stopped on an error")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
