"""Parser names as vLLM's --tool-call-parser; the parsing packages stay free of torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import aserve.server.reasoning
import aserve.server.tool_parsers
from aserve.server.tool_parsers import (
    TOOL_PARSERS,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    get_tool_parser,
)

PACKAGES = [Path(aserve.server.tool_parsers.__file__).parent, Path(aserve.server.reasoning.__file__).parent]
FORBIDDEN = ("torch", "triton", "aserve.model", "aserve.runner", "aserve.kernels", "aserve.engine")


def test_names_resolve_to_parsers():
    assert get_tool_parser("hermes") is HermesToolParser
    assert get_tool_parser("llama3_json") is Llama3JsonToolParser
    assert get_tool_parser("mistral") is MistralToolParser
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        get_tool_parser("pythonic")


def test_parsing_modules_import_nothing_heavy_and_stay_small():
    files = sorted(p for package in PACKAGES for p in package.glob("*.py"))
    assert len(files) >= 8
    for path in files:
        source = path.read_text()
        assert source.count("\n") <= 400, f"{path.name} is over 400 lines"
        for node in ast.walk(ast.parse(source)):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not any(name == f or name.startswith(f + ".") for f in FORBIDDEN), (path.name, name)


def test_importing_the_parsers_loads_no_torch():
    code = (
        "import sys, aserve.server.tool_parsers, aserve.server.reasoning; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    root = Path(aserve.server.__file__).parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120, cwd=root
    )
    assert result.returncode == 0, result.stdout + result.stderr
