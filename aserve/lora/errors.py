"""The error every layer uses for an adapter that cannot be served (plain Python, no torch)."""

from __future__ import annotations


class LoRAAdapterError(ValueError):
    """An adapter cannot be loaded or used: its folder, files, rank, target modules or format. The
    message names the problem; it belongs to that adapter alone (the server answers 400, the engine
    and other requests are unharmed)."""
