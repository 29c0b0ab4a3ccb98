"""`--middleware`: the user's ASGI middleware by dotted path, applied in the order given (vLLM's flag).

A class is added as starlette middleware (`cls(app)`: any ASGI middleware class); an `async def
f(request, call_next)` function is wrapped as HTTP middleware (vLLM's `@app.middleware("http")`).
They run inside aserve's own middleware (request-body limits, CORS, draining and the API key), so
they see only requests aserve admitted.
"""

from __future__ import annotations

import importlib
import inspect

from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware


def load_middleware(paths: tuple[str, ...]) -> list[Middleware]:
    """The middleware at `paths`, in order; ValueError naming --middleware and the path otherwise."""
    loaded = []
    for path in paths:
        module_name, _, name = path.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module_name), name) if module_name else None
        except (ImportError, AttributeError) as e:
            raise ValueError(f"--middleware: cannot import {path!r}: {e}") from None
        if inspect.isclass(obj):
            loaded.append(Middleware(obj))
        elif inspect.iscoroutinefunction(obj):
            loaded.append(Middleware(BaseHTTPMiddleware, dispatch=obj))
        else:
            raise ValueError(f"--middleware: {path!r} is neither an ASGI middleware class nor an "
                             "'async def f(request, call_next)' function")
    return loaded
