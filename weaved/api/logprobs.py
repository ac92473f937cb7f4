"""Log-probabilities in OpenAI's two shapes: chat's ``content`` list, and completions' parallel arrays.

The engine reports a token as ``(token_id, logprob, [(alt_id, alt_logprob), ...])``; these helpers
turn ids into the token's text (its bytes decoded leniently: a token may hold part of a UTF-8
character, which ``bytes`` then carries exactly).
"""

from __future__ import annotations

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


class CompletionLogprobs:
    """Builds ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` as tokens arrive.

    ``text_offset`` is each token's character offset in the choice's text; the first prompt token
    (nothing before it to predict it) has ``None`` for its log-probability and its alternatives.
    """

    def __init__(self, tokenizer, offset: int = 0):
        self.tokenizer = tokenizer
        self.offset = offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token_id: int, logprob: float | None, top: Iterable[tuple[int, float]] | None,
            in_text: bool = True) -> None:
        """One token's entry; ``in_text`` False for a token the choice's text does not hold (a BOS the
        tokenizer added): its offset is where the text starts, and it moves no later offset."""
        text, _ = token_piece(self.tokenizer, token_id)
        self.tokens.append(text)
        self.token_logprobs.append(None if logprob is None else float(logprob))
        if logprob is None:
            self.top_logprobs.append(None)
        else:
            alts: dict[str, float] = {}
            for alt_id, alt_lp in top or ():
                alts.setdefault(token_piece(self.tokenizer, alt_id)[0], float(alt_lp))
            self.top_logprobs.append(alts)
        self.text_offset.append(self.offset)
        self.offset += len(text) if in_text else 0

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
