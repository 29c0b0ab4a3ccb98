"""Tool calling and reasoning for chat: what a request's `tools` / `tool_choice` and the server's
`--tool-call-parser` / `--reasoning-parser` turn into, and the per-choice text pipeline.

`ChatOutputPlan.from_request` decides once per request: the grammar that enforces `tool_choice`
("required" or a named function; `parallel_tool_calls: false` allows one call), which tool parser
reads each choice (the constrained parser, the server's parser under "auto", none otherwise) and
which reasoning parser splits off `reasoning_content`. `ChoiceOutput` is one choice's pipeline:
reasoning first, then tool calls from the content that remains, with the same rules for a whole
output (`extract`) and a stream (`feed` / `finish`: OpenAI-shaped delta dicts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aserve.server.errors import bad_request
from aserve.server.reasoning import get_reasoning_parser
from aserve.server.tool_parsers import (
    ToolParser,
    ToolSpecError,
    constrained_tool_parser,
    get_tool_parser,
    named_function,
    tool_call_json_schema,
)
from aserve.structured_outputs.params import GuidedDecodingParams


@dataclass(frozen=True)
class ChatOutputPlan:
    tool_choice: Any  # "none" | "auto" | "required" | {"type": "function", ...}
    tool_parser: str | None  # "constrained" | a --tool-call-parser name | None
    parallel_tool_calls: bool
    reasoning_parser: str | None
    tool_grammar: GuidedDecodingParams | None  # enforces required / named tool_choice

    @classmethod
    def from_request(cls, req: Any, args: Any) -> ChatOutputPlan:
        """Raises APIError(400) naming the field for tools / tool_choice that cannot be served."""
        tools = req.tools or None
        choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
        if isinstance(choice, str) and choice not in ("none", "auto", "required"):
            raise bad_request("must be none, auto, required or {type: function, function: {name}}",
                              param="tool_choice")
        parallel = req.parallel_tool_calls is not False
        try:
            schema = tool_call_json_schema(tools, choice, parallel) if tools or choice != "none" else None
        except ToolSpecError as exc:
            raise bad_request(exc.message, param=exc.param) from None
        parser = None
        if schema is not None:
            parser = "constrained"
        elif choice == "auto" and tools:
            if not (args.enable_auto_tool_choice and args.tool_call_parser):
                raise bad_request('tool_choice "auto" needs the server to run with --enable-auto-tool-choice '
                                  "and --tool-call-parser", param="tool_choice")
            parser = args.tool_call_parser
        grammar = GuidedDecodingParams(json=schema, disable_any_whitespace=True) if schema is not None else None
        reasoning = args.reasoning_parser if args.enable_reasoning else None
        return cls(choice, parser, parallel, reasoning, grammar)

    def reasoning_end_marker(self) -> str | None:
        return get_reasoning_parser(self.reasoning_parser).end_tag if self.reasoning_parser else None

    def grammar_waits_for_reasoning(self, prompt: str) -> bool:
        """Whether the output starts inside a reasoning block (so a grammar starts after its end)."""
        if not self.reasoning_parser:
            return False
        parser = get_reasoning_parser(self.reasoning_parser).for_prompt(prompt)
        return parser._starts_in_reasoning and not parser._reasoning_closed  # noqa: SLF001

    def new_choice(self, prompt: str) -> ChoiceOutput:
        tools: ToolParser | None = None
        if self.tool_parser == "constrained":
            tools = constrained_tool_parser(self.tool_choice)
        elif self.tool_parser is not None:
            tools = get_tool_parser(self.tool_parser)()
        reasoning = get_reasoning_parser(self.reasoning_parser).for_prompt(prompt) if self.reasoning_parser else None
        return ChoiceOutput(tools, reasoning, self.parallel_tool_calls, named_function(self.tool_choice) is not None)


class ChoiceOutput:
    """One choice's text -> reasoning_content, content and tool calls (OpenAI shapes)."""

    def __init__(self, tools: ToolParser | None, reasoning: Any, parallel: bool, named: bool):
        self._tools = tools
        self._reasoning = reasoning
        self._parallel = parallel
        self._named = named
        self.num_calls = 0

    @property
    def active(self) -> bool:
        return self._tools is not None or self._reasoning is not None

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model called tools (a named tool_choice keeps "stop")."""
        if reason == "stop" and self.num_calls and not self._named:
            return "tool_calls"
        return reason

    def extract(self, text: str) -> tuple[str | None, str | None, list[dict[str, Any]]]:
        """(reasoning_content, content, tool_calls) of a complete output."""
        reasoning, content = None, text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.extract(text)
        calls: list[dict[str, Any]] = []
        if self._tools is not None:
            content, found = self._tools.extract(content or "")
            if not self._parallel:
                found = found[:1]
            calls = [c.to_openai() for c in found]
        self.num_calls = len(calls)
        return reasoning, content, calls

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Deltas (dicts of DeltaMessage fields) for the next piece of text."""
        return self._run(text, final=False)

    def finish(self) -> list[dict[str, Any]]:
        return self._run("", final=True)

    def _run(self, text: str, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        content = text
        if self._reasoning is not None:
            reasoning, content = self._reasoning.finish() if final and not text else self._reasoning.feed(text)
            if final and text:
                more_r, more_c = self._reasoning.finish()
                reasoning = (reasoning or "") + (more_r or "") or None
                content = (content or "") + (more_c or "") or None
            if reasoning:
                out.append({"reasoning_content": reasoning})
            content = content or ""
        if self._tools is None:
            if content:
                out.append({"content": content})
            return out
        deltas = self._tools.feed(content) if content else []
        if final:
            deltas += self._tools.finish()
        for d in deltas:
            if d.content:
                out.append({"content": d.content})
            calls = [tc for tc in d.tool_calls if self._parallel or tc.index == 0]
            if calls:
                self.num_calls = max(self.num_calls, max(tc.index for tc in calls) + 1)
                out.append({"tool_calls": [tc.to_openai() for tc in calls]})
        return out
