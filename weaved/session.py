"""A session as the daemon holds it, and how a new turn's tokens are derived from its transcript."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from weaved.engine.sequence import Sequence, SLARank
from weaved.kv.cache import KVCache
from weaved.model.tokenizer import Tokenizer
from weaved.routing.types import SLA, TOP_PRIORITY, Placement


@dataclass(eq=False)
class Session:
    id: str
    sla: SLA
    max_context: int
    system: str | None
    placement: Placement
    kv: KVCache
    committed: list[int]  # token ids whose KV rows are written: len == kv.length
    messages: list[dict]  # the transcript: {"role", "content"}
    created: float = field(default_factory=time.time)
    tail: list[int] = field(default_factory=list)  # sampled but not yet fed (the turn's last token)
    turn: Sequence | None = None
    ephemeral: bool = False  # an OpenAI call without a session: deleted after its turn
    last_active: float = field(default_factory=time.time)
    where: str | None = None  # the pool running the session's turns now (None: its placement's decode pool)
    kv_at: str | None = None  # the pool whose backend holds a copy of its KV (None: only the file)
    move_reason: str | None = None  # why it was sent to ``where`` while idle (its KV follows at the next turn)

    @property
    def pool(self) -> str:
        return self.where or self.placement.decode_pool

    @property
    def rank(self) -> SLARank:
        return SLARank(TOP_PRIORITY - self.placement.priority)

    @property
    def context_tokens(self) -> int:
        return len(self.committed) + len(self.tail)

    @property
    def busy(self) -> bool:
        return self.turn is not None and not self.turn.status.done


def chat_turn_tokens(tok: Tokenizer, s: Session, new_messages: list[dict]) -> tuple[list[int], int]:
    """Tokens this turn must feed, and how many committed tokens to keep.

    The transcript's tokens are the truth for what is already in the KV.  The chat template renders
    the whole conversation; when that text extends what the session's tokens decode to, only the
    extension is tokenized and fed - the stored context is never recomputed.  Otherwise (a template
    that rewrites earlier text) the longest common token prefix is kept and the rest re-fed.
    """
    messages = list(s.messages) + list(new_messages)
    if s.system and not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": s.system}, *messages]
    text = tok.render_chat(messages, add_generation_prompt=True)
    have = s.committed + s.tail
    if not have:
        return tok.encode(text), 0
    have_text = tok.decode(have)
    if text.startswith(have_text):
        return s.tail + tok.encode(text[len(have_text) :], add_bos=False), len(s.committed)
    full = tok.encode(text)
    keep = 0
    for a, b in zip(full, s.committed, strict=False):
        if a != b:
            break
        keep += 1
    return full[keep:], keep
