"""Request bodies, validated strictly: a wrong type is an error, never silently coerced.

Bodies are validated with ``strict=True`` (``"5"`` is not an integer, ``"true"`` is not a boolean)
and NaN or infinite numbers never get this far (the JSON reader rejects them).  OpenAI request
fields Weave does not use are ignored, except those whose absence would change the answer
(``n`` > 1, tools, ...), which are refused with a clear message (see ``unsupported``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from weaved.engine.sampling import MAX_LOGPROBS
from weaved.errors import InvalidRequest

PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Role = Literal["system", "developer", "user", "assistant", "tool"]


class SLABody(BaseModel):
    """Weave's SLA tags: ``{"class", "ttft_ms", "ttlt_s"}``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    cls: Literal["interactive", "background", "batch"] | None = Field(None, alias="class")
    ttft_ms: PositiveFloat | None = None
    ttlt_s: PositiveFloat | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Role
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def to_dict(self) -> dict[str, str]:
        # "developer" is OpenAI's newer name for the system role; chat templates know "system".
        return {"role": "system" if self.role == "developer" else self.role, "content": self.text()}


class Sampling(BaseModel):
    """Fields shared by chat completions, session turns and completions.  Unknown fields are kept (in
    ``model_extra``) only so that ``unsupported`` can look at them."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None  # informational: the daemon serves one model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)  # extension (as vLLM and llama.cpp)
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)  # extension
    repetition_penalty: float | None = Field(None, gt=0, allow_inf_nan=False)  # extension
    frequency_penalty: float | None = Field(None, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, lt=2**64)
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
        if v is not None and any(not s for s in ([v] if isinstance(v, str) else v)):
            raise ValueError("stop strings must not be empty")
        return v

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for a request Weave cannot answer as asked, else None."""
        if self.n != 1:
            return "n", "only n=1 is supported (one choice per request)"
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                return name, f"{name} is not supported; use repetition_penalty"
        extra = self.model_extra or {}
        for name in ("tools", "functions", "tool_choice", "response_format", "suffix"):
            if extra.get(name) not in (None, [], "none", {"type": "text"}):
                return name, f"{name} is not supported"
        if extra.get("best_of") not in (None, 1):
            return "best_of", "only best_of=1 is supported"
        return None


class ChatRequest(Sampling):
    """``POST /v1/chat/completions`` and ``POST /v1/sessions/{id}/turns``."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    detach: bool = False  # Weave extension: answer 202 at once, the turn runs on (a session's turn only)


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
