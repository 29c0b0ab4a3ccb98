"""The layering rules of design.md, checked by walking every import (module- and function-level), and
the torch-free server checked for real: importing it in a fresh interpreter loads no torch."""

from __future__ import annotations

import ast
import subprocess
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
    "distributed": ["aserve.core", "aserve.engine", "aserve.server", "aserve.runner", "aserve.executor",
                    "aserve.model", "aserve.kernels"],
    # what the executor (in the engine's process) imports from it: no torch
    "distributed/rendezvous.py": ["torch", "aserve.config", "aserve.core", "aserve.model", "aserve.runner"],
    "distributed/__init__.py": ["torch"],
    "lora": ["torch", "aserve.core", "aserve.engine", "aserve.server", "aserve.model", "aserve.runner",
             "aserve.executor"],
    "engine": ["torch", "starlette", "aserve.server", "aserve.model.", "aserve.runner"],
    "server": ["torch", "triton", "aserve.core", "aserve.model.", "aserve.runner", "aserve.kernels", "aserve.executor"],
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
    files = _files(key)
    assert files and all(f.is_file() for f in files), f"{key}: nothing to check (moved?)"
    bad = []
    for f in files:
        for name in _imports(f):
            for prefix in FORBIDDEN[key]:
                # "aserve.model." forbids aserve.model and its submodules, not aserve.model_source
                package = prefix.rstrip(".")
                if name == package or name.startswith(package + "."):
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


def test_importing_the_server_loads_no_torch():
    """What the server imports, transitively (a lazy import inside a function is not loaded here)."""
    code = (
        "import sys; import aserve.server.cli, aserve.server.launch, aserve.server.app; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'triton') or "
        "m.startswith(('aserve.model', 'aserve.runner', 'aserve.kernels'))]; print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
