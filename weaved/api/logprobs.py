"""Log-probabilities in OpenAI's two shapes: chat's ``content`` list, and completions' parallel arrays.

The engine reports a token as ``(token_id, logprob, [(alt_id, alt_logprob), ...])``; these helpers
turn ids into the token's text (its bytes decoded leniently: a token may hold part of a UTF-8
character, which ``bytes`` then carries exactly).
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable


def token_piece(tokenizer, token_id: int) -> tuple[str, bytes]:
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), raw


def chat_entry(tokenizer, token_id: int, logprob: float, top: Iterable[tuple[int, float]]) -> dict:
    """One item of a chat choice's ``logprobs.content``."""
    text, raw = token_piece(tokenizer, token_id)
    alts = []
    for alt_id, alt_lp in top:
        alt_text, alt_raw = token_piece(tokenizer, alt_id)
        alts.append({"token": alt_text, "logprob": float(alt_lp), "bytes": list(alt_raw)})
    return {"token": text, "logprob": float(logprob), "bytes": list(raw), "top_logprobs": alts}


class TextGate:
    """Which generated tokens' log-probability entries an answer keeps: those whose text it returns.

    A token event's ``at`` is where its decoded piece starts in the generated text.  An entry whose
    piece starts before the end of the text sent so far is in that text and goes out; one at or past
    it waits - its text is held back (it may start a stop string, or it is the first bytes of a
    character) - until the text reaches it.  What still waits when the turn ends never goes out: a
    stop string or stop token took its text.  Entries keep their order."""

    def __init__(self) -> None:
        self.sent = 0  # characters of generated text sent
        self._waiting: list[tuple[int, object]] = []

    def push(self, ev: dict, entry: object | None, held: int = 0) -> list:
        """A token event (``entry``: its entry, or None for an event without log-probabilities, such as the
        end's release of held text, which has no ``at``): the entries its text releases, in order - but
        for the last ``held`` characters of the text, which its reader holds back yet (an answer's blank
        space before a possible call)."""
        if entry is not None:
            self._waiting.append((ev["at"], entry))
        self.sent += len(ev["text"])
        return self.release(held)

    def release(self, held: int = 0) -> list:
        """The waiting entries whose text is out, but for its last ``held`` characters."""
        n = 0
        while n < len(self._waiting) and self._waiting[n][0] < self.sent - held:
            n += 1
        out = [e for _, e in self._waiting[:n]]
        del self._waiting[:n]
        return out


class AnswerEntries:
    """A chat answer's ``logprobs.content``: the entries of the tokens of its text - not its reasoning's
    (returned apart, without them), nor the generic envelope's syntax around a text answer (a call's
    syntax is listed, as its tokens are the answer) - each going out with its text (``TextGate``).

    Call ``push`` right after the answer's parser took the token.  The first tokens of an answer that may
    open the envelope are held until the parser knows whether they were its syntax."""

    def __init__(self, parser) -> None:
        self.parser = parser
        self.gate = TextGate()
        self._held: list[tuple[int, int, object]] = []  # (at, characters, entry) not yet known to be text

    def push(self, ev: dict, entry: object | None) -> list:
        """A token event (``entry`` its entry, or None): the entries that go out now, in order."""
        p = self.parser
        if entry is not None and p.last_token_reasoning:
            entry = None
        if p.envelope_pending:
            if entry is not None:
                self._held.append((ev["at"], len(ev["text"]), entry))
            return self.gate.push(ev, None)  # (its text is counted: what it releases is earlier entries')
        out = self._release() if self._held else []
        if entry is not None and not p.in_text(ev["at"], len(ev["text"])):
            entry = None  # the envelope's syntax around a text answer
        # (an entry whose text the parser still holds goes out with that text: a chunk's entries are its own)
        return out + self.gate.push(ev, entry, held=p.held_text)

    def finish(self) -> list:
        """The answer ended: held entries go out if their text was the answer's (nothing was, if it ended
        inside the envelope's opening), then those whose text the parser held to its end."""
        if not self._held:
            return self.gate.release()
        if self.parser.envelope_pending:
            self._held.clear()  # (the answer said nothing)
            return self.gate.release()
        return self._release() + self.gate.release()

    def _release(self) -> list:
        kept = [(at, e) for at, n, e in self._held if self.parser.in_text(at, n)]
        self._held.clear()
        out = []
        for at, e in kept:  # (their text is counted already: each goes out once its text went)
            out += self.gate.push({"at": at, "text": ""}, e, held=self.parser.held_text)
        return out


class CompletionLogprobs:
    """Builds ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` as tokens arrive.

    ``text_offset`` is each token's character offset in the choice's text: a prompt token's counts the
    echoed prompt's characters before it (decoded as a stream: a character split over two tokens is
    counted once), a generated token's is ``text_start`` (the echo's length) plus its ``at``.  The
    first prompt token (nothing before it to predict it) has ``None`` for its log-probability and
    its alternatives.  ``top_logprobs`` always holds the token itself beside its alternatives (as
    OpenAI's "up to logprobs + 1").
    """

    def __init__(self, tokenizer, text_start: int = 0):
        self.tokenizer = tokenizer
        self.offset = 0  # the echoed prompt's characters so far
        self.text_start = text_start
        self._prompt = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token_id: int, logprob: float | None, top: Iterable[tuple[int, float]] | None,
            in_text: bool = True) -> None:
        """A prompt token's entry; ``in_text`` False for a token the choice's text does not hold (a BOS
        the tokenizer added): its offset is where the text starts, and it moves no later offset."""
        self._entry(token_id, logprob, top, self.offset)
        if in_text:
            self.offset += len(self._prompt.decode(self.tokenizer.token_bytes(token_id)))

    def add_generated(self, token_id: int, logprob: float, top: Iterable[tuple[int, float]] | None,
                      at: int) -> None:
        """A generated token's entry; ``at``: where its piece starts in the generated text."""
        self._entry(token_id, logprob, top, self.text_start + at)

    def _entry(self, token_id: int, logprob: float | None, top, offset: int) -> None:
        text, _ = token_piece(self.tokenizer, token_id)
        self.tokens.append(text)
        self.token_logprobs.append(None if logprob is None else float(logprob))
        if logprob is None:
            self.top_logprobs.append(None)
        else:
            alts: dict[str, float] = {}
            for alt_id, alt_lp in top or ():
                alts.setdefault(token_piece(self.tokenizer, alt_id)[0], float(alt_lp))
            alts.setdefault(text, float(logprob))
            self.top_logprobs.append(alts)
        self.text_offset.append(offset)

    def __len__(self) -> int:
        return len(self.tokens)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
                "text_offset": self.text_offset}

    def take(self) -> dict:
        """The entries so far, then start afresh (one streamed chunk's worth); offsets keep counting."""
        out = self.to_dict()
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out
