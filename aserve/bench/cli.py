"""`aserve bench {serve,throughput,latency} [flags]`: parse and run one benchmark; returns the exit code.

Only the chosen subcommand's parser is built (`serve` never generates the engine flags or loads torch).
"""

from __future__ import annotations

import argparse
import sys

from aserve.bench import offline, serve

COMMANDS = {
    "serve": ("online: load an OpenAI-compatible server with a seeded workload", serve.add_arguments),
    "throughput": ("offline: aserve.LLM generation throughput", offline.add_throughput_arguments),
    "latency": ("offline: latency of one batch through aserve.LLM", offline.add_latency_arguments),
}
USAGE = "usage: aserve bench {serve,throughput,latency} [-h] [flags]"


def make_parser(command: str) -> argparse.ArgumentParser:
    description, add_arguments = COMMANDS[command]
    parser = argparse.ArgumentParser(prog=f"aserve bench {command}", description=description)
    add_arguments(parser)
    return parser


def main(argv: list[str]) -> int:
    """`argv` without the leading `bench`. Exit codes: 0 ok, 1 a request failed, 2 bad arguments."""
    if not argv or argv[0] not in COMMANDS:
        if argv[:1] in (["-h"], ["--help"]):
            print(USAGE + "\n\n" + "\n".join(f"  {c:<11} {d}" for c, (d, _) in COMMANDS.items()))
            return 0
        print(f"{USAGE}\naserve bench: error: choose a subcommand", file=sys.stderr)
        return 2
    parser = make_parser(argv[0])
    args = parser.parse_args(argv[1:])
    if argv[0] == "serve":
        serve.check_args(parser, args)
        return serve.main(args)
    try:
        (offline.run_throughput if argv[0] == "throughput" else offline.run_latency)(args)
    except ValueError as exc:  # ConfigError, ModelSourceError, a bad dataset: the message names the flag
        parser.error(str(exc))
    return 0
