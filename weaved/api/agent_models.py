"""Request shapes of the agent protocol: tools, tool choice, tool calls, response format - and the
``AnswerSpec`` they become."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from weaved.agent.plan import DEFAULT_PARALLEL, AnswerSpec
from weaved.agent.tools import MAX_TOOLS, ChoiceMode, Tool, ToolChoice
from weaved.errors import InvalidRequest

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_SCHEMA_BYTES = 64 * 1024


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError("function names are 1-64 letters, digits, '_' or '-'")
        return v

    @field_validator("parameters")
    @classmethod
    def _object(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "object") != "object":
            raise ValueError("a function's parameters must be a JSON schema of type object (its arguments "
                             "are an object)")
        return v


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDef

    @model_validator(mode="before")
    @classmethod
    def _function_only(cls, v: Any) -> Any:
        problem = other_tool_type(v)
        if problem is not None:
            raise ValueError(problem)
        return v


def other_tool_type(tool: Any) -> str | None:
    """Why a tool of another type than ``function`` (custom, web_search, mcp, ...) is refused, named by its
    type rather than by every field a function lacks; None for a function (or no type at all)."""
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind in (None, "function"):
        return None
    return f"{kind} tools are not offered here: only function tools"


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class CallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str
    parsed_arguments: Any = None  # the openai SDK's parse() helpers' reading of ``arguments``, sent back


class ToolCallIn(BaseModel):
    """A past call, in an assistant message the client sends back."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: CallFunction
    # a streamed call's delta index, which the openai SDK's stream helpers (and most stream accumulators)
    # leave on the call they assemble: its place in the list says the same, so it is not kept
    index: int | None = Field(None, ge=0)


NO_FORMAT_DESCRIPTION = ("a format's description is not offered: the schema is enforced on the answer by a grammar, "
                         "not written into the prompt, so the model would never read it; say what the answer "
                         "should hold in a message")


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # (the schema is always enforced: strict or not, the answer is valid)

    @field_validator("description")
    @classmethod
    def _no_description(cls, v: str | None) -> str | None:
        if v:
            raise ValueError(NO_FORMAT_DESCRIPTION)
        return v


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_needs_its_type(self) -> ResponseFormat:
        if self.json_schema is not None and self.type != "json_schema":
            raise ValueError(f'json_schema is used only with type "json_schema" (this format is {self.type!r}, '
                             f'which would ignore it)')
        return self


@dataclass(frozen=True)
class Fields:
    """The request's own names for the answer's fields: errors name a field as the request spelled it."""

    format: str = "response_format"
    schema: str = "response_format.json_schema.schema"
    parameters: str = "function.parameters"  # a tool's parameters, under tools[i]


CHAT_FIELDS = Fields()


def check_schema(schema: dict, param: str, what: str) -> None:
    """A client's JSON schema: bounded in size, and without ``x-guidance`` - the grammar engine's own
    options (a lenient mode that drops keywords Weave would refuse, another JSON spacing), which Weave
    sets itself."""
    if len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise InvalidRequest(f"{what} is larger than {MAX_SCHEMA_BYTES} bytes", param=param)
    if "x-guidance" in schema:
        raise InvalidRequest(f"{what}: x-guidance is not accepted (Weave sets the grammar engine's options "
                             f"itself); leave it out", param=param)


def tools_from(defs: list[ToolDef] | None, fields: Fields = CHAT_FIELDS) -> tuple[Tool, ...]:
    if not defs:
        return ()
    if len(defs) > MAX_TOOLS:
        raise InvalidRequest(f"at most {MAX_TOOLS} tools per request (got {len(defs)})", param="tools")
    out = []
    for i, d in enumerate(defs):
        f = d.function
        # no parameters, or an empty schema: a function of no arguments (as OpenAI reads both), not one
        # whose arguments may be any JSON the model invents
        params = f.parameters if f.parameters else {"type": "object", "properties": {}}
        where = f"tools[{i}].{fields.parameters}"
        check_schema(params, where, where)
        out.append(Tool(f.name, f.description or "", params, bool(f.strict)))
    return tuple(out)


def choice_from(raw: str | NamedToolChoice | None, has_tools: bool) -> ToolChoice:
    """OpenAI's default: ``auto`` with tools, ``none`` without."""
    if raw is None:
        return ToolChoice(ChoiceMode.AUTO if has_tools else ChoiceMode.NONE)
    if isinstance(raw, NamedToolChoice):
        return ToolChoice(ChoiceMode.FUNCTION, raw.function.name)
    return ToolChoice(ChoiceMode(raw))


def schema_from(fmt: ResponseFormat | None, fields: Fields = CHAT_FIELDS) -> dict | None:
    """The content's JSON schema (``json_object``: any object), or None for free text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "object"}
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise InvalidRequest(f"{fields.format} json_schema needs {fields.schema}", param=fields.format)
    schema = fmt.json_schema.schema_
    check_schema(schema, fields.format, f"the {fields.format} schema")
    return schema


def answer_spec(tools: list[ToolDef] | None, tool_choice, parallel: bool | None, response_format,
                template_kwargs: dict | None, fields: Fields = CHAT_FIELDS) -> AnswerSpec:
    t = tools_from(tools, fields)
    if parallel is not None and not t:  # (OpenAI refuses it too: there is nothing it could change)
        raise InvalidRequest("parallel_tool_calls is only allowed when tools are given", param="parallel_tool_calls")
    return AnswerSpec(tools=t, choice=choice_from(tool_choice, bool(t)),
                      parallel=DEFAULT_PARALLEL if parallel is None else parallel,
                      schema=schema_from(response_format, fields),
                      template_kwargs=dict(template_kwargs or {}), format_field=fields.format)
