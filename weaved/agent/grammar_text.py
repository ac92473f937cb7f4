"""The Lark grammar (llguidance's dialect) of one request's answer: tool calls in the model's format,
a JSON schema, optional thinking first.

Markers that are one special token of the vocabulary (``<tool_call>`` in Qwen's, ``[TOOL_CALLS]`` in
Mistral's, ``<think>``) are written as that token (``<[id]>``): the model emits them as single control
tokens, never spelled out.  JSON is written as Python's ``json.dumps`` writes it (``", "`` and ``": "``,
no other whitespace) - the spacing chat templates render past calls with - so the model's calls look
like the history it was shown and a random model cannot pad forever.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from weaved.agent.formats import CallFormat
from weaved.agent.tools import ChoiceMode, Tool

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<think>", "</think>")
TEXT = "TEXT: /(.|\\n)*/"
# What may come between a reasoning block and the answer: templates write "</think>\n\n" and strip the
# newlines from the content they render; bounded, so a random model cannot pad there until max_tokens
THINK_GAP = "/[ \\t\\n]{0,2}/"


@dataclass(frozen=True)
class AnswerShape:
    """What the answer must look like.  ``schema``: the content's JSON schema (response_format), None
    for free text.  ``tools``/``mode``/``parallel``: the calls allowed.  ``thinking``: a reasoning
    block may come first (``reasoning_open``: the answer starts inside one)."""

    fmt: CallFormat
    tools: tuple[Tool, ...] = ()
    mode: ChoiceMode = ChoiceMode.NONE
    parallel: bool = True
    schema: dict | None = None
    thinking: bool = False
    reasoning_open: bool = False  # the prompt opened the reasoning block: the answer starts inside it

    @property
    def constrained(self) -> bool:
        """Tools offered (even with choice ``none``: the answer must then not start a call) or a schema."""
        return self.schema is not None or bool(self.tools)


# Applicators beside ``properties`` that may allow more keys: an object schema with one of them is not
# closed (``additionalProperties`` sees only its own ``properties``, so closing it would refuse the keys
# a branch or a reference adds).
OPEN_APPLICATORS = ("allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "dependentSchemas")


def closed(schema):
    """``schema`` with ``additionalProperties: false`` on every object schema that declares properties
    and says nothing about others (as xgrammar's strict mode does): the output holds the declared
    properties only - still valid under the original schema - and a small model cannot wander off
    into inventing keys.  A schema that allows others says so, and keeps that.  Left open, since
    closing would refuse what the schema allows: an ``allOf`` branch (and a definition one refers to)
    and an ``anyOf``/``oneOf`` branch beside an object's own keys, which the other keys must pass; an
    object beside an applicator (``OPEN_APPLICATORS``); one that requires a key it does not declare.

    The same walk honours OpenAPI's ``nullable: true``, which the grammar engine does not know: such a
    schema becomes ``anyOf`` [itself, ``{"type": "null"}``] (see ``_or_null``)."""
    return _close(schema, _all_of_refs(schema), False)


def _all_of_refs(schema) -> set[str]:
    """The local references (``#/$defs/x``) that some ``allOf`` branch names."""
    found: set[str] = set()

    def walk(x) -> None:
        if isinstance(x, list):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for branch in x.get("allOf") or []:
                if isinstance(branch, dict) and isinstance(branch.get("$ref"), str):
                    found.add(branch["$ref"])
            for y in x.values():
                walk(y)

    walk(schema)
    return found


def _close(schema, keep_open: set[str], branch: bool, path: str = "#"):
    if isinstance(schema, list):
        return [_close(x, keep_open, False, path) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k == "nullable" and isinstance(v, bool):
            continue  # (rewritten below when true; false says nothing)
        if k in ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas"):
            out[k] = ({name: _close(x, keep_open, f"{path}/{k}/{name}" in keep_open, f"{path}/{k}/{name}")
                       for name, x in v.items()} if isinstance(v, dict) else v)
        elif k in ("allOf", "anyOf", "oneOf") and isinstance(v, list):
            # an allOf branch, or a union's beside keys of the object's own, meets the other keys
            beside = k == "allOf" or "properties" in schema or "required" in schema
            out[k] = [_close(x, keep_open, beside, path) for x in v]
        elif k in ("items", "additionalItems", "contains", "not", "if", "then", "else",
                   "prefixItems", "additionalProperties"):
            out[k] = _close(v, keep_open, False, path)
        else:
            out[k] = v
    props = out.get("properties")
    required = out.get("required") if isinstance(out.get("required"), list) else []
    if (isinstance(props, dict) and not branch and "additionalProperties" not in out
            and "patternProperties" not in out and not any(a in out for a in OPEN_APPLICATORS)
            and all(r in props for r in required)):
        out["additionalProperties"] = False
    return _or_null(out) if schema.get("nullable") is True else out


# Keywords that stay where they are when a nullable schema moves into an anyOf branch: local references
# (``#/$defs/x``) name them from the root
ROOT_KEYWORDS = ("$schema", "$id", "$defs", "definitions")


def _or_null(schema: dict) -> dict:
    """``schema`` or null: OpenAPI's ``nullable: true`` as JSON Schema says it."""
    outer = {k: schema[k] for k in ROOT_KEYWORDS if k in schema}
    inner = {k: v for k, v in schema.items() if k not in ROOT_KEYWORDS}
    return {**outer, "anyOf": [inner, {"type": "null"}]}


def json_rule(schema: dict, *, an_object: bool = False) -> str:
    """``%json {...}`` of ``closed(schema)`` in Weave's JSON style (``x-guidance``: a request's own is
    refused before this).  ``an_object``: the value must be an object (a call's arguments) - a schema
    with no ``type`` allows any value, so it gets ``"type": "object"`` beside its other keywords, which
    the engine intersects with them (an ``anyOf`` branch of another type then allows nothing)."""
    s = closed(schema)
    if an_object and "type" not in s:
        s = {"type": "object", **s}
    s["x-guidance"] = dict(JSON_STYLE)
    return "%json " + json.dumps(s, ensure_ascii=False)


class LarkWriter:
    """Writes literals, with the vocabulary's special markers as tokens (``special_id(text)``: the id
    of ``text`` when it is one special token, else None)."""

    def __init__(self, special_id: Callable[[str], int | None]):
        self._special = {m: special_id(m) for m in MARKERS}

    def special(self, marker: str) -> int | None:
        return self._special.get(marker)

    def lit(self, text: str) -> str:
        """``text`` as a sequence of Lark items ('' -> an empty string literal)."""
        parts, rest = [], text
        while rest:
            hits = [(rest.find(m), m) for m, i in self._special.items() if i is not None and m in rest]
            if not hits:
                parts.append(json.dumps(rest))
                break
            at, m = min(hits)
            if at:
                parts.append(json.dumps(rest[:at]))
            parts.append(f"<[{self._special[m]}]>")
            rest = rest[at + len(m):]
        return " ".join(parts) if parts else '""'


def answer_grammar(shape: AnswerShape, w: LarkWriter) -> str:
    """The Lark grammar of ``shape``'s answer (call only when ``shape.constrained``)."""
    rules = [TEXT]
    content = "TEXT" if shape.schema is None else "content"
    if shape.schema is not None:
        rules.append(f"content: {json_rule(shape.schema)}")
    body = _answer_rules(shape, w, content, rules)
    start = body
    if shape.reasoning_open:
        rules.append(_think_rule(w, opened=True))
        start = f"think {THINK_GAP} ({body})"
    elif shape.thinking:
        rules.append(_think_rule(w))
        start = f"(think {THINK_GAP})? ({body})"
    return "\n".join([f"start: {start}", *rules]) + "\n"


def _answer_rules(shape: AnswerShape, w: LarkWriter, content: str, rules: list[str]) -> str:
    fmt = shape.fmt
    if not shape.tools:
        return content
    if shape.mode is ChoiceMode.NONE:  # the tools are in the prompt, but the answer may not call one
        return _no_call(shape, w, content, rules)
    lazy_lead = (shape.mode is ChoiceMode.AUTO and shape.schema is None and bool(fmt.trigger)
                 and w.special(fmt.trigger) is None and fmt.name != "generic")
    if lazy_lead:  # free text until the trigger string; the lazy lead ends at its first occurrence
        rules.append(f"lead[lazy]: TEXT {json.dumps(fmt.trigger)}")
        rules.append(f"calls: {_calls_body(shape, w, rules, skip=len(fmt.trigger))}")
        return "TEXT | lead calls"
    rules.append(f"calls: {_calls_body(shape, w, rules)}")
    if shape.mode is not ChoiceMode.AUTO:
        return "calls"
    if fmt.name == "generic":
        if shape.schema is None:
            lead = w.lit('{"response": ')
            rules.append(f'response: {lead} %json {{"type": "string"}} "}}"')
        return "calls | " + ("response" if shape.schema is None else content)
    if shape.schema is not None:  # the content is JSON: a call or the JSON, nothing before either
        return f"calls | {content}"
    if not fmt.trigger:  # llama3: free text that cannot be a call (does not start with "{"), or a call
        rules.append("NOBRACE: /([^{](.|\\n)*)?/")
        return "calls | NOBRACE"
    return "TEXT | TEXT calls"  # the trigger is one special token: text cannot hold it


def _no_call(shape: AnswerShape, w: LarkWriter, content: str, rules: list[str]) -> str:
    fmt = shape.fmt
    if fmt.name == "generic":  # the envelope's answer branch only
        if shape.schema is not None:
            return content
        lead = w.lit('{"response": ')
        rules.append(f'response: {lead} %json {{"type": "string"}} "}}"')
        return "response"
    if shape.schema is not None:  # JSON content cannot start a call of a format with a trigger
        return content
    if not fmt.trigger:  # llama3: a call is an answer starting with "{"
        rules.append("NOBRACE: /([^{](.|\\n)*)?/")
        return "NOBRACE"
    if w.special(fmt.trigger) is not None:  # text terminals cannot hold the trigger token
        return content
    rules.append(f"NOCALL: /(.|\\n)*/ & ~/(.|\\n)*{_regex_escape(fmt.trigger)}(.|\\n)*/")
    return "NOCALL"


def _regex_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "\\.^$|?*+()[]{}/" else ch for ch in text)


def _calls_body(shape: AnswerShape, w: LarkWriter, rules: list[str], skip: int = 0) -> str:
    """The calls' Lark sequence; ``skip``: characters of the first ``open + before`` already matched
    (the trigger, when a lazy lead consumed it)."""
    fmt = shape.fmt
    if not any(r.startswith("call:") for r in rules):
        alts = []
        for i, t in enumerate(shape.tools):
            rules.append(f"args_{i}: {json_rule(t.parameters or {'type': 'object'}, an_object=True)}")
            alts.append(f"{w.lit(fmt.head() + t.name + fmt.mid())} args_{i}")
        rules.append("call: " + " | ".join(alts))
    first = (fmt.open + fmt.before)[skip:]
    one = f"call {w.lit(fmt.after)}"
    lead = "<[{}]>".format(w.special("<|python_tag|>")) + "? " if fmt.name == "llama3" and w.special(
        "<|python_tag|>") is not None else ""
    more = ""
    if shape.parallel and fmt.sep is not None:
        more = f" ({w.lit(fmt.sep + fmt.before)} {one})*"
    tail = f" {w.lit(fmt.close)}" if fmt.close else ""
    head = f"{w.lit(first)} " if first else ""
    return f"{lead}{head}{one}{more}{tail}"


def _think_rule(w: LarkWriter, opened: bool = False) -> str:
    """A reasoning block: ``<think>`` (unless ``opened``) text ``</think>`` (the blank line after it is
    in ``start``)."""
    b = w.special("</think>")
    if b is not None:  # text terminals cannot hold special tokens: the text ends at </think>
        return f"think: {'' if opened else w.lit('<think>')} TEXT <[{b}]>"
    return f"think[lazy]: /{'' if opened else '<think>'}(.|\\n)*<\\/think>/"
