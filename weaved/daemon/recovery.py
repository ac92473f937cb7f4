"""What a restart derives from a session's journal record beyond its committed tokens.

A finished turn records its input tokens with its last input message and every generated id with the
answer; the committed tokens (``rec.tokens``, ``rec.kv_length`` of them) are the KV that exists.
From those two, a restart tells apart a turn that finished (the answer's last sampled token was never
fed: ``unfed_tail``) from one the daemon stopped in the middle of (``unfinished_answer``).
"""

from __future__ import annotations

from collections.abc import Callable

from weaved.errors import InvalidRequest


def answer_end(messages: list[dict], turn: int, lowest: int) -> int:
    """How many of a journal's ``messages`` run through its ``turn``-th answer (0: none); InvalidRequest
    for a turn below ``lowest`` or past its answers."""
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not lowest <= turn <= len(answers):
        raise InvalidRequest(f"turn must be between {lowest} and the session's {len(answers)} answered turn(s)",
                             param="turn")
    return answers[turn - 1] + 1 if turn else 0


def unfed_tail(rec) -> list[int]:
    """The answer's last token(s), sampled but not fed when its turn ended (``Session.tail``).

    The answer's ids beyond what was committed after the input are the tail.  The next turn feeds
    them first - for a prompt-only session nothing else would."""
    if len(rec.messages) < 2 or rec.messages[-1]["role"] != "assistant":
        return []
    ans, inp = rec.messages[-1], rec.messages[-2]
    if ans["token_ids"] is None or inp["token_ids"] is None or ans["kv_at"] != rec.kv_length:
        return []
    start = inp["kv_at"] + len(inp["token_ids"])
    gen, n = ans["token_ids"], rec.kv_length - start  # n: the answer's committed ids
    if not 0 <= n <= len(gen) or rec.tokens[start:] != gen[:n]:
        return []
    return list(gen[n:])


def transcript_of(entries: list[dict]) -> list[dict]:
    """The in-memory transcript of journal message entries (a raw prompt's input included, as a restart
    finds it)."""
    from weaved.daemon.session import transcript_entry
    from weaved.daemon.turns import message_extra

    return [{**transcript_entry(m["role"], m["content"], m["finish_reason"]), **(message_extra(m) or {})}
            for m in entries]


def unfed_prompt(rec) -> list[int]:
    """The rest of the last input's tokens when its turn was cut in its prefill (cancelled, or the daemon
    stopped): the tail the session held in memory, which its next turn feeds first - a raw prompt's rest
    would otherwise never be fed, and ``context_tokens`` would leave it out."""
    inp = next((m for m in reversed(rec.messages) if m["role"] != "assistant"), None)
    if inp is None or inp["token_ids"] is None or inp["kv_at"] is None:
        return []
    ids, at = inp["token_ids"], inp["kv_at"]
    done = rec.kv_length - at  # the input's tokens committed
    if not 0 <= done < len(ids) or list(rec.tokens[at:rec.kv_length]) != list(ids[:done]):
        return []
    return list(ids[done:])


def unfinished_answer(rec, decode: Callable[[list[int]], str]) -> tuple[str, list[int]] | None:
    """Text and ids of the answer a turn had committed when the daemon stopped (empty when it stopped
    before the first token: in the prompt's prefill, or queued), or None when no turn was cut.

    A turn records its prompt tokens with its last input message (user, tool result, raw prompt); what
    was committed after them is the answer so far.  A cut turn gets an answer, empty or not, so the
    transcript's roles keep alternating (templates such as Gemma's refuse two user turns in a row)."""
    if not rec.messages or rec.messages[-1]["role"] == "assistant":
        return None
    last = rec.messages[-1]
    start = (last["kv_at"] or 0) + len(last["token_ids"] or [])
    ids = rec.tokens[start:]
    return decode(ids) if ids else "", ids
