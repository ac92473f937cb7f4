"""Tool definitions, the tool choice and tool calls, as the agent protocol carries them."""

from __future__ import annotations

import hashlib
import json
import secrets
import string
from dataclasses import dataclass, field
from enum import StrEnum

MAX_TOOLS = 128  # OpenAI's limit on tools per request


@dataclass(frozen=True)
class Tool:
    """One function the model may call; ``parameters`` is its arguments' JSON schema."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool = False

    def to_openai(self) -> dict:
        """The definition as chat templates expect it (OpenAI's shape)."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}


class ChoiceMode(StrEnum):
    NONE = "none"  # no call: the tools are not offered
    AUTO = "auto"  # text, or calls once the model starts one
    REQUIRED = "required"  # one or more calls, from the first token
    FUNCTION = "function"  # calls of the named function only, from the first token


@dataclass(frozen=True)
class ToolChoice:
    mode: ChoiceMode = ChoiceMode.AUTO
    name: str | None = None  # the function of ChoiceMode.FUNCTION

    def callable_tools(self, tools: tuple[Tool, ...]) -> tuple[Tool, ...]:
        if self.mode is ChoiceMode.FUNCTION:
            return tuple(t for t in tools if t.name == self.name)
        return tools if self.mode is not ChoiceMode.NONE else ()


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments object as JSON text (OpenAI's shape)
    complete: bool = True  # False: the answer was cut (token limit, cancel) while writing it

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def call_id(style: str = "openai", seed: str | None = None, index: int = 0) -> str:
    """A call id: OpenAI's ``call_`` + 24 characters, or Mistral's nine alphanumerics (its templates
    refuse any other shape).  Fresh and random, or with ``seed`` the same for the same (seed, index):
    the daemon records a turn's calls with the ids the API answered with."""
    if seed is None:
        if style == "mistral":
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return "call_" + secrets.token_hex(12)
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    if style == "mistral":
        alphabet = string.ascii_letters + string.digits
        return "".join(alphabet[b % len(alphabet)] for b in digest[:9])
    return "call_" + digest[:12].hex()


def arguments_object(arguments: str | dict | None) -> dict | str:
    """A call's arguments as templates want them: the JSON object parsed (templates write it with
    ``tojson``), or the text itself when it is not a JSON object."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError:
        return arguments or ""
    return value if isinstance(value, dict) else (arguments or "")
