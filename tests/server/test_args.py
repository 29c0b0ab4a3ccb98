"""`aserve` flags: engine flags generated from EngineArgs, server flags, environment."""

from __future__ import annotations

import dataclasses

import pytest

from aserve.config import EngineArgs
from aserve.server.args import ServerArgs, make_parser, parse_args


def _flags() -> set[str]:
    return {opt for action in make_parser()._actions for opt in action.option_strings}


def test_every_engine_argument_has_a_flag():
    flags = _flags()
    for f in dataclasses.fields(EngineArgs):
        if f.name != "extra":
            assert "--" + f.name.replace("_", "-") in flags, f.name
    assert {"--no-enable-prefix-caching", "--enable-chunked-prefill", "--no-enable-chunked-prefill"} <= flags
    assert "--no-enforce-eager" not in flags  # False-default booleans are plain switches


def test_defaults_match_engine_args_and_server_args():
    engine_args, server_args = parse_args([], environ={})
    assert engine_args == EngineArgs()
    assert server_args == ServerArgs()


def test_engine_flags_parse_with_vllm_spellings():
    engine_args, _ = parse_args(
        [
            "--model",
            "/m",
            "--max-model-len",
            "512",
            "--block-size",
            "32",
            "--no-enable-prefix-caching",
            "--max-num-seqs",
            "8",
            "--dtype",
            "float32",
            "--kv-cache-dtype",
            "fp8",
            "--num-gpu-blocks-override",
            "100",
            "--distributed-executor-backend",
            "mp",
            "--disable-async-output-proc",
            "--enforce-eager",
            "--hf-overrides",
            '{"num_hidden_layers": 2}',
            "--rope-scaling",
            '{"rope_type": "linear", "factor": 2}',
            "--served-model-name",
            "a",
            "b",
            "--gpu-memory-utilization",
            "0.5",
            "-tp",
            "1",
        ],
        environ={},
    )
    assert engine_args.model == "/m" and engine_args.max_model_len == 512 and engine_args.block_size == 32
    assert engine_args.enable_prefix_caching is False and engine_args.max_num_seqs == 8
    assert (engine_args.dtype, engine_args.kv_cache_dtype) == ("float32", "fp8")
    assert engine_args.num_gpu_blocks_override == 100
    assert engine_args.distributed_executor_backend == "mp"
    assert engine_args.disable_async_output_proc and engine_args.enforce_eager
    assert engine_args.hf_overrides == {"num_hidden_layers": 2}
    assert engine_args.rope_scaling == {"rope_type": "linear", "factor": 2}
    assert engine_args.served_model_name == ["a", "b"]
    assert engine_args.gpu_memory_utilization == 0.5
    one, _ = parse_args(["--served-model-name", "solo"], environ={})
    assert one.served_model_name == "solo"


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--hf-overrides", "{not json"], "--hf-overrides"),
        (["--hf-overrides", "[1]"], "JSON object"),
        (["--allowed-origins", '"*"'], "--allowed-origins"),
        (["--max-model-len", "abc"], "--max-model-len"),
        (["--port", "70000"], "--port"),
        (["--ssl-keyfile", "k.pem"], "--ssl-certfile"),
        (["--root-path", "api/"], "--root-path"),
        (["--shutdown-grace-period", "-1"], "--shutdown-grace-period"),
    ],
)
def test_bad_flags_exit_with_a_message_naming_the_flag(argv, fragment, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(argv, environ={})
    assert info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_server_flags():
    _, s = parse_args(
        [
            "--host",
            "127.0.0.1",
            "--port",
            "9000",
            "--api-key",
            "k",
            "--response-role",
            "bot",
            "--allowed-origins",
            '["http://a"]',
            "--allowed-methods",
            '["GET", "POST"]',
            "--allowed-headers",
            '["x"]',
            "--allow-credentials",
            "--root-path",
            "/api",
            "--uvicorn-log-level",
            "warning",
            "--log-level",
            "debug",
            "--disable-log-requests",
            "--max-log-len",
            "10",
            "--disable-log-stats",
            "--shutdown-grace-period",
            "3",
        ],
        environ={},
    )
    assert (s.host, s.port, s.api_key, s.response_role) == ("127.0.0.1", 9000, "k", "bot")
    assert s.allowed_origins == ("http://a",) and s.allowed_methods == ("GET", "POST")
    assert s.allowed_headers == ("x",) and s.allow_credentials and s.root_path == "/api"
    assert (s.uvicorn_log_level, s.log_level) == ("warning", "debug")
    assert s.disable_log_requests and s.max_log_len == 10 and s.disable_log_stats
    assert s.shutdown_grace_period == 3.0


def test_api_key_from_environment():
    assert parse_args([], environ={"ASERVE_API_KEY": "a", "VLLM_API_KEY": "v"})[1].api_key == "a"
    assert parse_args([], environ={"VLLM_API_KEY": "v"})[1].api_key == "v"
    assert parse_args(["--api-key", "flag"], environ={"VLLM_API_KEY": "v"})[1].api_key == "flag"
    assert parse_args([], environ={})[1].api_key is None


def test_api_key_given_several_times_and_overload_flags():
    _, s = parse_args(["--api-key", "a", "--api-key", "b"], environ={})
    assert s.api_key == ("a", "b") and s.api_keys == ("a", "b")
    assert parse_args(["--api-key", "a"], environ={})[1].api_keys == ("a",)
    _, s = parse_args(["--max-num-queued-reqs", "8", "--max-num-queued-tokens", "4096",
                       "--max-request-body-bytes", "1024", "--request-timeout", "2.5"], environ={})
    assert (s.max_num_queued_reqs, s.max_num_queued_tokens, s.max_request_body_bytes, s.request_timeout) == (
        8, 4096, 1024, 2.5)
    defaults = parse_args([], environ={})[1]
    assert (defaults.max_num_queued_reqs, defaults.max_num_queued_tokens, defaults.request_timeout) == (0, 0, None)
    assert defaults.max_request_body_bytes == 32 * 1024 * 1024


@pytest.mark.parametrize("argv", [["--max-num-queued-reqs", "-1"], ["--max-request-body-bytes", "-5"],
                                  ["--request-timeout", "0"], ["--api-key", "a", "--api-key", ""]])
def test_bad_overload_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv, environ={})
    assert argv[0] in capsys.readouterr().err
