"""Issue 25's rule: every argument name in the seeds is implemented (a named test exists) or refused at
start-up naming the flag and the reason; none is unknown. The list is data: tests/config/seed_arguments.py."""

from __future__ import annotations

import ast
import glob
import logging
import os
import re

import pytest

from aserve.config import ConfigError, EngineArgs
from aserve.config.vllm_compat import COMPAT_ARGS
from aserve.server.args import make_parser, parse_args
from tests.config.seed_arguments import CONFIG_CLASS_FIELDS, NOT_ARGUMENTS, SEED_ARGUMENTS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEEDS = sorted(glob.glob(os.path.join(ROOT, "..", "shared", "seeds", "00[0-4]_*.txt")))
_SERVER_ONLY = {"allow_credentials", "allowed_headers", "allowed_methods", "allowed_origins", "api_key",
                "chat_template", "disable_log_requests", "host", "max_log_len", "port", "response_role",
                "root_path", "ssl_ca_certs", "ssl_cert_reqs", "ssl_certfile", "ssl_keyfile", "uvicorn_log_level",
                "enable_reasoning", "reasoning_parser", "help", "no_enable_prefix_caching", "lora_modules", "middleware",
                *(n for n, a in COMPAT_ARGS.items() if a.server)}


def seed_names() -> dict[str, set[str]]:
    """name (underscores) -> the seed files (000..004) it appears in."""
    names: dict[str, set[str]] = {}
    for path in SEEDS:
        text, tag = open(path, encoding="utf-8").read().replace("\\_", "_"), os.path.basename(path)[:3]
        found = re.findall(r"(?:(?<![\w-])--|–)([a-z][a-z0-9_-]*)", text)
        found += re.findall(r"\*\*\d+\. `([a-z_]+)`", text)  # seed 003's LLM() list
        found += re.findall(r"^([a-z][a-z_]+)\t", text, re.M)  # seed 002's keyword tables
        found += [m.strip().replace(" ", "_")
                  for m in re.findall(r"^[-\s]*\d+\.\s*[<*\s]*([a-z][a-z_ ]+?)\s*[>*:]", text, re.M)]
        for name in found:
            names.setdefault(name.replace("-", "_"), set()).add(tag)
    return names


_REFUSED_FIELD_VALUES = {
    "cpu_offload_gb": (1.0, ["--cpu-offload-gb", "1"]),
    "long_lora_scaling_factors": ([4.0], ["--long-lora-scaling-factors", "4"]),
    "qlora_adapter_name_or_path": ("x", ["--qlora-adapter-name-or-path", "x"]),
}


def _key(name: str) -> str:
    return "--" + name.replace("_", "-")


def _bad_value(name: str):
    """A value that would change behaviour, as (python value, CLI argv)."""
    arg = COMPAT_ARGS[name]
    flag = _key(name)
    if arg.type in ("bool", "bool_opt"):
        value = not arg.default if arg.default is not None else True
        return value, [flag if value else "--no-" + flag[2:]]
    return {"int": (7, [flag, "7"]), "float": (0.5, [flag, "0.5"]), "str": ("x.y", [flag, "x.y"]),
            "json": ({"a": 1}, [flag, '{"a": 1}']), "list": (["x"], [flag, "x"])}[arg.type]


@pytest.mark.skipif(not SEEDS, reason="the seeds (../shared/seeds) are not in this checkout")
def test_every_seed_name_is_listed_with_its_seed_files():
    names = seed_names()
    assert len(names) > 100
    for name, tags in names.items():
        if name in NOT_ARGUMENTS or name in CONFIG_CLASS_FIELDS:
            continue
        assert _key(name) in SEED_ARGUMENTS, f"{_key(name)} (seeds {sorted(tags)}) is not in seed_arguments.py"
        assert set(SEED_ARGUMENTS[_key(name)]["seeds"].split()) == tags, _key(name)
    for field, flag_field in CONFIG_CLASS_FIELDS.items():
        assert flag_field is None or _key(flag_field) in SEED_ARGUMENTS or flag_field in EngineArgs.field_names()


@pytest.mark.parametrize("flag", sorted(SEED_ARGUMENTS))
def test_every_listed_name_is_known_and_implemented_or_refused(flag, caplog):
    entry, name = SEED_ARGUMENTS[flag], flag[2:].replace("-", "_")
    status = entry["status"]
    assert status in ("implemented", "alias", "noop", "refused") or re.fullmatch(r"owned by issue \d+", status)
    if name in COMPAT_ARGS and name not in _SERVER_ONLY:
        EngineArgs.from_kwargs(**{name: COMPAT_ARGS[name].default})  # the default value is accepted silently
    elif name not in _SERVER_ONLY:
        assert name in EngineArgs.field_names(), f"{flag}: not an engine argument"
    assert flag in make_parser()._option_string_actions, f"{flag}: unrecognized by the CLI"
    if status == "implemented":
        path, _, func = entry["test"].partition("::")
        tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
        funcs = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        assert func in funcs, f"{flag}: {entry['test']} does not exist"
        return
    if status in ("alias", "noop"):
        value, argv = _bad_value(name)
        with caplog.at_level(logging.WARNING, logger="aserve.config"):
            if name in _SERVER_ONLY:
                parse_args(argv)
            else:
                try:
                    EngineArgs.from_kwargs(**{name: value})
                except ConfigError as exc:  # an alias of a refused value (--worker-use-ray -> ray)
                    assert "ray" in str(exc)
        assert any(flag in r.getMessage() and "deprecated" in r.getMessage() for r in caplog.records), flag
        return
    # refused / owned: a CLI error and a ConfigError, both naming the flag and the reason
    if name in _REFUSED_FIELD_VALUES:  # EngineArgs fields whose value validate() refuses
        value, argv = _REFUSED_FIELD_VALUES[name]
    else:
        value, argv = _bad_value(name)
    with pytest.raises(SystemExit) as exited:
        engine_args, _ = parse_args(argv)
        try:
            engine_args.validate()  # an EngineArgs field refused by validate() (e.g. --cpu-offload-gb)
        except ConfigError as exc:
            assert flag in str(exc)
            raise SystemExit(2) from exc
        raise SystemExit(0)
    if exited.value.code == 0:
        pytest.fail(f"{flag} {argv[1:]} was accepted")
    if name not in _SERVER_ONLY:
        with pytest.raises(ConfigError, match=re.escape(flag)) as err:
            EngineArgs.from_kwargs(model="", **{name: value}).validate()
        assert entry["message"] in str(err.value), (flag, str(err.value))


def test_cli_refusal_names_the_flag_and_the_reason(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--image-input-type", "pixel_values"])
    err = capsys.readouterr().err
    assert "unrecognized" not in err and "--image-input-type: aserve serves text-only models" in err


def test_refused_flags_accept_their_default_values_silently(caplog):
    with caplog.at_level(logging.WARNING, logger="aserve.config"):
        parse_args(["--max-num-partial-prefills", "1", "--num-scheduler-steps", "1", "--scheduler-delay-factor",
                    "0", "--task", "generate", "--runner", "generate", "--config-format", "hf", "--max-loras", "1"])
    assert not caplog.records


def test_deprecated_aliases_set_their_replacement(caplog):
    with caplog.at_level(logging.WARNING, logger="aserve.config"):
        engine, server = parse_args(["--max-context-len-to-capture", "100", "--forced-num-gpu-blocks", "9",
                                     "--use-v2-block-manager", "--enable-log-requests"])
    assert engine.max_seq_len_to_capture == 100 and engine.num_gpu_blocks_override == 9
    assert not server.disable_log_requests
    assert sum("deprecated" in r.getMessage() for r in caplog.records) == 3
    assert EngineArgs.from_kwargs(max_context_len_to_capture=64).max_seq_len_to_capture == 64
    assert EngineArgs.from_kwargs(worker_use_ray=True).distributed_executor_backend == "ray"
    with pytest.raises(SystemExit):
        parse_args(["--enable-log-requests", "--disable-log-requests"])
    with pytest.raises(ConfigError, match="--max-context-len-to-capture: contradicts"):
        EngineArgs.from_kwargs(max_context_len_to_capture=64, max_seq_len_to_capture=32)


def test_server_only_names_stay_unknown_to_the_engine():
    with pytest.raises(ConfigError, match="unknown engine argument"):
        EngineArgs.from_kwargs(middleware=["a.b"])


def test_use_tqdm_on_load_is_accepted_both_ways(caplog):
    """aserve's loader shows no progress bar: --no-use-tqdm-on-load is what it does, the default is accepted."""
    with caplog.at_level(logging.WARNING, logger="aserve.config"):
        parse_args(["--no-use-tqdm-on-load"])
        parse_args(["--use-tqdm-on-load"])
        EngineArgs.from_kwargs(use_tqdm_on_load=False).validate()
    assert not caplog.records
