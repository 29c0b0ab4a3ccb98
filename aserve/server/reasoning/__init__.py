"""Reasoning parsers: split a model's output into `reasoning_content` and `content`.

`get_reasoning_parser(name)` gives the parser class for a `--reasoning-parser` name (vLLM's
names); make one instance per choice (or `cls.for_prompt(prompt)` to follow the rendered prompt).
Each offers `extract(text) -> (reasoning | None, content | None)` and a stream interface
`feed(delta) -> (reasoning_delta | None, content_delta | None)` / `finish()`; see `think.py`.
`reasoning_end_marker(name)` is the text after which content (and any grammar) starts.
Nothing here imports torch.
"""

from __future__ import annotations

from types import MappingProxyType

from aserve.server.reasoning.think import ThinkParser


class DeepSeekR1ReasoningParser(ThinkParser):
    """DeepSeek-R1 and its distills: `<think>` optional, since the template opens the block."""

    name = "deepseek_r1"
    starts_in_reasoning_default = True


class Qwen3ReasoningParser(ThinkParser):
    """Qwen3: reasoning only inside an explicit `<think>...</think>` (or a prompt that opened it)."""

    name = "qwen3"
    starts_in_reasoning_default = False


REASONING_PARSERS = MappingProxyType(
    {cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}
)
"""`--reasoning-parser` name -> parser class (read-only)."""


def get_reasoning_parser(name: str) -> type[ThinkParser]:
    """The parser class registered as `name`; ValueError listing the known names otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(REASONING_PARSERS))}"
        ) from None


def reasoning_end_marker(name: str) -> str:
    """The text that ends reasoning for parser `name` (a grammar applies only after it)."""
    return get_reasoning_parser(name).end_tag


__all__ = [
    "REASONING_PARSERS",
    "DeepSeekR1ReasoningParser",
    "Qwen3ReasoningParser",
    "ThinkParser",
    "get_reasoning_parser",
    "reasoning_end_marker",
]
