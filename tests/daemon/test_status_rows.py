"""A status session row: the state of its turn, and how far a prompt being fed has come."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np

from weaved.daemon.status import session_status
from weaved.engine.sampling import SamplingParams
from weaved.engine.sequence import Sequence, SLARank


def _session(turn):
    return SimpleNamespace(id="s1", sla=SimpleNamespace(cls=SimpleNamespace(value="interactive")), pool="cpu",
                           kv_at="host", context_tokens=100, placement=SimpleNamespace(reasons=["first"]),
                           ephemeral=False, turn=turn)


def _turn(prompt: int) -> Sequence:
    kv = SimpleNamespace(length=0, data=np.zeros(1))
    return Sequence("s1", kv, list(range(prompt)), SamplingParams(max_tokens=4), SLARank.INTERACTIVE)


def test_a_prompt_being_fed_shows_its_progress_and_nothing_else_does():
    t = _turn(3000)
    row = session_status(_session(t), {}, time.monotonic())
    assert row["state"] == "waiting" and row["prefill"] is None  # queued: nothing fed yet
    del t.pending[:1024]
    t.prefilled = 1024
    row = session_status(_session(t), {}, time.monotonic())
    assert row["state"] == "waiting" and row["prefill"] == {"done": 1024, "total": 3000}
    t.pending[:] = [7]
    t.prefilled, t.first_token_at = 3000, time.monotonic()  # its first token: decoding now
    assert session_status(_session(t), {}, time.monotonic())["prefill"] is None
    assert session_status(_session(None), {}, time.monotonic())["prefill"] is None


def test_a_pools_rate_counts_only_the_tokens_inside_its_span():
    """A lone step polled a millisecond after it ended is no 64,000 tokens a second: the first step in
    the window only opens the span."""
    from types import SimpleNamespace

    from weaved.daemon.status import _tps

    engine = SimpleNamespace(now=lambda: 100.001, tps_window=[(100.0, 64)])
    assert _tps(engine) == 0.0
    engine.tps_window = [(99.0, 64), (99.5, 64), (100.0, 64)]
    assert abs(_tps(engine) - 128 / 1.001) < 1e-6

