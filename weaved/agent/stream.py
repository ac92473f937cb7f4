"""The answer's text, split as it streams: reasoning, content and tool calls, in OpenAI's delta shapes.

``AnswerParser.push(text)`` takes the turn's text piece by piece and returns the deltas it completes:
``{"reasoning_content": ...}``, ``{"content": ...}``, and per call first ``{"tool_calls": [{"index",
"id", "type", "function": {"name", "arguments": ""}}]}`` then ``{"tool_calls": [{"index", "function":
{"arguments": fragment}}]}`` as the arguments arrive.  Text that might still turn into a marker
(``<think>``, the call trigger) is held back until it is known.  A constrained answer always has its
format's exact syntax; should an answer end mid-call (``max_tokens``), the call it was writing stays a
call, marked incomplete (``ToolCall.complete``), and the call syntax never becomes content - streamed
or not, a client sees the same.  Text that breaks the syntax (an unconstrained answer) is content.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from weaved.agent.formats import CallFormat
from weaved.agent.json_string import JsonString
from weaved.agent.tools import ToolCall, call_id

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class Answer:
    content: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class AnswerParser:
    """``fmt``: the call format when calls are parsed (None: tools off); ``thinking``: a ``<think>``
    block may open the answer; ``in_reasoning``: the prompt already opened it; ``call_seed``: the
    calls' ids derive from it (two parsers of one answer give the same ids), else they are random."""

    def __init__(self, fmt: CallFormat | None = None, *, thinking: bool = False, in_reasoning: bool = False,
                 call_seed: str | None = None, envelope: bool = True):
        self.fmt = fmt
        # the generic format's answer envelope ({"response": ...}); not when the answer is JSON of its own
        # (a response format), which may well start the same way
        self._envelope = envelope
        self._header: dict | None = None  # a call's first delta, held until its syntax is past its name
        self._call_seed = call_seed  # calls' ids: from (seed, index) when given (``tools.call_id``)
        self.answer = Answer()
        self._buf = ""  # text not yet classified
        self._state = "reasoning" if in_reasoning else ("think?" if thinking else "main?")
        self._calls: list[dict] = []  # {"id", "name", "args"} as parsed
        self._expect: list[str] = []  # literal text the call syntax requires next
        self._depth = 0
        self._in_str = self._esc = False
        self._resp = JsonString()
        self.reasoning_tokens = 0  # tokens given by push_token inside the reasoning block (its markers too)
        self.last_token_reasoning = False  # whether the last token push_token took was one of them
        self._raw = 0  # characters of the answer's text pushed so far
        # where the generic envelope's response string lies in that text, [start, end) (end None while it is
        # open): its text is the content, the rest of the envelope syntax (None: no such envelope)
        self.text_span: list[int | None] | None = None

    # ---- public ----------------------------------------------------------------------------------
    def push_token(self, text: str) -> list[dict]:
        """``push`` one generated token's text, counting it in ``reasoning_tokens`` when it is part of
        the reasoning block (OpenAI's ``reasoning_tokens``)."""
        before = self._state == "reasoning"
        out = self.push(text)
        self.last_token_reasoning = before or self._state == "reasoning"
        if self.last_token_reasoning:
            self.reasoning_tokens += 1
        return out

    def push(self, text: str) -> list[dict]:
        self._raw += len(text)
        self._buf += text
        out: list[dict] = []
        while self._buf and self._step(out):
            pass
        return _merge(out)

    def finish(self) -> list[dict]:
        """End of the answer: held text is released (as what it turned out to be)."""
        out: list[dict] = []
        if self._state in ("resp", "tail"):  # the response string's text is out already
            self._buf = ""
        elif self._state == "calls" or self._state.startswith("call"):
            # cut mid-call (the token limit, a cancel): the call syntax is no content; a call whose name
            # was written stays a call, incomplete, with its arguments as far as they came (as OpenAI
            # answers a call cut by max_tokens), as its deltas already streamed it
            self._buf = ""
            if self._header is not None:  # cut right after its name: the call it was, now said
                out.append(self._header)
                self._header = None
        elif self._state == "main?" and self._lead_prefix(self._buf.lstrip()):
            self._buf = ""  # cut inside the opening of an answer's envelope: nothing was said yet
        elif self._buf:
            self._emit(out, "reasoning_content" if self._state == "reasoning" else "content", self._buf)
            self._buf = ""
        self.answer.calls = [ToolCall(c["id"], c["name"], c["args"], complete=bool(c.get("done")))
                             for c in self._calls]
        return _merge(out)

    @property
    def held_text(self) -> int:
        """Characters of the answer's text held back, not yet said as content (blank space or a partial
        call trigger, which the next text decides): their tokens' log-probabilities wait with them."""
        return len(self._buf) if self._state == "main" else 0

    @property
    def envelope_pending(self) -> bool:
        """Whether the answer may still open the generic envelope (its first text is held to see): what
        its first tokens are - syntax or text - is not known yet."""
        return self.fmt is not None and self.fmt.name == "generic" and self._state in ("think?", "main?")

    def in_text(self, at: int, n: int) -> bool:
        """Whether the ``n`` characters of the answer's text from ``at`` are (partly) its text - not the
        generic envelope's syntax around a text answer (call syntax counts as the answer's)."""
        span = self.text_span
        if span is None:
            return True
        a, b = span
        return at + n > a and (b is None or at < b)

    def _lead_prefix(self, s: str) -> bool:
        """Whether ``s``, all an answer cut short said, is call syntax and no content: a proper start of
        the text that opens calls or a response in the generic format, or Llama 3's ``<|python_tag|>``
        itself (a proper start of that one is text: the tag is one token, never written in pieces)."""
        fmt = self.fmt
        if fmt is None or fmt.trigger or not s:
            return False
        if fmt.name != "generic":
            return s.rstrip() == "<|python_tag|>"
        return any(lead.startswith(s) and s != lead for lead in self._generic_leads())

    def _generic_leads(self) -> tuple[str, ...]:
        return ('{"tool_calls": [', '{"response": "') if self._envelope else ('{"tool_calls": [',)

    # ---- states ----------------------------------------------------------------------------------
    def _emit(self, out: list[dict], key: str, text: str) -> None:
        if not text:
            return
        if key == "content":
            self.answer.content += text
        elif key == "reasoning_content":
            self.answer.reasoning += text
        out.append({key: text})

    def _step(self, out: list[dict]) -> bool:
        """Consume what can be decided of the buffer; False when more text is needed."""
        if self._skip_ws:  # the blank lines after <think> and </think> belong to neither part - up to the
            # last line break before the text: the first line's own indentation is the text's
            s = self._buf.lstrip()
            if not s:
                return False
            gap = self._buf[: len(self._buf) - len(s)]
            self._buf = self._buf[gap.rfind("\n") + 1:] if "\n" in gap else s
            self._skip_ws = False
        st, buf = self._state, self._buf
        if st == "think?":
            s = buf.lstrip()
            if s.startswith(THINK_OPEN):
                self._buf, self._state, self._skip_ws = s[len(THINK_OPEN):], "reasoning", True
                return True
            if THINK_OPEN.startswith(s):
                return False  # all whitespace, or a prefix of <think>
            self._state = "main?"
            return True
        if st == "reasoning":
            i = buf.find(THINK_CLOSE)
            if i >= 0:
                self._emit(out, "reasoning_content", buf[:i])
                self._buf, self._state, self._skip_ws = buf[i + len(THINK_CLOSE):], "main?", True
                return True
            keep = _partial(buf, THINK_CLOSE)
            self._emit(out, "reasoning_content", buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        if st == "main?":
            return self._main_start(out)
        if st == "main":
            return self._main(out)
        if st == "resp":
            start = self._raw - len(buf)
            text, rest, closed = self._resp.feed(buf)
            self._emit(out, "content", text)
            self._raw_since_calls += buf[: len(buf) - len(rest)]
            self._buf = rest
            if closed:  # the string's text is content already: a tail breaking the syntax is said alone
                self.text_span[1] = start + len(buf) - len(rest) - 1  # (its closing quote)
                self._raw_since_calls = ""
                self._state = "tail"
                self._expect = ["}"]
            return closed
        if st == "tail":
            return self._literal(out, then="end")
        if st == "end":
            self._buf = ""  # nothing may follow a complete answer (the grammar allows only its end)
            return False
        return self._call_step(out)

    def _main_start(self, out: list[dict]) -> bool:
        fmt = self.fmt
        if fmt is None or fmt.trigger:
            self._state = "main"
            return True
        # (llama3: a call only when the answer starts with "{" itself, as its grammar says: " {" is text)
        s = self._buf.lstrip() if fmt.name == "generic" else self._buf
        if not s:
            return False
        if fmt.name == "generic":
            for lead, state in zip(self._generic_leads(), ("calls", "resp"), strict=False):
                if s.startswith(lead):
                    self._raw_since_calls = self._buf[: len(self._buf) - len(s) + len(lead)]
                    self._buf = s[len(lead):]
                    self._state = state
                    if state == "resp":
                        self.text_span = [self._raw - len(self._buf), None]
                    if state == "calls":
                        self._start_call_syntax(first=True, skip_open=True)
                    return True
                if lead.startswith(s):
                    return False
            self._state = "main"
            return True
        tag = "<|python_tag|>"
        if tag.startswith(s) and s != tag:
            return False
        body = s[len(tag):] if s.startswith(tag) else s
        if not body and s.startswith(tag):
            return False
        if body.startswith("{"):  # llama3: an answer that starts with a JSON object is a call
            self._raw_since_calls = self._buf[: len(self._buf) - len(body)]
            self._buf = body
            self._state = "calls"
            self._start_call_syntax(first=True, skip_open=True)
            return True
        self._state = "main"
        return True

    def _main(self, out: list[dict]) -> bool:
        fmt, buf = self.fmt, self._buf
        if fmt is None or not fmt.trigger:
            self._emit(out, "content", buf)
            self._buf = ""
            return False
        i = buf.find(fmt.trigger)
        if i >= 0:
            # the blank space between the text and its first call is neither (a thinking template's
            # "</think>\n\n<tool_call>" would otherwise answer " " beside the calls, not null)
            said = buf[:i].rstrip()
            self._emit(out, "content", said)
            self._raw_since_calls = buf[len(said):i + len(fmt.trigger)]  # (text again, should no call follow)
            self._buf = buf[i + len(fmt.trigger):]
            self._state = "calls"
            self._start_call_syntax(first=True, skip=len(fmt.trigger))
            return True
        # held back: the trigger's possible start, and the blank space before it (said with the text that
        # follows it, or at the answer's end)
        keep = _partial(buf, fmt.trigger)
        said = buf[: len(buf) - keep].rstrip()
        self._emit(out, "content", said)
        self._buf = buf[len(said):]
        return False

    # ---- calls -----------------------------------------------------------------------------------
    def _start_call_syntax(self, first: bool, skip: int = 0, skip_open: bool = False) -> None:
        fmt = self.fmt
        lead = "" if skip_open else (fmt.open + fmt.before if first else fmt.sep + fmt.before)
        self._expect = [lead[skip:] + fmt.head()]
        self._state = "call:lit"
        self._next_after_lit = "call:name"

    def _literal(self, out: list[dict], then: str) -> bool:
        want = self._expect[0] if self._expect else ""
        n = min(len(want), len(self._buf))
        if self._buf[:n] != want[:n]:
            return self._broken(out)
        self._raw_since_calls += self._buf[:n]
        self._buf = self._buf[n:]
        if n < len(want):
            self._expect[0] = want[n:]
            return False
        self._expect = []
        self._state = then
        if then == "call:args" and self._header is not None:  # past its name: it is a call, said now
            out.append(self._header)
            self._header = None
        if then == "call:between":  # a call is complete: what follows starts afresh
            self._raw_since_calls = ""
        return True

    def _call_step(self, out: list[dict]) -> bool:
        st = self._state
        if st == "calls":
            self._state = "call:lit"
            return True
        if st == "call:lit":
            return self._literal(out, then=self._next_after_lit)
        if st == "call:name":
            i = self._buf.find('"')
            if i < 0:
                return False
            name = self._buf[:i]
            self._raw_since_calls += self._buf[: i + 1]
            self._buf = self._buf[i + 1:]
            call = {"id": call_id(self.fmt.id_style, self._call_seed, len(self._calls)), "name": name, "args": ""}
            self._calls.append(call)
            idx = len(self._calls) - 1
            # held until the syntax after the name holds too: an unconstrained answer that only starts
            # like a call (a JSON object whose first key is "name") never streams a call it then takes back
            self._header = {"tool_calls": [{"index": idx, "id": call["id"], "type": "function",
                                            "function": {"name": name, "arguments": ""}}]}
            self._expect = [self.fmt.mid()[1:]]  # the closing quote is consumed
            self._next_after_lit = "call:args"
            self._state = "call:lit"
            self._depth, self._in_str, self._esc = 0, False, False
            return True
        if st == "call:args":
            return self._args(out)
        if st == "call:between":
            return self._between(out)
        return self._broken(out)

    def _args(self, out: list[dict]) -> bool:
        buf, n = self._buf, 0
        done = False
        for ch in buf:
            n += 1
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
            elif ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    done = True
                    break
        frag = buf[:n]
        call, idx = self._calls[-1], len(self._calls) - 1
        call["args"] += frag
        self._raw_since_calls += frag
        self._buf = buf[n:]
        if frag:
            out.append({"tool_calls": [{"index": idx, "function": {"arguments": frag}}]})
        if done:
            call["done"] = True
            self._raw_since_calls = ""  # (the call is kept: text that then breaks the syntax is content alone)
            self._expect = [self.fmt.after]
            self._next_after_lit = "call:between"
            self._state = "call:lit"
        return done

    def _between(self, out: list[dict]) -> bool:
        fmt, buf = self.fmt, self._buf
        nxt = (fmt.sep + fmt.before + fmt.head()) if fmt.sep is not None else None
        if nxt is not None and buf.startswith(nxt):
            self._start_call_syntax(first=False)
            return True
        if fmt.close and buf.startswith(fmt.close):
            self._raw_since_calls += fmt.close
            self._buf = buf[len(fmt.close):]
            self._state = "end"
            return True
        if (nxt is not None and nxt.startswith(buf)) or (fmt.close and fmt.close.startswith(buf)):
            return False
        if not fmt.close and buf.strip() == "":
            return False
        return self._broken(out)

    def _broken(self, out: list[dict]) -> bool:
        """Text that does not follow the call syntax (an unconstrained answer): the rest is content."""
        self._calls = [c for c in self._calls if c.get("done")]
        self._header = None  # (the call it would have said was not one)
        self._emit(out, "content", self._raw_since_calls + self._buf)
        self._buf = self._raw_since_calls = ""
        self.fmt, self._state = None, "main"
        return False

    _raw_since_calls = ""  # the text since the calls began, not yet part of a complete call
    _next_after_lit = "call:name"
    _skip_ws = False


def _partial(buf: str, marker: str) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(buf)), 0, -1):
        if marker.startswith(buf[len(buf) - n:]):
            return n
    return 0


def _merge(deltas: list[dict]) -> list[dict]:
    """Adjacent content (or reasoning) deltas joined into one."""
    out: list[dict] = []
    for d in deltas:
        if out and len(d) == 1 and d.keys() == out[-1].keys() and "tool_calls" not in d:
            k = next(iter(d))
            out[-1] = {k: out[-1][k] + d[k]}
        else:
            out.append(d)
    return out
