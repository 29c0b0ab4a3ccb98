"""Hermes-style text for chat templates that do not render tools or tool calls.

SmolLM2's template (and the bundled chatml one) ignore `tools` and an assistant message's
`tool_calls`; prepending the tools block to the system message teaches the model the
`<tool_call>` format that the `hermes` parser reads, and `hermes_tool_calls_text` writes earlier
calls in the history in that same format.
"""

from __future__ import annotations

import json
from typing import Any

from aserve.server.tool_parsers.hermes import END, START


def render_hermes_tools_prompt(tools: list[dict[str, Any]]) -> str:
    """The system-prompt text describing `tools` and the `<tool_call>` reply format.

    Each tool is written as one line of JSON (OpenAI's `{"type": "function", "function": {...}}`
    shape, keys kept in the caller's order) inside `<tools></tools>`. Returns "" for no tools.
    """
    if not tools:
        return ""
    lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        f"{START}{END} XML tags:\n"
        f'{START}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{END}'
    )


def with_tools_system_prompt(
    conversation: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """A copy of `conversation` whose system message carries the tools block.

    The block is appended to an existing leading system message (after a blank line) or becomes a
    new first system message. The input list and its dicts are not modified.
    """
    block = render_hermes_tools_prompt(tools)
    if not block:
        return list(conversation)
    if (
        conversation
        and conversation[0].get("role") == "system"
        and isinstance(conversation[0].get("content"), str)
    ):
        first = dict(conversation[0])
        first["content"] = f"{first['content']}\n\n{block}" if first["content"] else block
        return [first, *conversation[1:]]
    return [{"role": "system", "content": block}, *conversation]


def hermes_tool_calls_text(tool_calls: list[dict[str, Any]]) -> str:
    """An assistant message's OpenAI `tool_calls` as `<tool_call>` blocks, one per call, newline-separated.

    `function.arguments` may be the JSON text (as OpenAI sends it) or an already-decoded object;
    text that is not JSON is kept as a string.
    """
    blocks = []
    for call in tool_calls:
        function = call.get("function") or {}
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass
        body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
        blocks.append(f"{START}\n{body}\n{END}")
    return "\n".join(blocks)
