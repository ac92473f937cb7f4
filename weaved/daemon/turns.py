"""A turn's pieces the daemon puts together: the tokens it feeds, the check that they fit, and the
sequence an engine runs.

The transcript's tokens are the truth for what is already in a session's KV: a turn derives only
what it adds (``chat_turn_tokens``, ``prompt_turn_tokens``) and never recomputes the stored context.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from weaved.agent.plan import AnswerPlan
from weaved.daemon.session import Session
from weaved.engine.constraint import TokenConstraint
from weaved.engine.sampling import SamplingParams
from weaved.engine.sequence import Sequence
from weaved.engine.stops import StopChecker
from weaved.errors import ContextTooLong, InvalidRequest
from weaved.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class TurnHandle:
    """What the API keeps of a started turn: usage counts and a way to cancel it."""

    session_id: str
    prompt_tokens: int  # the context the turn starts from (cached + new), for usage
    cached_tokens: int
    cancel: Callable[[], None]
    placement: dict | None = None  # where the turn runs (the session's placement, as of its start)
    answer: AnswerPlan | None = None  # a chat turn's answer plan: the API parses the answer with it
    reprefilled: int = 0  # committed tokens the template rewrote, fed again this turn
    call_seed: str | None = None  # the answer's call ids derive from it (``AnswerPlan.parser``), as recorded
    placement_now: Callable[[], dict] | None = None  # the session's placement now (a promotion moves a turn)


@dataclass(frozen=True)
class Context:
    """What ``chat_turn_tokens`` reads of a session: a session as it would be (a dry run's view)."""

    system: str | None
    messages: list[dict]
    committed: list[int]
    tail: list[int]

    @classmethod
    def of(cls, s: Session) -> Context:
        """A copy of what ``s`` holds now (its messages one level deep: a later edit does not reach it)."""
        return cls(s.system, [dict(m) for m in s.messages], list(s.committed), list(s.tail))

    def holds(self, s: Session) -> bool:
        """Whether ``s`` still holds exactly this: what was computed from the copy holds for it."""
        return (s.system == self.system and s.tail == self.tail and s.committed == self.committed
                and s.messages == self.messages)


def no_chat_template(model_name: str) -> InvalidRequest:
    return InvalidRequest(f"the model {model_name} has no chat template, so it cannot take messages: serve it "
                          f"with --chat-template FILE, or send a prompt to /v1/completions (`weave run --raw` from "
                          f"the CLI)", param="messages", code="no_chat_template")


def chat_turn_tokens(tok: Tokenizer, s: Session | Context, new_messages: list[dict],
                     render: Callable[[list[dict]], str] | None = None) -> tuple[list[int], int]:
    """Tokens this turn must feed, and how many committed tokens to keep (``s``: the session, or a
    ``Context`` of what it would hold).

    The transcript's tokens are the truth for what is already in the KV.  The chat template renders
    the whole conversation; when that text extends what the session's tokens decode to, only the
    extension is tokenized and fed - the stored context is never recomputed.  Otherwise (a template
    that rewrites earlier text: drops an old answer's thinking, trims an answer's last newline) the
    longest run of the session's tokens whose text the rendering still starts with is kept, and the
    rest of the text tokenized and fed - or, where more, the tokens a fresh tokenization of the whole
    shares with the committed ones (an answer sampled as other tokens than the tokenizer's own moves that
    point back to it; a tokenizer whose pieces never spell the text - llama.cpp writes a space after a
    SentencePiece vocabulary's special tokens - has only that one).
    ``render``: the conversation's prompt text (an ``AnswerPlan``'s, with tools; default: the template's).
    """
    messages = list(s.messages) + list(new_messages)
    if s.system:  # the session's own, first: a system message a turn brings comes where the turn put it
        messages = [{"role": "system", "content": s.system}, *messages]
    text = render(messages) if render is not None else tok.render_chat(messages, add_generation_prompt=True)
    have = s.committed + s.tail
    if not have:
        return tok.encode_chat(text), 0
    have_text = tok.decode(have)
    if text.startswith(have_text):
        return s.tail + tok.encode(text[len(have_text) :], add_bos=False), len(s.committed)
    k, at = _text_prefix(tok, have, text)
    full = tok.encode_chat(text)
    same = 0  # the tokens a fresh tokenization of the whole shares with the committed ones
    for a, b in zip(full, s.committed, strict=False):
        if a != b:
            break
        same += 1
    if same >= k:  # (also a tokenizer whose pieces do not spell the text: llama.cpp's space after a special
        return full[same:], same  # token in SentencePiece vocabularies, Phi-3's stripped one)
    keep = min(k, len(s.committed))  # (past it, the held tokens are the unfed tail's: fed again)
    return have[keep:k] + tok.encode(text.encode("utf-8")[at:].decode("utf-8"), add_bos=False), keep


def _text_prefix(tok: Tokenizer, ids: list[int], text: str) -> tuple[int, int]:
    """The most of ``ids`` whose bytes ``text``'s UTF-8 starts with, ending on a character's boundary
    (a character split over two tokens stays whole); (tokens, bytes).  Bytes, not decoded prefixes: a
    prefix of a token sequence spells a prefix of its bytes, not always of its decoded text."""
    want = text.encode("utf-8")
    k = at = 0
    for t in ids:
        piece = tok.token_bytes(t)
        if want[at:at + len(piece)] != piece:
            break
        k, at = k + 1, at + len(piece)
    while k and at < len(want) and (want[at] & 0xC0) == 0x80:  # inside a character: back to its start
        k -= 1
        at -= len(tok.token_bytes(ids[k]))
    return k, at


def prompt_turn_tokens(tok: Tokenizer, s: Session | Context, prompt: str | list[int]) -> tuple[list[int], int]:
    """Tokens a raw-prompt turn feeds (the session's unfed tail first) and the committed tokens it keeps
    (all of them).  A text prompt gets BOS only when it starts the session."""
    if isinstance(prompt, list):
        ids = prompt
    else:
        ids = tok.encode_prompt(prompt) if not s.committed else tok.encode(prompt, add_bos=False)
    return s.tail + list(ids), len(s.committed)


@dataclass(frozen=True)
class TokensAhead:
    """A turn's tokens (or its refusal) computed from a copy of its session before the daemon's lock is
    taken: rendering and tokenizing a long prompt takes seconds (a 12 MB one, fifteen), which under the
    lock would stall every other turn's start and step.  They hold while the session holds the copy."""

    view: Context
    tokens: tuple[list[int], int] | None
    error: Exception | None

    @classmethod
    def compute(cls, view: Context, tokens: Callable[[Context], tuple[list[int], int]]) -> TokensAhead:
        try:
            return cls(view, tokens(view), None)
        except Exception as e:  # (a refusal: raised when the turn starts, if the session is still as copied)
            return cls(view, None, e)

    def get(self, s: Session, tokens: Callable[[Session], tuple[list[int], int]]) -> tuple[list[int], int]:
        """The tokens for ``s`` (under the lock): those computed ahead, or ``tokens(s)`` if it changed."""
        if not self.view.holds(s):
            return tokens(s)
        if self.error is not None:
            raise self.error
        return self.tokens


def _context(s: Session) -> int:
    """The positions a session's turns may fill: its ``max_context`` (its KV file is that rounded up to
    whole pages, which a turn never uses beyond)."""
    return min(s.kv.capacity, s.max_context)


def fitted(params: SamplingParams, s: Session, keep: int, new: list[int]) -> SamplingParams:
    """``params`` with a ``fit_context`` bound cut to what the session's context holds after the prompt."""
    if not params.fit_context:
        return params
    room = _context(s) - (keep + len(new))
    try:
        return replace(params, max_tokens=max(1, min(params.max_tokens, room)), fit_context=False)
    except ValueError as e:  # min_tokens beyond what fits
        raise ContextTooLong(str(e), param="min_tokens") from None


def turn_constraint(plan: AnswerPlan | None, params: SamplingParams) -> TokenConstraint | None:
    """The grammar constraint of a chat turn's answer, if it has one (InvalidRequest when it cannot be
    enforced as asked)."""
    if plan is None:
        return None
    constraint = plan.constraint()
    if constraint is not None and params.ignore_eos and plan.spec.constrained:  # (not a turn after past calls)
        raise InvalidRequest("ignore_eos cannot be combined with tools or response_format: the grammar "
                             "decides where the answer ends", param="ignore_eos")
    check_grammar_ends(plan, params)
    return constraint


def check_grammar_ends(plan: AnswerPlan, params: SamplingParams) -> None:
    """Refuse what fights the grammar over where the answer ends: a stop string (or a stop token other
    than an end of turn) would cut the JSON - a schema's, a call's arguments - short under finish_reason
    "stop", and min_tokens would ban the end of turn that a complete grammar alone allows."""
    ends = plan.grammar_ends()
    if ends is None:
        return
    if params.stop and plan.stops_until is None:  # (else the stop strings end the text before any call)
        raise InvalidRequest(f"stop cannot be combined with {ends}: the grammar decides where the answer ends, "
                             f"and a stop string would cut its JSON short", param="stop")
    cutting = sorted(set(params.stop_token_ids) - plan.end_of_turn_ids)
    if cutting:  # (end-of-turn ids change nothing: the grammar allows them only where the answer is complete)
        raise InvalidRequest(f"stop_token_ids cannot name token {cutting[0]}, which is not an end of turn, together "
                             f"with {ends}: the grammar decides where the answer ends, and a stop token would cut "
                             f"its JSON short", param="stop_token_ids")
    if params.min_tokens:
        raise InvalidRequest(f"min_tokens cannot be combined with {ends}: the grammar decides where the answer "
                             f"ends, and once it is complete only the end of turn may follow", param="min_tokens")


def message_extra(m: dict) -> dict | None:
    """A message's fields beyond role and content (tool calls, the call a tool result answers, a name,
    thinking sent back; a generated answer's parsed form), as the journal keeps them."""
    extra = {k: m[k] for k in ("name", "tool_calls", "tool_call_id", "reasoning_content", "answer", "sent_as")
             if m.get(k) is not None}
    return extra or None


def check_names_rendered(render: Callable[[list[dict]], str], messages: list[dict]) -> None:
    """A message's ``name`` (OpenAI's participant name) is honoured only by the chat template: refuse
    one the template does not render (the prompt would be the same without it) rather than drop it."""
    named = [i for i, m in enumerate(messages) if m.get("name") and m.get("role") != "tool"]
    if not named:
        return
    bare = [{k: v for k, v in m.items() if k != "name"} if i in named else m for i, m in enumerate(messages)]
    if render(bare) == render(messages):
        raise InvalidRequest(f"messages[{named[0]}].name: this model's chat template does not use a message's "
                             f"name; leave it out, or say it in the content", param="messages")


def parsed_answer(plan, call_seed: str | None, text: str) -> dict | None:
    """A chat turn's generated ``text`` as the API returned it (``plan``: its ``AnswerPlan``; the calls'
    ids from ``call_seed``, as the API's parser made them): OpenAI's assistant message fields - none
    when that is the text itself (no calls, no reasoning) -, or None for a turn without a plan (a raw
    prompt's)."""
    if plan is None:
        return None
    parser = plan.parser(call_seed)
    parser.push(text)
    parser.finish()
    ans = parser.answer
    if not ans.calls and not ans.reasoning and ans.content == text:
        return {}
    out: dict = {"content": ans.content if (ans.content or not ans.calls) else None}
    if ans.reasoning:
        out["reasoning_content"] = ans.reasoning
    if ans.calls:
        out["tool_calls"] = [c.to_openai() for c in ans.calls]
    return out


def check_fits(s: Session, keep: int, new: list[int], max_tokens: int, model_context: int | None = None) -> None:
    """Refuse (400) a turn that adds nothing, or whose prompt and ``max_tokens`` exceed the session's KV
    (``model_context``: the model's own, which a context smaller than it names as the way to more)."""
    if not new:
        raise InvalidRequest("the turn adds no tokens", param="messages")
    total = keep + len(new)
    cap = _context(s)
    where = "this request's context" if s.ephemeral else "the session's context"
    more = ""
    if model_context is not None and cap < min(model_context, total + max(max_tokens, 1)):
        more = (f" (the profile's [host] default_context; the model takes {model_context}: send it in a session "
                f"created with a larger max_context - POST /v1/sessions {{\"max_context\": N}} - or raise "
                f"default_context)" if s.ephemeral else
                f" (its max_context - the profile's default_context unless the session was created with one; "
                f"the model takes {model_context}: a fork with a larger one goes on from here, POST "
                f"/v1/sessions/{s.id}/fork {{\"max_context\": N}})")
    if total > cap:
        raise ContextTooLong(f"the prompt needs {total} tokens of context but {where} holds {cap}{more}")
    if total == cap and max_tokens:
        raise ContextTooLong(f"the prompt's {total} tokens fill {where} of {cap} tokens: no room is left "
                             f"for an answer{more}")
    if total + max_tokens > cap:
        raise ContextTooLong(
            f"max_tokens {max_tokens} with a {total}-token prompt exceeds {where} of {cap} tokens{more}",
            param="max_tokens")


def turn_sequence(s: Session, new: list[int], params: SamplingParams, tok: Tokenizer, *, echo: bool, arrival: float,
                  default_ttlt_s: float | None = None, constraint: TokenConstraint | None = None,
                  stops_until: str | None = None, expected_tokens: int | None = None,
                  plan: AnswerPlan | None = None) -> Sequence:
    """The engine's sequence for a turn of ``s`` feeding ``new``: its sampler, stops and SLA deadlines
    (``default_ttlt_s``: the TTLT budget when the session's SLA names none; ``arrival``: now, on the
    engines' clock; ``stops_until``: the text after which stop strings no longer apply, a call's start;
    ``expected_tokens``: the answer its pacing plans for, ``Sequence.expected_tokens``; ``plan``: a chat
    answer's, whose reasoning block stop strings leave alone)."""
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tok.eog_ids))
    return Sequence(
        session_id=s.id, kv=s.kv, pending=list(new), params=params, rank=s.rank,
        ttft_s=s.sla.ttft_ms / 1000 if s.sla.ttft_ms else None, ttlt_s=s.sla.ttlt_s or default_ttlt_s,
        history=list(s.committed), decoder=tok.stream_decoder(),
        stops=StopChecker(params.stop, stop_ids, until=stops_until, reasoning=plan.reasoning if plan else None,
                          in_reasoning=plan.in_reasoning if plan else False),
        prompt_logprobs=echo, constraint=constraint,
        arrival=arrival, expected_tokens=expected_tokens,
    )
