"""The layering rules of design.md, checked by walking every import (module- and function-level)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "aserve"

# package -> prefixes it must never import
FORBIDDEN = {
    "config": ["torch", "anyio", "aserve.core", "aserve.engine", "aserve.server", "aserve.model",
               "aserve.runner", "aserve.executor"],
    "sampling_params.py": ["torch", "aserve.core", "aserve.engine", "aserve.server", "aserve.runner"],
    "structured_outputs/params.py": ["torch", "xgrammar", "aserve.core", "aserve.engine", "aserve.server",
                                     "aserve.runner", "aserve.model."],
    "outputs.py": ["torch", "aserve.core", "aserve.engine", "aserve.server", "aserve.runner"],
    "core": ["torch", "anyio", "aserve.engine", "aserve.server", "aserve.runner", "aserve.model",
             "aserve.executor", "starlette", "numpy"],
    "model": ["aserve.core", "aserve.engine", "aserve.server", "aserve.runner", "aserve.executor"],
    "runner": ["aserve.core.scheduler", "aserve.core.kv_cache_manager", "aserve.engine", "aserve.server"],
    "executor": ["aserve.server", "aserve.engine"],
    "engine": ["torch", "starlette", "aserve.server", "aserve.model.", "aserve.runner"],
    "server": ["torch", "aserve.model.", "aserve.runner", "aserve.executor"],
}


def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _files(key: str) -> list[Path]:
    target = ROOT / key
    return sorted(target.rglob("*.py")) if target.is_dir() else [target]


@pytest.mark.parametrize("key", list(FORBIDDEN))
def test_layering(key):
    bad = []
    for f in _files(key):
        for name in _imports(f):
            for prefix in FORBIDDEN[key]:
                if name == prefix.rstrip(".") or name.startswith(prefix if prefix.endswith(".") else prefix + "."):
                    bad.append(f"{f.relative_to(ROOT.parent)} imports {name}")
                elif name == prefix:
                    bad.append(f"{f.relative_to(ROOT.parent)} imports {name}")
    assert not bad, "\n".join(bad)


def test_config_imports_only_stdlib_and_msgspec():
    """aserve/config is the bottom layer: the standard library, msgspec and its own modules only."""
    bad = []
    for f in _files("config"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                bad.append(f"{f.name}: relative import (use aserve.config.*)")
        for name in _imports(f):
            top = name.split(".")[0]
            if not (top in sys.stdlib_module_names or top == "msgspec" or name == "aserve.config" or name.startswith("aserve.config.")):
                bad.append(f"{f.name} imports {name}")
    assert _files("config") and not bad, "\n".join(bad)
