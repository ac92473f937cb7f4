"""An n>1 request's later choices start once choice 0 has prefilled: a client that goes away while one
is starting still cancels it."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from tests.daemon.support import GREEDY


def test_a_choice_cancelled_while_its_turn_starts_is_cancelled_once_it_has_started():
    from weaved.daemon.choices import LateHandle

    cancelled = []
    lh = LateHandle()
    lh.cancel()  # the client went away between the check and the start
    lh.set(SimpleNamespace(cancel=lambda: cancelled.append(1)))
    assert cancelled == [1]


def test_a_bug_while_the_other_choices_start_fails_them_and_leaves_none_waiting(daemon, monkeypatch):
    """Starting choices 1..n-1 fails unexpectedly: each of them ends with an error event (its stream ends),
    and choice 0 runs to its end."""
    def broken(*args, **kw):
        raise RuntimeError("a bug")

    monkeypatch.setattr(daemon, "_start_forks", broken)
    ends = [threading.Event() for _ in range(3)]
    last: list[dict | None] = [None] * 3

    def emit(k):
        def on(ev: dict) -> None:
            if ev["type"] in ("done", "error"):
                last[k] = ev
                ends[k].set()
        return on

    daemon.start_choices(3, messages=[{"role": "user", "content": "hi"}], params=GREEDY,
                         emits=[emit(k) for k in range(3)])
    assert all(e.wait(60) for e in ends)
    assert last[0]["type"] == "done"
    assert [ev["type"] for ev in last[1:]] == ["error", "error"]
