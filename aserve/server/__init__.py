"""The OpenAI-compatible HTTP server: `aserve` (cli.py) -> launch.serve (one anyio task group with
hypercorn, the engine loop and the stats logger) -> app.create_app (starlette routes, middleware).

Never imports torch, aserve.model or aserve.runner; it talks to the engine through the
AsyncEngine interface (state.EngineClient).
"""
