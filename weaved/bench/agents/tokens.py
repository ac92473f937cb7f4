"""Synthetic turn content: exact token counts from seeded text.

A few thousand words drawn from a fixed word list (seeded) are tokenized once with the model's own
tokenizer, without special tokens; every prompt is a window of that pool at a seeded offset, wrapping
around.  So a turn's content is ordinary text ids (never a control token that would end a turn or
confuse the chat template), its length is exact, and it depends only on the seed and the item.
Speed does not depend on which words they are.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

WORDS = (
    "agent tool output result file line error warning request response status build test deploy "
    "queue task schedule report summary update change commit branch merge review comment issue "
    "ticket user customer order invoice payment account balance record table column value index "
    "search query filter sort page link image document section paragraph note list item step plan "
    "goal check retry timeout cache memory disk network server client service endpoint token model "
    "the a of to and in for on with from by at is was are were be been has have had will would can "
    "could should may might must not no yes all some many few more most other such only same new old"
).split()


def synthetic_text(seed: int, n_words: int) -> str:
    r = random.Random(f"{seed}/text")
    out = []
    for i in range(n_words):
        out.append(r.choice(WORDS))
        if i % 13 == 12:
            out.append(f"{r.randrange(1000)}.")
    return " ".join(out)


class TokenPool:
    """Windows of a fixed list of token ids, at offsets drawn per item."""

    def __init__(self, ids: Sequence[int], seed: int):
        if len(ids) < 2:
            raise ValueError("the token pool needs at least two ids")
        self.ids = [int(i) for i in ids]
        self.seed = seed

    @classmethod
    def from_tokenizer(cls, encode: Callable[[str], list[int]], seed: int, n_words: int = 12000) -> TokenPool:
        """``encode(text) -> ids`` without BOS or special tokens (e.g. the daemon's tokenizer)."""
        return cls(encode(synthetic_text(seed, n_words)), seed)

    def take(self, n: int, *key: object) -> list[int]:
        """``n`` ids for the item named by ``key`` (same key, same ids)."""
        start = random.Random("/".join(str(k) for k in (self.seed, "tokens", *key))).randrange(len(self.ids))
        out: list[int] = []
        while len(out) < n:
            chunk = self.ids[start : start + n - len(out)]
            out.extend(chunk)
            start = 0
        return out
