"""Building aserve's C CPU kernels: the system C compiler (`$CC`, else `cc`) for one `-march`, the
shared library cached in `$ASERVE_CACHE_DIR/kernels` (default `~/.cache/aserve/kernels`) under a key
of the sources, compiler version, flags and CPU, so a changed source, compiler or machine rebuilds.
Concurrent builders each write a private file and rename it into place."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger("aserve.kernels.cpu_ops")
DISABLE_ENV = "ASERVE_CPU_KERNELS"  # "0": never build or use the C kernels
FORCE_NATIVE_ENV = "ASERVE_FORCE_NATIVE_OPS"  # "1": every op in its pure-torch form (model/layers/custom_op.py)
CACHE_ENV = "ASERVE_CACHE_DIR"
FLAGS = ("-O3", "-fno-trapping-math", "-fopenmp", "-fPIC", "-shared", "-std=gnu11")  # no FP traps: lets selects vectorize


def kernels_disabled() -> bool:
    """Whether the environment switches the C kernels off."""
    return os.environ.get(DISABLE_ENV) == "0" or os.environ.get(FORCE_NATIVE_ENV) == "1"


def c_compiler() -> str:
    """The C compiler the kernels build with: `$CC`, else `cc`."""
    return os.environ.get("CC") or "cc"


def cpu_signature() -> str:
    """This CPU's model name and flags (part of the cache key)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags")
    lines = [line for line in info.splitlines() if line.split(":", 1)[0].strip() in wanted]
    return "\n".join(sorted(set(lines)))


def compile_library(name: str, sources: Sequence[Path], headers: Sequence[Path], march: str) -> ctypes.CDLL:
    """`sources` compiled (or reused from the cache) into one shared library for `-march=<march>` and
    loaded; `headers` only enter the cache key. Raises OSError (no compiler, cannot load) or
    CalledProcessError (the compiler failed)."""
    compiler = c_compiler()
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler {compiler!r} on PATH")
    cache_dir = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "aserve") / "kernels"
    flags = [*FLAGS, f"-march={march}"]
    source = b"".join(path.read_bytes() for path in (*sources, *headers))
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(flags).encode(),
                                     cpu_signature().encode()])).hexdigest()[:20]
    target = cache_dir / f"{name}-{march}-{key}.so"
    if not target.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache_dir)
        os.close(fd)
        try:
            subprocess.run([compiler, *flags, "-o", tmp, *map(str, sources), "-lm"], capture_output=True, text=True,
                           check=True)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))


@functools.cache
def log_once(level: int, message: str) -> None:
    logger.log(level, message)
