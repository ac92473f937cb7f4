"""Request bodies, validated strictly: a wrong type is an error, never silently coerced.

Bodies are validated with ``strict=True`` (``"5"`` is not an integer, ``"true"`` is not a boolean)
and NaN or infinite numbers never get this far (the JSON reader rejects them).  OpenAI request
fields Weave does not use are ignored, except those whose absence would change the answer
(``n`` > 1, tools, ...), which are refused with a clear message (see ``unsupported``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from weaved.api.agent_models import NamedToolChoice, ResponseFormat, ToolCallIn, ToolDef
from weaved.engine.sampling import MAX_LOGPROBS
from weaved.errors import InvalidRequest

PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Role = Literal["system", "developer", "user", "assistant", "tool"]


class NullIsDefault(BaseModel):
    """A body whose optional fields take an explicit null as their default: OpenAI types them ``X | null``,
    and clients that write every field (``None`` serialized) send ``"stream": null``, ``"n": null``."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = {f.alias or name: f for name, f in cls.model_fields.items()}
        nulls = [k for k, v in data.items() if v is None and k in fields and not fields[k].is_required()]
        return {k: v for k, v in data.items() if k not in nulls} if nulls else data


class SLABody(BaseModel):
    """Weave's SLA tags: ``{"class", "ttft_ms", "ttlt_s"}``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    cls: Literal["interactive", "background", "batch"] | None = Field(None, alias="class")
    ttft_ms: PositiveFloat | None = None
    ttlt_s: PositiveFloat | None = None

    @model_validator(mode="before")
    @classmethod
    def _an_object(cls, v: Any) -> Any:
        if isinstance(v, str):
            raise ValueError(f'must be an object, e.g. {{"class": "{v}"}} (with "ttft_ms" or "ttlt_s" if you '
                             f'like), or the X-Weave-SLA-Class header')
        if not isinstance(v, dict | SLABody):
            raise ValueError('must be an object: {"class": "interactive" | "background" | "batch", "ttft_ms", '
                             '"ttlt_s"}')
        return v


class StreamOptions(NullIsDefault):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    # OpenAI pads stream events with random characters against length side channels unless this is
    # false; Weave sends no padding, which is what false asks for
    include_obfuscation: bool | None = None

    @field_validator("include_obfuscation")
    @classmethod
    def _no_padding(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("obfuscation padding is not offered (events are never padded): send false or leave "
                             "it out")
        return v


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    """One message.  ``content`` may be null only on an assistant message that carries ``tool_calls``;
    a ``tool`` message names the call it answers (``tool_call_id``).  ``reasoning_content`` (an earlier
    answer's thinking, sent back) goes to templates that render it."""

    model_config = ConfigDict(extra="forbid")

    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None  # sent back by SDKs on assistant messages; must be null here
    # what ``message.model_dump()`` of an SDK's answer carries back: null (or no annotations) only
    audio: Any = None
    function_call: Any = None
    annotations: list[Any] | None = None
    # the openai SDK's parse() helpers send back their own reading of ``content`` (``parsed``): derived
    # from the content, which is what the model reads, so nothing is lost in not reading it again
    parsed: Any = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if isinstance(v, list):
            for part in v:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind is not None and kind != "text":
                    raise ValueError(f"{kind} content parts are not supported: this model takes text only")
        return v

    @model_validator(mode="after")
    def _shape(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content may be null only on an assistant message with tool_calls")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if self.refusal is not None:
            raise ValueError("refusal is not supported on input messages")
        if self.audio is not None:
            raise ValueError("audio is not supported on input messages (only null): this model takes text only")
        if self.function_call is not None:
            raise ValueError("function_call (the deprecated functions API) is not supported: send tool_calls")
        if self.annotations:
            raise ValueError("annotations are not supported on input messages (only null or [])")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def to_dict(self) -> dict:
        # "developer" is OpenAI's newer name for the system role; chat templates know "system".
        out: dict = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            # (the SDK's parsed_arguments is its reading of arguments, index a stream's: not part of the call kept)
            out["tool_calls"] = [c.model_dump(exclude={"index": True, "function": {"parsed_arguments"}})
                                 for c in self.tool_calls]
        return out


MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_CHOICES = 16  # n: answers to one prompt (forks of one prefill)
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300  # logit_bias entries per request
# OpenAI fields that do not change the answer (bookkeeping for OpenAI's own platform): accepted, unused.
INERT_FIELDS = frozenset({"metadata", "store", "user", "service_tier", "prompt_cache_key", "safety_identifier",
                          "prompt_cache_retention"})

# fields Weave does not offer, with what to do instead (a plain "unknown field" would leave a client guessing)
EXPLAINED = {
    "reasoning_effort": ("reasoning_effort cannot be honoured: this model thinks as its chat template says (a "
                         "thinking template's switch is chat_template_kwargs, e.g. {\"enable_thinking\": false}); "
                         "leave it null"),
    "max_tool_calls": ("max_tool_calls is not offered: an answer makes one round of function calls (one call, or "
                       "several with parallel_tool_calls: true), which the client runs before it continues"),
}
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority")  # OpenAI's: bookkeeping here


def medium_verbosity(v: str | None) -> str | None:
    """``verbosity`` (chat completions) or ``text.verbosity`` (responses): "medium", the default, is the only
    one a model without that training can honour; the others are refused."""
    if v not in (None, "medium"):
        raise ValueError(f"only 'medium' (the default) is offered, got {v!r}: this model was not trained to "
                         f"make its answers shorter or longer on request; ask for it in the instructions")
    return v

INERT_TYPES = {"store": (bool, "a boolean"), "user": (str, "a string"), "service_tier": (str, "a string"),
               "prompt_cache_key": (str, "a string"), "safety_identifier": (str, "a string"),
               "prompt_cache_retention": (str, "a string")}


def inert_field_problem(name: str, value: Any, *, stored: bool) -> str | None:
    """Why an inert field's value is refused (None: it is fine).  ``metadata`` has OpenAI's shape (at
    most 16 string values of at most 512 characters, keys of at most 64); ``store`` true is refused where
    nothing is stored (``stored`` False: chat completions keep nothing to retrieve).  Each has OpenAI's
    type (a wrong one is an error, as there)."""
    if value is not None and name in INERT_TYPES and not isinstance(value, INERT_TYPES[name][0]):
        return f"{name} must be {INERT_TYPES[name][1]}, got {type(value).__name__}"
    if name == "service_tier" and value not in SERVICE_TIERS:
        return (f"service_tier must be one of {', '.join(SERVICE_TIERS)} (every request here is served alike), "
                f"got {value!r}")
    if name == "store" and value not in (None, False) and not stored:
        return ("store: true is not offered here (nothing is kept to retrieve): use the Responses API, "
                "which stores by default, or a session")
    if name == "metadata" and value is not None:
        if not isinstance(value, dict) or len(value) > 16:
            return "metadata must be an object of at most 16 key-value pairs"
        for k, v in value.items():
            if len(k) > 64 or not isinstance(v, str) or len(v) > 512:
                return (f"metadata values must be strings of at most 512 characters and keys at most 64 "
                        f"characters (key {k[:64]!r})")
    return None


class Sampling(NullIsDefault):
    """Fields shared by chat completions, session turns and completions.  Unknown fields are kept (in
    ``model_extra``) only so that ``unsupported`` can refuse them by name."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # the served model's name or "default" (else 404 model_not_found)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)  # OpenAI's range
    top_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)  # 0: the most probable alone
    top_k: int | None = Field(None, ge=0)  # extension (as vLLM and llama.cpp)
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)  # extension
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)  # extension
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = Field(None, ge=0)  # extension (as vLLM): no end of turn before this many
    stop_token_ids: list[int] | None = None  # extension (as vLLM)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # any int64 (as OpenAI) or uint64 (as llama.cpp)
    ignore_eos: bool | None = None  # extension (as vLLM): generate max_tokens, past end of turn
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    sla: SLABody | None = None  # Weave extension
    session: str | None = Field(None, min_length=1)  # Weave extension

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in items):
            raise ValueError("stop strings must not be empty")
        if len(items) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (len(v) > MAX_STOP_TOKEN_IDS or any(t < 0 for t in v)):
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} token ids, each >= 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return v
        if len(v) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        for k, b in v.items():
            if not (k.isascii() and k.isdigit()) or str(int(k)) != k:  # "²" and "٣" are digits to Python
                raise ValueError(f"keys are token ids (strings of the digits 0-9, no leading zeros), got {k!r}")
            if not -100 <= b <= 100:
                raise ValueError(f"values are in [-100, 100], got {b} for token {k}")
        return v

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for a request Weave cannot answer as asked, else None: every field that
        would change the answer is either honoured or refused here by name."""
        if not 1 <= self.n <= MAX_CHOICES:
            return "n", f"n must be between 1 and {MAX_CHOICES}"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream: true (as OpenAI)"
        extra = self.model_extra or {}
        for name in sorted(extra):
            if extra[name] is None:  # OpenAI's types are ``X | null``: null is the default, whatever X is
                continue
            if name in INERT_FIELDS:
                problem = inert_field_problem(name, extra[name], stored=False)
                if problem is not None:
                    return name, problem
                continue
            if name in ("functions", "function_call"):
                return name, f"{name} is deprecated and not supported; send tools and tool_choice"
            if name == "best_of" and type(extra[name]) is int and extra[name] == 1:
                continue
            if name == "modalities" and extra[name] == ["text"]:  # what every answer here is
                continue
            if name == "modalities":
                return name, 'modalities: this model answers in text only (["text"])'
            if name in EXPLAINED:
                return name, EXPLAINED[name]
            return name, f"unknown or unsupported field {name!r}"
        return None


class ChatRequest(Sampling):
    """``POST /v1/chat/completions`` and ``POST /v1/sessions/{id}/turns``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    detach: bool = False  # Weave extension: answer 202 at once, the turn runs on (a session's turn only)
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    verbosity: str | None = None

    _verbosity = field_validator("verbosity")(classmethod(lambda cls, v: medium_verbosity(v)))

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice_shape(cls, v: Any) -> Any:
        """A shape this API does not take is named, with the ones it does: the union of shapes would
        otherwise answer with each member's complaint."""
        if isinstance(v, str) and v not in ("none", "auto", "required"):
            raise ValueError(f'{v!r} is not a tool choice: use "none", "auto", "required" or '
                             f'{{"type": "function", "function": {{"name": ...}}}}')
        if isinstance(v, dict) and v.get("type") != "function":
            raise ValueError(f"a tool choice of type {v.get('type')!r} is not supported (allowed_tools, custom "
                             f'and the like): use "none", "auto", "required" or {{"type": "function", '
                             f'"function": {{"name": ...}}}}')
        if isinstance(v, dict) and "name" in v and "function" not in v:
            raise ValueError(f'chat completions names a function as {{"type": "function", "function": {{"name": '
                             f'"{v["name"]}"}}}} (not the Responses API\'s "name" beside "type")')
        return v


def _check_token_ids(ids: list) -> None:
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"token ids must be integers (item {i} is {type(t).__name__})")
        if t < 0:
            raise ValueError(f"token ids must be >= 0 (item {i} is {t})")


class CompletionRequest(Sampling):
    """``POST /v1/completions``: one prompt (text or token ids)."""

    prompt: Any
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # 0 with echo: the prompt alone, scored (its log-probabilities), as OpenAI's completions allowed it
    max_tokens: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _nothing_generated_needs_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest("max_tokens 0 generates nothing: it scores the prompt alone, which needs echo: "
                                 "true (with logprobs for the scores)", param="max_tokens")
        return self

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, p: Any) -> Any:
        """OpenAI's four shapes, each checked with a message that says which was meant (a union's
        error list says only that nothing matched)."""
        if isinstance(p, str):
            return p
        if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            return p
        if isinstance(p, list) and p and all(isinstance(x, list) for x in p):
            for x in p:
                _check_token_ids(x)
            return p
        if isinstance(p, list) and not any(isinstance(x, str | list) for x in p):
            _check_token_ids(p)
            return p
        raise ValueError("must be a string, a list of token ids (integers >= 0), or a list of those")

    def single_prompt(self) -> str | list[int]:
        """The prompt as text or token ids; a list holding one prompt is unwrapped."""
        p: Any = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise InvalidRequest("one prompt per request is supported (got a batch of several)", param="prompt")
            p = p[0]
        if not p:
            raise InvalidRequest("the prompt must not be empty", param="prompt")
        return p


class SessionCreate(BaseModel):
    """``POST /v1/sessions``."""

    model_config = ConfigDict(extra="forbid")

    sla: SLABody | None = None
    max_context: int | None = Field(None, ge=1)
    system: str | None = None


class SessionRewind(BaseModel):
    """``POST /v1/sessions/{id}/rewind``."""

    model_config = ConfigDict(extra="forbid")

    turn: int = Field(ge=0)  # keep the transcript through this answered turn (0: none of it)


class SessionFork(BaseModel):
    """``POST /v1/sessions/{id}/fork``."""

    model_config = ConfigDict(extra="forbid")

    turn: int | None = Field(None, ge=1)  # fork after this answered turn (default: where the session is now)
    sla: SLABody | None = None
    # the fork's context (default: the parent's): more, to go on past a parent that is full
    max_context: int | None = Field(None, ge=1)
