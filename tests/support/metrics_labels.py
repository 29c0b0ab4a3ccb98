"""Prometheus samples as single-engine tests read them: the `engine="0"` label (every engine series
carries vLLM's `engine` label, "0" with one replica) left out of the label set."""

from __future__ import annotations


def without_engine_zero(labels: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in labels.items() if not (k == "engine" and v == "0")}
