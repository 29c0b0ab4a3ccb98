"""The server never imports torch, aserve.model or aserve.runner (directly or through what it imports)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import aserve.server

SERVER_DIR = Path(aserve.server.__file__).parent
FORBIDDEN = ("torch", "aserve.model", "aserve.runner", "aserve.kernels", "triton")


def _module_level_imports(path: Path) -> list[str]:
    names = []
    for node in ast.parse(path.read_text()).body:  # module level only: function-local imports are lazy
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


def test_server_modules_do_not_import_torch_model_or_runner():
    files = sorted(SERVER_DIR.glob("*.py"))
    assert len(files) >= 10
    for path in files:
        for name in _module_level_imports(path):
            assert not any(name == f or name.startswith(f + ".") for f in FORBIDDEN), (
                f"{path.name} imports {name}"
            )


def test_importing_the_server_loads_no_torch():
    code = (
        "import sys; import aserve.server.cli, aserve.server.launch, aserve.server.app; "
        "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'triton') or "
        "m.startswith(('aserve.model', 'aserve.runner'))]; print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
