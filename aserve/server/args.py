"""`aserve` command-line arguments: engine flags generated from `EngineArgs`, plus server flags.

Engine flags are generated from the `EngineArgs` dataclass fields (vLLM spellings: `max_model_len`
-> `--max-model-len`), so they never drift from the engine's arguments. Booleans that default to
True get a `--no-...` form; dict-valued fields take JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import types
import typing
from dataclasses import dataclass
from typing import Any

from aserve.config import EngineArgs
from aserve.server.lora_modules import LoRAModule, parse_lora_modules
from aserve.server.user_middleware import load_middleware
from aserve.config.vllm_compat import add_compat_arguments, apply_compat
from aserve.server.chat_template import CONTENT_FORMATS
from aserve.server.engine_help import ENGINE_DEFAULTS, ENGINE_HELP
from aserve.server.help_groups import HelpAction, regroup
from aserve.server.server_flags import (
    REASONING_PARSER_NAMES,
    TOOL_PARSER_NAMES,
    add_server_arguments,
    add_tool_and_reasoning_arguments,
)

_SHORT_ALIASES = {"tensor_parallel_size": "-tp", "pipeline_parallel_size": "-pp", "data_parallel_size": "-dp",
                  "compilation_config": "-O", "quantization": "-q"}


@dataclass(frozen=True)
class ServerArgs:
    """Everything the HTTP side needs; engine arguments live in `EngineArgs`."""

    host: str | None = None  # None: all interfaces
    port: int = 8000
    api_key: str | tuple[str, ...] | None = None  # several keys: the batch is shared fairly between them
    chat_template: str | None = None
    chat_template_content_format: str = "auto"  # auto = string (text parts joined); openai = a list of parts
    response_role: str = "assistant"
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE; 1 = CERT_OPTIONAL, 2 = CERT_REQUIRED (client certificates)
    uvicorn_log_level: str = "info"
    log_level: str = "info"
    disable_log_requests: bool = False
    max_log_len: int | None = None
    disable_log_stats: bool = False
    stats_log_interval: float = 5.0
    shutdown_grace_period: float = 30.0
    max_num_queued_reqs: int = 0  # 0: unbounded
    max_num_queued_tokens: int = 0  # 0: unbounded
    max_request_body_bytes: int = 32 * 1024 * 1024  # 0: unbounded
    request_timeout: float | None = None  # seconds; None: no timeout
    metrics_prefix: str = "vllm"  # the prefix of every Prometheus name: vllm or aserve
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens in replies

    lora_modules: tuple[LoRAModule, ...] = ()  # adapters loaded before serving (aserve/server/lora.py)
    middleware: tuple[str, ...] = ()  # ASGI middleware by dotted path, in order (aserve/server/user_middleware.py)

    # tool calling and reasoning (issue 12)
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    enable_reasoning: bool = False
    reasoning_parser: str | None = None

    @property
    def api_keys(self) -> tuple[str, ...]:
        """Every accepted API key (empty: no key needed)."""
        if not self.api_key:
            return ()
        return (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key)


_SERVER_DEFAULTS = {
    "api_key": "None: $ASERVE_API_KEY or $VLLM_API_KEY, else no key needed",
    "chat_template": "None: the tokenizer's",
    "max_log_len": "None: no limit",
    "ssl_keyfile": "None: plain HTTP",
    "ssl_certfile": "None: plain HTTP",
    "model_tag": "None: --model",
}


def _json_object(flag: str):
    def parse(text: str) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{flag}: not valid JSON ({exc})") from None
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{flag}: expected a JSON object, got {type(value).__name__}")
        return value

    parse.__name__ = "JSON object"
    return parse


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]), True
    return tp, False


_JSON_TEXT_FIELDS = ("speculative_config", "model_loader_extra_config")  # dict | str: a JSON object on the CLI


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per `EngineArgs` field, typed from the field's annotation."""
    group = parser.add_argument_group("engine arguments (aserve.config.EngineArgs)")
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        names = [flag] + ([_SHORT_ALIASES[f.name]] if f.name in _SHORT_ALIASES else [])
        default = f.default
        help_text = ENGINE_HELP[f.name]  # a KeyError: describe the new field in ENGINE_HELP
        help_text += f" (default: {ENGINE_DEFAULTS.get(f.name, repr(default))})"
        tp, optional = _unwrap_optional(hints[f.name])
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": help_text}
        if f.name == "compilation_config":
            kwargs["type"] = str  # a level or a JSON object; EngineArgs.validate parses it
        elif tp is bool:
            if default is True or (optional and default is None):
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["action"] = "store_true"
        elif typing.get_origin(tp) is dict or f.name in _JSON_TEXT_FIELDS:
            kwargs["type"] = _json_object(flag)
        elif typing.get_origin(tp) is list:  # list[float]: one or more numbers
            kwargs["nargs"], kwargs["type"] = "+", typing.get_args(tp)[0]
        elif typing.get_args(tp) and list in {typing.get_origin(a) for a in typing.get_args(tp)}:
            kwargs["nargs"] = "+"  # str | list[str]: one or more names
        elif tp in (int, float, str):
            kwargs["type"] = tp
        else:
            raise TypeError(f"EngineArgs.{f.name}: no command-line mapping for type {hints[f.name]!r}")
        group.add_argument(*names, **kwargs)


def make_parser(serve_command: bool = False) -> argparse.ArgumentParser:
    """The `aserve [flags]` parser; `serve_command`: vLLM's `aserve serve [MODEL] [flags]` form, whose
    optional positional MODEL is the same as --model."""
    from aserve import __version__

    parser = argparse.ArgumentParser(
        prog="aserve serve" if serve_command else "aserve",
        usage="%(prog)s " + ("[MODEL] " if serve_command else "") + "[flags]   (aserve --help=listgroup: the flag "
              "groups; aserve --help=<group>: one group)",
        description="OpenAI-compatible LLM server (aserve). `aserve serve [MODEL] [flags]` (vLLM's form) "
        "and `aserve [flags]` are the same command. The flags are grouped as vLLM groups them: "
        "--help=<group> shows one group, --help=listgroup lists the groups.",
        add_help=False,
    )
    parser.add_argument("-h", "--help", action=HelpAction)
    parser.add_argument("--version", action="version", version=f"aserve {__version__}",
                        help="show the version and exit")
    if serve_command:
        parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                            help="the model to serve, as --model (vLLM's `serve MODEL` form)")
    add_engine_arguments(parser)
    add_server_arguments(parser)
    add_tool_and_reasoning_arguments(parser)
    add_compat_arguments(parser)  # vLLM names aserve aliases or refuses (aserve/config/vllm_compat.py)
    regroup(parser)  # each flag into its topic's group, as vLLM's --help (aserve/server/help_groups.py)
    for action in parser._actions:  # every flag's help ends with its default, once
        if action.dest not in ("help", "version") and "(default:" not in (action.help or ""):
            action.help = f"{action.help} (default: {_SERVER_DEFAULTS.get(action.dest, repr(action.default))})"
    return parser


def split_namespace(
    ns: argparse.Namespace, environ: typing.Mapping[str, str] | None = None
) -> tuple[EngineArgs, ServerArgs]:
    """Split parsed flags into `EngineArgs` and `ServerArgs` (the API key may come from the environment)."""
    environ = os.environ if environ is None else environ
    values = apply_compat(dict(vars(ns)), server=True)  # aliases set their targets; refusals raise
    model_tag = values.pop("model_tag", None)
    if model_tag is not None:  # `aserve serve MODEL`
        if values.get("model") not in ("", model_tag):
            raise ValueError(f"the model is given twice: {model_tag!r} (after `serve`) and --model "
                             f"{values['model']!r}; give one")
        values["model"] = model_tag
    engine_names = EngineArgs.field_names()
    engine_args = EngineArgs(**{k: v for k, v in values.items() if k in engine_names})
    if isinstance(engine_args.served_model_name, list) and len(engine_args.served_model_name) == 1:
        engine_args.served_model_name = engine_args.served_model_name[0]
    server_names = {f.name for f in dataclasses.fields(ServerArgs)}
    server_values = {k: v for k, v in values.items() if k in server_names}
    server_values["disable_log_stats"] = engine_args.disable_log_stats
    keys = server_values.get("api_key")
    if isinstance(keys, list):  # --api-key given once or more (action="append")
        server_values["api_key"] = keys[0] if len(keys) == 1 else tuple(keys)
    if not server_values.get("api_key"):
        server_values["api_key"] = environ.get("ASERVE_API_KEY") or environ.get("VLLM_API_KEY") or None
    for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
        server_values[name] = tuple(server_values[name])
    server_values["middleware"] = tuple(server_values.get("middleware") or ())
    server_values["lora_modules"] = parse_lora_modules(server_values.get("lora_modules"))
    if server_values["lora_modules"] and not engine_args.enable_lora:
        raise ValueError("--lora-modules: needs --enable-lora")
    parser = (engine_args.structured_outputs_config or {}).get("reasoning_parser")
    if parser is not None:  # vLLM's newer home of --reasoning-parser: the same setting
        given = server_values.get("reasoning_parser")
        if parser not in REASONING_PARSER_NAMES:
            raise ValueError(f"--structured-outputs-config: reasoning_parser must be one of "
                             f"{REASONING_PARSER_NAMES}, got {parser!r}")
        if given is not None and given != parser:
            raise ValueError(f"--structured-outputs-config: reasoning_parser {parser!r} contradicts "
                             f"--reasoning-parser {given!r}")
        server_values["reasoning_parser"] = parser
    if server_values.get("reasoning_parser"):
        server_values["enable_reasoning"] = True  # vLLM: --reasoning-parser implies it
    server_args = ServerArgs(**server_values)
    validate_server_args(server_args)
    return engine_args, server_args


def validate_server_args(args: ServerArgs) -> None:
    """Raise ValueError naming the flag for a bad combination."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port: must be in [0, 65535], got {args.port}")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len: must be >= 0, got {args.max_log_len}")
    for name in ("max_num_queued_reqs", "max_num_queued_tokens", "max_request_body_bytes"):
        value = getattr(args, name)
        if value < 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 0 (0 = unbounded), got {value}")
    if args.request_timeout is not None and not args.request_timeout > 0:
        raise ValueError(f"--request-timeout: must be > 0 seconds, got {args.request_timeout}")
    if any(not key for key in args.api_keys):
        raise ValueError("--api-key: must not be empty")
    if args.shutdown_grace_period < 0:
        raise ValueError(f"--shutdown-grace-period: must be >= 0, got {args.shutdown_grace_period}")
    if args.stats_log_interval <= 0:
        raise ValueError(f"--stats-log-interval: must be > 0, got {args.stats_log_interval}")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile must be given together")
    if args.ssl_ca_certs and not args.ssl_certfile:
        raise ValueError("--ssl-ca-certs needs --ssl-keyfile and --ssl-certfile")
    if args.ssl_cert_reqs not in (0, 1, 2):
        raise ValueError(f"--ssl-cert-reqs: must be 0, 1 or 2, got {args.ssl_cert_reqs}")
    if args.ssl_ca_certs and args.ssl_cert_reqs == 0:
        raise ValueError(
            "--ssl-ca-certs is only used to verify client certificates, which --ssl-cert-reqs 0 (the "
            "default) never requests: add --ssl-cert-reqs 1 (optional) or 2 (required)"
        )
    if args.ssl_cert_reqs and not args.ssl_ca_certs:
        raise ValueError(
            f"--ssl-cert-reqs {args.ssl_cert_reqs} needs --ssl-ca-certs to verify client certificates against"
        )
    if args.root_path and (not args.root_path.startswith("/") or args.root_path.endswith("/")):
        raise ValueError(f"--root-path: must start with '/' and not end with '/', got {args.root_path!r}")
    if args.chat_template_content_format not in CONTENT_FORMATS:
        raise ValueError(f"--chat-template-content-format: must be one of {CONTENT_FORMATS}, "
                         f"got {args.chat_template_content_format!r}")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json or mistral)")
    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_PARSER_NAMES:
        raise ValueError(f"--tool-call-parser: must be one of {TOOL_PARSER_NAMES}, got {args.tool_call_parser!r}")
    if args.enable_reasoning and not args.reasoning_parser:
        raise ValueError("--enable-reasoning needs --reasoning-parser (deepseek_r1 or qwen3)")
    if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSER_NAMES:
        raise ValueError(f"--reasoning-parser: must be one of {REASONING_PARSER_NAMES}, got {args.reasoning_parser!r}")
    load_middleware(args.middleware)  # importable and of a usable kind, before the model loads


def parse_args(
    argv: list[str] | None = None, environ: typing.Mapping[str, str] | None = None
) -> tuple[EngineArgs, ServerArgs]:
    """Parses `aserve [flags]` or vLLM's `aserve serve [MODEL] [flags]` (argv without the program name;
    None: sys.argv[1:]). Exits with status 2 and a usage line for bad flags, 0 after --help / --version."""
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_command = bool(argv) and argv[0] == "serve"
    parser = make_parser(serve_command)
    ns = parser.parse_args(argv[1:] if serve_command else argv)
    try:
        return split_namespace(ns, environ)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
