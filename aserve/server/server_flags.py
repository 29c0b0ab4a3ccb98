"""The server's own `aserve` flags (host, port, TLS, CORS, logging, chat templates, tools and
reasoning), added to the parser `aserve.server.args.make_parser` builds; what they mean is
`ServerArgs`'s (server/args.py), which also checks their values."""

from __future__ import annotations

import argparse
import json

from aserve.server.chat_template import CONTENT_FORMATS
from aserve.server.reasoning import REASONING_PARSERS
from aserve.server.tool_parsers import TOOL_PARSERS

TOOL_PARSER_NAMES = tuple(sorted(TOOL_PARSERS))
REASONING_PARSER_NAMES = tuple(sorted(REASONING_PARSERS))

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# Defaults shown in --help where the value's repr says less (the server's and vLLM-compat flags).
def _json_str_list(flag: str):
    def parse(text: str) -> tuple[str, ...]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{flag}: not valid JSON ({exc})") from None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"{flag}: expected a JSON list of strings, e.g. '[\"*\"]'")
        return tuple(value)

    parse.__name__ = "JSON list"
    return parse


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server arguments")
    g.add_argument("--host", default=None, help="address to bind (default: all interfaces)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    g.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (also env ASERVE_API_KEY or VLLM_API_KEY); "
        "give it several times to accept several keys, which then share the batch fairly",
    )
    g.add_argument("--middleware", action="append", default=None,
                   help="dotted path of an ASGI middleware class or an 'async def f(request, call_next)' "
                   "function, applied in the order given (repeat the flag for several)")
    g.add_argument(
        "--chat-template",
        default=None,
        help="chat template file or inline jinja template (overrides the tokenizer's)",
    )
    g.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=CONTENT_FORMATS,
        help="how message content reaches the chat template: string (text parts joined with newlines), "
        "openai (a list of {\"type\": \"text\", \"text\": ...} parts, a string content as one part); "
        "auto = string (default: auto)",
    )
    g.add_argument("--response-role", default="assistant", help="role of generated chat messages")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help='LoRA adapters to serve (needs --enable-lora), each name=path or a JSON object '
                   '{"name": ..., "path": ..., "base_model_name": ...}; a request names one as its model')
    g.add_argument(
        "--allowed-origins",
        type=_json_str_list("--allowed-origins"),
        default=("*",),
        help='CORS origins, a JSON list (default: ["*"])',
    )
    g.add_argument(
        "--allowed-methods",
        type=_json_str_list("--allowed-methods"),
        default=("*",),
        help='CORS methods, a JSON list (default: ["*"])',
    )
    g.add_argument(
        "--allowed-headers",
        type=_json_str_list("--allowed-headers"),
        default=("*",),
        help='CORS headers, a JSON list (default: ["*"])',
    )
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--root-path", default="", help="path prefix when served behind a path-based proxy")
    g.add_argument("--ssl-keyfile", default=None, help="TLS private key file")
    g.add_argument("--ssl-certfile", default=None, help="TLS certificate file")
    g.add_argument(
        "--ssl-ca-certs",
        default=None,
        help="CA certificates that client certificates are verified against (needs --ssl-cert-reqs 1 or 2)",
    )
    g.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        choices=(0, 1, 2),
        help="client certificates, as Python's ssl module numbers them: 0 = not requested (CERT_NONE), "
        "1 = verified when sent (CERT_OPTIONAL), 2 = required (CERT_REQUIRED) (default: 0)",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=_LOG_LEVELS,
        help="log level of the HTTP server, which is hypercorn (aserve keeps vLLM's flag name; "
        "'info' and below also turn on hypercorn's access log) (default: info)",
    )
    g.add_argument("--log-level", default="info", choices=_LOG_LEVELS, help="log level of aserve")
    g.add_argument("--disable-log-requests", action="store_true", help="no log line per request")
    g.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="cut logged prompts (characters) and prompt token ids to this length",
    )
    g.add_argument(
        "--stats-log-interval", type=float, default=5.0, help="seconds between stats log lines (default: 5)"
    )
    g.add_argument(
        "--shutdown-grace-period",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGINT/SIGTERM (default: 30)",
    )
    g.add_argument(
        "--max-num-queued-reqs",
        type=int,
        default=0,
        help="answer 429 (with Retry-After) when this many requests are already waiting or running; "
        "a request with n samples counts n (default: 0 = unbounded)",
    )
    g.add_argument(
        "--max-num-queued-tokens",
        type=int,
        default=0,
        help="answer 429 (with Retry-After) when the prompt tokens not yet computed would exceed this "
        "(default: 0 = unbounded)",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=32 * 1024 * 1024,
        help="answer 413 to a larger request body, before reading it all (default: 32 MiB; 0 = unbounded)",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="abort a request still generating after this many seconds: 504 (code 'timeout'), or an SSE "
        "error event once streaming (default: no timeout)",
    )
    g.add_argument("--metrics-prefix", default="vllm", choices=("vllm", "aserve"),
                   help="prefix of every /metrics name: vllm (vLLM's dashboards and alerts work unchanged) or "
                   "aserve (default: vllm)")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens (prompt tokens found in the prefix "
                   "cache) in completions and chat replies")


def add_tool_and_reasoning_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tool calling and reasoning")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='parse tool calls out of the output under tool_choice "auto" (needs --tool-call-parser)')
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_PARSER_NAMES,
                   help="how tool calls are written in the model's output")
    g.add_argument("--enable-reasoning", action="store_true",
                   help="return reasoning as reasoning_content (needs --reasoning-parser)")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSER_NAMES,
                   help="how the model marks its reasoning (implies --enable-reasoning)")
