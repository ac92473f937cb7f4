"""``POST /v1/responses`` request shapes (the subset agents use) and their translation to a chat turn.

Input items become chat messages: a message (``input_text`` / ``output_text`` parts), a
``function_call`` (an assistant message's tool call; consecutive calls join one message), a
``function_call_output`` (a ``tool`` message), a ``reasoning`` item (the next assistant message's
reasoning).  Function tools, ``tool_choice`` and ``text.format`` map onto the chat request's tools,
tool choice and response format, so both APIs share one grammar and one parser.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from weaved.agent.plan import AnswerSpec
from weaved.api.agent_models import (
    NO_FORMAT_DESCRIPTION,
    Fields,
    FunctionDef,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ToolDef,
    answer_spec,
    other_tool_type,
)
from weaved.api.models import (
    EXPLAINED,
    INERT_FIELDS,
    NullIsDefault,
    SLABody,
    StreamOptions,
    inert_field_problem,
    medium_verbosity,
)
from weaved.api.response_items import unseal_reasoning
from weaved.errors import InvalidRequest

MAX_INPUT_ITEMS = 4096
INCLUDABLE = frozenset({"reasoning.encrypted_content"})  # what include may ask for
RESPONSES_FIELDS = Fields(format="text.format", schema="text.format.schema", parameters="parameters")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")  # output_text parts sent back carry annotations, logprobs

    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")  # id, status of an output message sent back

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")  # id, status

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")  # id, status

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[ContentPart]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class SummaryPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["summary_text"]
    text: str


class ReasoningTextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(BaseModel):
    model_config = ConfigDict(extra="ignore")  # id, status

    type: Literal["reasoning"]
    summary: list[SummaryPart] = []
    content: list[ReasoningTextPart] | None = None  # the raw reasoning (what Weave returns)
    encrypted_content: str | None = None  # what ``include: ["reasoning.encrypted_content"]`` returned

    @field_validator("encrypted_content")
    @classmethod
    def _sealed_here(cls, v: str | None) -> str | None:
        if v is not None:
            unseal_reasoning(v)  # (ValueError: not Weave's, or damaged)
        return v

    def text(self) -> str:
        """The reasoning to send back: its raw text, else what its encrypted_content holds, else its
        summary's."""
        if self.content:
            return "".join(p.text for p in self.content)
        if self.encrypted_content is not None:
            return unseal_reasoning(self.encrypted_content)
        return "".join(p.text for p in self.summary)


def _item_type(v: Any) -> str:
    """An input item's ``type`` (a message may leave it out): which item shape checks it, so that a bad
    item is refused in its own shape's words rather than every shape's."""
    kind = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", "message")
    return f"tag:{kind}"  # ("tag:": an error's location leaves it out, ``http_errors.validation_error``)


InputItem = Annotated[Annotated[MessageItem, Tag("tag:message")] | Annotated[FunctionCallItem, Tag("tag:function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("tag:function_call_output")]
                      | Annotated[ReasoningItem, Tag("tag:reasoning")], Discriminator(_item_type)]
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class FunctionTool(FunctionDef):
    """A function tool, flat as the Responses API writes it (chat completions nests it under
    ``function``): the same checks of its name and parameters, at parse time."""

    type: Literal["function"]


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None  # required with json_schema, as OpenAI requires it
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> TextFormat:
        if self.type == "json_schema" and not self.name:
            raise ValueError("a json_schema format needs its name")
        if self.type != "json_schema":
            for field, value in (("schema", self.schema_), ("name", self.name), ("description", self.description),
                                 ("strict", self.strict)):
                if value is not None:
                    raise ValueError(f'{field} is used only with type "json_schema" (this format is {self.type!r}, '
                                     f'which would ignore it)')
        if self.description:
            raise ValueError(NO_FORMAT_DESCRIPTION)
        return self


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None
    verbosity: str | None = None  # "medium": the only one a model without that training can honour

    _medium = field_validator("verbosity")(classmethod(lambda cls, v: medium_verbosity(v)))


class ReasoningOptions(BaseModel):
    """``reasoning`` as a response echoes it (both null): the model's thinking is what its chat template
    asks for (``chat_template_kwargs``), so an effort or a summary it cannot honour is refused."""

    model_config = ConfigDict(extra="forbid")

    effort: None = None
    summary: None = None

    @model_validator(mode="before")
    @classmethod
    def _nothing_to_adjust(cls, v: Any) -> Any:
        for key in ("effort", "summary"):
            if isinstance(v, dict) and v.get(key) is not None:
                raise ValueError(f"reasoning.{key} cannot be honoured: this model thinks as its chat template "
                                 f"says (a thinking template's switch is chat_template_kwargs, e.g. "
                                 f"{{\"enable_thinking\": false}}), and its reasoning comes back whole, not "
                                 f"summarized; leave it null")
        return v


class ResponsesRequest(NullIsDefault):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: Annotated[Annotated[str, Tag("tag:text")] | Annotated[list[InputItem], Tag("tag:items")],
                     Discriminator(lambda v: "tag:text" if isinstance(v, str) else "tag:items")]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    previous_response_id: str | None = None
    store: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)  # 0: the most probable alone
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # extension (a negative one: its two's complement)
    truncation: Literal["disabled"] | None = None  # "auto" would drop context: refused
    chat_template_kwargs: dict[str, Any] | None = None  # extension, as on chat completions
    sla: SLABody | None = None  # Weave extension
    include: list[str] | None = None  # extra output data: reasoning items' encrypted_content alone
    reasoning: ReasoningOptions | None = None  # accepted as the response echoes it (nothing to adjust)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice_shape(cls, v: Any) -> Any:
        if isinstance(v, dict) and isinstance(v.get("function"), dict) and "name" not in v:
            raise ValueError(f'the Responses API names a function as {{"type": "function", "name": '
                             f'"{v["function"].get("name", "...")}"}} (not chat completions\' "function" object)')
        if isinstance(v, dict) and v.get("type") != "function":
            raise ValueError(f'a tool_choice of type {v.get("type")!r} is not supported: "none", "auto", "required" '
                             f'or {{"type": "function", "name": ...}}')
        return v

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, v: Any) -> Any:
        """Tool types other than functions (web_search, file_search, mcp, ...) are refused by name."""
        for i, tool in enumerate(v if isinstance(v, list) else ()):
            problem = other_tool_type(tool)
            if problem is not None:
                raise ValueError(f"tools[{i}]: {problem}")
        return v

    @field_validator("input", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        """Content parts other than text (input_image, input_file, ...) are refused by name: the union of
        item shapes would otherwise answer with every member's complaint."""
        for i, item in enumerate(v if isinstance(v, list) else ()):
            kind = item.get("type") if isinstance(item, dict) else None
            if kind is not None and kind not in ITEM_TYPES:
                raise ValueError(f"input[{i}]: {kind} items are not supported: {', '.join(ITEM_TYPES)}")
            parts = item.get("content") if isinstance(item, dict) else None
            for part in parts if isinstance(parts, list) else ():
                kind = part.get("type") if isinstance(part, dict) else None
                if kind is not None and kind not in ("input_text", "output_text", "text", "reasoning_text"):
                    raise ValueError(f"input[{i}]: content parts of type {kind!r} are not supported: a text part "
                                     f"is input_text (or output_text, sent back); this model takes text only")
        return v

    @field_validator("input")
    @classmethod
    def _input(cls, v: str | list) -> str | list:
        if not v:
            raise ValueError("must not be empty: a string, or a list of at least one item")
        return v

    def unsupported(self) -> tuple[str, str] | None:
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream: true"
        if self.stream_options is not None and self.stream_options.include_usage:
            return "stream_options", ("include_usage is a chat completions option: a response's usage is always in "
                                      "its response.completed event")
        other = sorted(set(self.include or ()) - INCLUDABLE)
        if other:
            return "include", f"include values are not supported: {other} (only {sorted(INCLUDABLE)})"
        for name, value in sorted((self.model_extra or {}).items()):
            if value is None or (name == "background" and value is False):  # (the defaults: null, and no
                continue  # background run)
            if name == "background":
                return name, ("background: true is not offered: a response runs while its request waits or "
                              'streams (a session turn with "detach": true runs with nobody waiting)')
            if name in EXPLAINED:
                return name, EXPLAINED[name]
            if name not in INERT_FIELDS:
                return name, f"unknown or unsupported field {name!r}"
            problem = inert_field_problem(name, value, stored=True)
            if problem is not None:
                return name, problem
        if isinstance(self.input, list) and len(self.input) > MAX_INPUT_ITEMS:
            return "input", f"at most {MAX_INPUT_ITEMS} input items"
        return None

    def messages(self) -> list[dict]:
        """The input as chat messages (instructions are the session's system prompt, not a message)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict] = []
        reasoning: str | None = None
        for item in self.input:
            if isinstance(item, ReasoningItem):
                reasoning = item.text()
            elif isinstance(item, MessageItem):
                role = "system" if item.role == "developer" else item.role  # (chat templates know "system")
                msg = {"role": role, "content": item.text()}
                if item.role == "developer":  # (its input items say it as it was sent)
                    msg["sent_as"] = "developer"
                if role == "assistant" and reasoning:
                    msg["reasoning_content"], reasoning = reasoning, None
                out.append(msg)
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = out[-1] if out else None
                if last is not None and last["role"] == "assistant":  # the text the call came after, or a call
                    last.setdefault("tool_calls", []).append(call)  # (one answer: one assistant message)
                else:
                    msg = {"role": "assistant", "content": "", "tool_calls": [call]}
                    if reasoning:
                        msg["reasoning_content"], reasoning = reasoning, None
                    out.append(msg)
            else:
                out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        if not out:
            raise InvalidRequest("input holds no message", param="input")
        return out

    def answer(self) -> AnswerSpec:
        tools = [ToolDef(type="function", function=FunctionDef(name=t.name, description=t.description,
                                                               parameters=t.parameters, strict=t.strict))
                 for t in self.tools or []]
        choice = self.tool_choice
        if isinstance(choice, ToolChoiceFunction):
            choice = NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
        fmt = None
        tf = self.text.format if self.text is not None else None
        if tf is not None and tf.type != "text":
            fmt = ResponseFormat(type=tf.type, json_schema=JsonSchemaFormat(name=tf.name, schema=tf.schema_)
                                 if tf.type == "json_schema" else None)
        return answer_spec(tools, choice, self.parallel_tool_calls, fmt, self.chat_template_kwargs, RESPONSES_FIELDS)
