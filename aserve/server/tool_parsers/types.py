"""The records tool-call parsers produce: finished calls and OpenAI-shaped stream deltas.

They are plain frozen dataclasses so that this package stays independent of the wire structs in
`aserve.server.protocol`; `to_openai()` gives the exact JSON shape OpenAI uses, ready to be put in a
`ChatResponseMessage.tool_calls` list or a stream `DeltaMessage.tool_calls` list.
"""

from __future__ import annotations

import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any


def openai_tool_call_id() -> str:
    """A fresh id in OpenAI's style: `call_` and 24 random hex digits (unique per call)."""
    return "call_" + uuid.uuid4().hex[:24]


_ALNUM = string.ascii_letters + string.digits


def mistral_tool_call_id() -> str:
    """A fresh id as Mistral's templates require: exactly 9 random ASCII letters and digits."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(frozen=True)
class ToolCall:
    """One complete call: `arguments` is the JSON text of the arguments object, as the model wrote it."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolCallDelta:
    """One piece of a streamed call.

    A call's first delta is its header: `id` and `name` set, `arguments` "". Every later delta of the
    same `index` carries only an `arguments` fragment (`id` and `name` None). Concatenating a call's
    fragments gives its complete `arguments` text.
    """

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    @property
    def is_header(self) -> bool:
        return self.id is not None

    def to_openai(self) -> dict[str, Any]:
        if self.id is not None:
            return {
                "index": self.index,
                "id": self.id,
                "type": "function",
                "function": {"name": self.name, "arguments": self.arguments},
            }
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclass(frozen=True)
class StreamDelta:
    """What one stream chunk's `delta` should carry: either `content` or exactly one tool-call delta."""

    content: str | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()
