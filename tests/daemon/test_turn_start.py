"""Starting a turn beside others: a prompt's rendering and tokenizing happen outside the daemon's lock,
and what they were computed from is checked again under it."""

from __future__ import annotations

import threading

import pytest

import weaved.daemon.turn_start as turn_start
from tests.daemon.support import GREEDY, run_to_end, run_turn
from weaved.engine.sampling import SamplingParams
from weaved.errors import ContextTooLong, Overloaded
from weaved.routing.types import SLA, SLAClass


def test_a_prompt_being_tokenized_does_not_hold_up_another_sessions_turn(daemon, monkeypatch):
    """The first turn's tokenizing waits until another session's turn has run to its end: had it held the
    daemon's lock, that turn could not have started (the wait gives up, and the test fails)."""
    slow = daemon.create_session(SLA(SLAClass.BACKGROUND), None, None)["id"]
    other = daemon.create_session(SLA(SLAClass.INTERACTIVE), None, None)["id"]
    real = daemon.tokenizer.encode_chat
    tokenizing, other_done = threading.Event(), threading.Event()
    waited: list[bool] = []

    def encode_chat(text: str) -> list[int]:
        if "a very long document" in text:
            tokenizing.set()
            waited.append(other_done.wait(60))
        return real(text)

    monkeypatch.setattr(daemon.tokenizer, "encode_chat", encode_chat)
    result: list = []
    t = threading.Thread(target=lambda: result.append(run_turn(daemon, slow, "Summarize a very long document")))
    t.start()
    assert tokenizing.wait(60)
    events, _ = run_turn(daemon, other, "hi")
    other_done.set()
    t.join(120)
    assert events[-1]["type"] == "done" and waited == [True]
    assert result and result[0][0][-1]["type"] == "done"


def test_a_session_changed_while_its_prompt_was_tokenized_is_tokenized_again(daemon, monkeypatch):
    """What was computed from the session's copy is used only while the session still holds it: a system
    prompt set meanwhile is in the turn's prompt."""
    sid = daemon.create_session(SLA(SLAClass.BACKGROUND), None, None)["id"]
    real = daemon.tokenizer.encode_chat
    texts: list[str] = []

    def encode_chat(text: str) -> list[int]:
        texts.append(text)
        if len(texts) == 1:  # while the copy is tokenized, the session gets a system prompt
            daemon.set_system(sid, "You are terse.")
        return real(text)

    monkeypatch.setattr(daemon.tokenizer, "encode_chat", encode_chat)
    events, handle = run_to_end(daemon, session_id=sid, messages=[{"role": "user", "content": "Hello"}],
                                params=GREEDY)
    assert events[-1]["type"] == "done"
    assert len(texts) == 2 and "You are terse." not in texts[0] and "You are terse." in texts[1]
    assert handle.prompt_tokens == len(real(texts[1]))


def test_a_sessions_system_prompt_stays_first_beside_a_turns_own_system_message(daemon, monkeypatch):
    """A session made with a system prompt keeps it when a turn brings a system message too (the model
    sees both, the session's first), and a later turn's system message leaves the context before it as
    it was: nothing is fed again."""
    sid = daemon.create_session(SLA(SLAClass.BACKGROUND), None, "You are a pirate named Jack.")["id"]
    real = daemon.tokenizer.encode_chat
    texts: list[str] = []
    monkeypatch.setattr(daemon.tokenizer, "encode_chat", lambda text: texts.append(text) or real(text))
    run_to_end(daemon, session_id=sid, params=GREEDY, messages=[
        {"role": "system", "content": "You are a robot named Bolt."}, {"role": "user", "content": "Who are you?"}])
    assert texts and texts[0].index("pirate named Jack") < texts[0].index("robot named Bolt")
    assert daemon.get_session(sid)["system"] == "You are a pirate named Jack."
    later = daemon.create_session(SLA(SLAClass.BACKGROUND), None, "You are a pirate named Jack.")["id"]
    run_turn(daemon, later, "Who are you?")
    events, handle = run_to_end(daemon, session_id=later, params=GREEDY, messages=[
        {"role": "system", "content": "From now on answer briefly."}, {"role": "user", "content": "And your ship?"}])
    assert events[-1]["type"] == "done" and handle.reprefilled == 0 and handle.cached_tokens > 0


def test_a_turn_that_brings_a_new_system_prompt_changes_it_only_if_it_starts(daemon, monkeypatch):
    """A Responses chain continued with other instructions: the session's system prompt changes with the
    turn, which is rendered with it - and a refused turn (its answer cannot fit) leaves the session, its
    journal and its next turn's prompt as they were."""
    sid = daemon.create_session(SLA(SLAClass.BACKGROUND), None, "You are a pirate.")["id"]
    run_turn(daemon, sid, "Hello")
    with pytest.raises(ContextTooLong):
        run_to_end(daemon, session_id=sid, messages=[{"role": "user", "content": "More"}],
                   params=SamplingParams(max_tokens=10**9, temperature=0), system="You are a robot.",
                   replaces_system=True)
    assert daemon.get_session(sid)["system"] == "You are a pirate."
    assert daemon.journal.get(sid).system == "You are a pirate."

    events, _ = run_to_end(daemon, session_id=sid, messages=[{"role": "user", "content": "More"}], params=GREEDY,
                           system="You are a robot.", replaces_system=True)
    assert events[-1]["type"] == "done"
    context = daemon.tokenizer.decode(daemon.sessions[sid].committed)  # what the model read
    assert "You are a robot." in context and "pirate" not in context
    assert daemon.get_session(sid)["system"] == daemon.journal.get(sid).system == "You are a robot."


def test_a_turn_waits_for_its_sessions_prefix_copy_and_is_refused_if_it_outlasts_the_wait(daemon, monkeypatch):
    """The session's context is being stored as a shared prefix (its rows must hold still): the next
    turn waits for the copy, and is refused with a 503 rather than run beside a copy that outlasts the
    wait (it could rewrite rows the copy then stores under tokens they no longer hold)."""
    sid = daemon.create_session(SLA(SLAClass.BACKGROUND), None, None)["id"]
    run_turn(daemon, sid, "Hello")
    before = daemon.get_session(sid)
    monkeypatch.setattr(turn_start, "CANCEL_WAIT_S", 0.05)
    daemon.sessions[sid].publishing = threading.Event()  # a copy still queued behind others
    with pytest.raises(Overloaded):
        run_turn(daemon, sid, "And then?")
    assert daemon.get_session(sid) == before
    daemon.sessions[sid].publishing.set()
    events, _ = run_turn(daemon, sid, "And then?")
    assert events[-1]["type"] == "done"


def test_a_rewritten_history_refeeds_from_where_its_text_changed_not_from_a_retokenization(daemon):
    """An answer sampled as other tokens than the tokenizer's own (one character each here), then a
    template that trims the answer's last newline: the session's tokens are kept up to that newline and
    only the rest of the text is fed - not everything after the answer's start, where a fresh
    tokenization of the whole first differs."""
    from weaved.daemon.turns import Context, chat_turn_tokens

    tok = daemon.tokenizer

    def render(messages: list[dict]) -> str:  # a template that trims what it writes
        return "".join(f"<{m['role']}>{m['content'].strip()}</{m['role']}>" for m in messages) + "<assistant>"

    head = tok.encode("<user>Hi</user><assistant>", add_bos=False)
    answer = "Sure: the list.\n"
    sampled = [t for c in answer for t in tok.encode(c, add_bos=False)]
    assert sampled != tok.encode(answer, add_bos=False)  # (not the tokenizer's own)
    end = tok.encode("</assistant>", add_bos=False)
    view = Context(None, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": answer}],
                   head + sampled + end, [])
    new, keep = chat_turn_tokens(tok, view, [{"role": "user", "content": "More"}], render=render)
    assert keep == len(head) + len(sampled) - 1  # all but the trimmed newline
    assert tok.decode(new) == "</assistant><user>More</user><assistant>"
    assert tok.decode(view.committed[:keep] + new) == render([*view.messages, {"role": "user", "content": "More"}])
