"""Tool-call formats: how a model family writes calls, detected from its chat template.

Every format is one fixed call syntax - ``open`` (once, before the first call), per call ``before``
``{"name": "NAME", "<args key>": ARGS}`` ``after``, ``sep`` between calls, ``close`` after the last -
so one grammar builder (``weaved.agent.grammar_text``) and one streaming parser
(``weaved.agent.stream``) serve them all:

- ``hermes`` (Hermes 2 Pro, Qwen 2.5 / 3): ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``
  per call, after any text;
- ``llama3`` (Llama 3.1-3.3 JSON tool calling): the whole answer is ``{"name": ..., "parameters": ...}``,
  optionally after ``<|python_tag|>``; one call per answer (the format has no list);
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]`` after any text;
- ``generic`` (a template with no tool branch, e.g. Gemma's or SmolLM2's): the answer is a JSON envelope,
  ``{"tool_calls": [{"name": ..., "arguments": ...}, ...]}`` or ``{"response": "text"}``, and the tool
  definitions go into the system turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from weaved.agent.tools import Tool


@dataclass(frozen=True)
class CallFormat:
    name: str
    trigger: str  # what starts the calls (an empty string: calls may only start the answer)
    open: str  # written once before the first call (begins with the trigger)
    before: str  # before each call's JSON object
    args_key: str  # "arguments" or "parameters"
    after: str  # after each call's JSON object
    sep: str | None  # between calls; None: one call per answer
    close: str  # after the last call
    id_style: str = "openai"
    template_tools: bool = True  # the model's template renders the tool definitions itself

    def head(self) -> str:
        return '{"name": "'

    def mid(self) -> str:
        return f'", "{self.args_key}": '


HERMES = CallFormat("hermes", trigger="<tool_call>", open="", before="<tool_call>\n", args_key="arguments",
                    after="}\n</tool_call>", sep="\n", close="")
LLAMA3 = CallFormat("llama3", trigger="", open="", before="", args_key="parameters", after="}", sep=None, close="")
MISTRAL = CallFormat("mistral", trigger="[TOOL_CALLS]", open="[TOOL_CALLS][", before="", args_key="arguments",
                     after="}", sep=", ", close="]", id_style="mistral")
GENERIC = CallFormat("generic", trigger="", open='{"tool_calls": [', before="", args_key="arguments", after="}",
                     sep=", ", close="]}", template_tools=False)
FORMATS = {f.name: f for f in (HERMES, LLAMA3, MISTRAL, GENERIC)}


def detect(template_source: str | None) -> CallFormat:
    """The call format a chat template's source speaks (generic when it has no tool branch)."""
    src = template_source or ""
    if "tools" not in src:
        return GENERIC
    if "<tool_call>" in src:
        return HERMES
    if "[TOOL_CALLS]" in src:
        return MISTRAL
    if "<|start_header_id|>" in src and ("parameters" in src or "<|python_tag|>" in src):
        return LLAMA3
    return GENERIC


GENERIC_INSTRUCTIONS = (
    "You can call these tools (JSON schema of each one's arguments):\n{tools}\n\n"
    "Answer with one JSON object: either {{\"tool_calls\": [{{\"name\": <tool name>, \"arguments\": <arguments "
    "object>}}, ...]}} to call tools, or {answer}."
)
ENVELOPE_ANSWER = "{\"response\": <your answer as a string>}"
JSON_ANSWER = "your answer itself, as the JSON object its format asks for"


def generic_system_text(tools: tuple[Tool, ...], json_answer: bool = False) -> str:
    """What the generic format adds to the system turn: the tools and the answer's JSON envelope (or,
    ``json_answer``, the answer's own JSON: a response format)."""
    listing = "\n".join(json.dumps({"name": t.name, "description": t.description, "parameters": t.parameters},
                                   ensure_ascii=False) for t in tools)
    return GENERIC_INSTRUCTIONS.format(tools=listing, answer=JSON_ANSWER if json_answer else ENVELOPE_ANSWER)
