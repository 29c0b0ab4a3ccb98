"""`-O` / `--compilation-config`: parsing, validation and per-device resolution."""

from __future__ import annotations

import pytest

from aserve.config import ConfigError, EngineArgs
from aserve.config.compilation import CompilationConfig, parse_compilation_config, resolve_compilation
from aserve.server.args import parse_args


@pytest.mark.parametrize(("value", "want"), [
    (None, {}), (3, {"level": 3}), ("0", {"level": 0}), ("3", {"level": 3}),
    ('{"level": 3, "compile_sizes": [2, 1, 2]}', {"level": 3, "compile_sizes": (1, 2)}), ("{}", {"level": 3}),
    ({"compile_sizes": [4]}, {"level": 3, "compile_sizes": (4,)}),
])
def test_parse_accepts_levels_and_objects(value, want):
    assert parse_compilation_config(value) == want


@pytest.mark.parametrize(("value", "message"), [
    (1, "level must be 0 or 3"), (2, "level must be 0 or 3"), (True, "expected a level"),
    ("{not json", "JSON object"), ('{"level": 3, "cudagraph_capture_sizes": [1]}', "cudagraph_capture_sizes not"),
    ({"compile_sizes": []}, "compile_sizes must"), ({"compile_sizes": [0]}, "compile_sizes must"),
    ({"level": "3"}, "level must be 0 or 3"), ({"backend": "tvm"}, "backend must be one of"),
])
def test_parse_refuses_what_is_not_implemented_naming_the_flag(value, message):
    with pytest.raises(ConfigError, match="--compilation-config") as info:
        parse_compilation_config(value)
    assert message in str(info.value)


def test_resolution_per_device():
    assert resolve_compilation(None, False, "cpu", 16) == CompilationConfig(0, ())  # fast start-up on CPU
    assert resolve_compilation(3, False, "cpu", 16) == CompilationConfig(3, (1,))
    assert resolve_compilation({"compile_sizes": [1, 8]}, False, "cpu", 16) == CompilationConfig(3, (1, 8))
    assert resolve_compilation({"backend": "eager"}, False, "cpu", 16) == CompilationConfig(3, (1,), "eager")
    assert resolve_compilation(None, False, "cuda", 16) == CompilationConfig(3, ())  # CUDA graphs
    assert resolve_compilation(None, True, "cuda", 16) == CompilationConfig(0, ())
    assert resolve_compilation(0, True, "cpu", 16) == CompilationConfig(0, ())
    with pytest.raises(ConfigError, match="--enforce-eager means level 0"):
        resolve_compilation(3, True, "cpu", 16)
    with pytest.raises(ConfigError, match="CPU only"):
        resolve_compilation({"compile_sizes": [1]}, False, "cuda", 16)
    with pytest.raises(ConfigError, match="exceed --max-num-seqs 4"):
        resolve_compilation({"compile_sizes": [8]}, False, "cpu", 4)


def test_engine_args_validate_before_any_model_work():
    with pytest.raises(ConfigError, match="--compilation-config: level must be 0 or 3"):
        EngineArgs(model="/nonexistent", compilation_config=2).validate()


@pytest.mark.parametrize(("argv", "want"), [
    (["-O3"], "3"), (["-O", "0"], "0"),
    (["--compilation-config", '{"level": 3, "compile_sizes": [1, 2]}'], '{"level": 3, "compile_sizes": [1, 2]}'),
])
def test_cli_spellings(argv, want):
    engine_args, _ = parse_args(argv, environ={})
    assert engine_args.compilation_config == want
    engine_args.validate()


def test_cli_refuses_a_bad_level_at_start_up():
    engine_args, _ = parse_args(["-O2"], environ={})
    with pytest.raises(ConfigError, match="level must be 0 or 3"):
        engine_args.validate()
