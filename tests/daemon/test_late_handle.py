"""An n>1 request's later choices start once choice 0 has prefilled: a client that goes away while one
is starting still cancels it."""

from __future__ import annotations

from types import SimpleNamespace


def test_a_choice_cancelled_while_its_turn_starts_is_cancelled_once_it_has_started():
    from weaved.daemon.choices import LateHandle

    cancelled = []
    lh = LateHandle()
    lh.cancel()  # the client went away between the check and the start
    lh.set(SimpleNamespace(cancel=lambda: cancelled.append(1)))
    assert cancelled == [1]
