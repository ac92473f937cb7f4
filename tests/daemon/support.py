"""What the daemon's in-process tests share: a loaded daemon on a test model, a turn run to its end, a
turn's events as a client reads them, the events published, and a wait on what another process commits."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from weaved.config.load import load_profile
from weaved.daemon.core import Daemon
from weaved.daemon.journal import Journal, SessionRecord
from weaved.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0)


def recent_events(d: Daemon, n: int = 200) -> list[dict]:
    """The last ``n`` events the daemon published (its backlog; no loop attached: nothing live)."""
    sub = d.subscribe(backlog=n)
    return [sub.queue.get_nowait()[1] for _ in range(sub.queue.qsize())]


def make_daemon(model: Path, data_dir: Path, log_fn=lambda m: None) -> Daemon:
    d = Daemon(load_profile("cpu-only"), model, data_dir=data_dir, log_fn=log_fn)
    d.load()
    return d


def run_turn(d: Daemon, sid: str | None, text: str, params: SamplingParams = GREEDY) -> tuple[list[dict], object]:
    return run_to_end(d, session_id=sid, messages=[{"role": "user", "content": text}], params=params)


def run_to_end(d: Daemon, **turn) -> tuple[list[dict], object]:
    """``d.start_turn(**turn)`` run to its end: its events and its handle."""
    done = threading.Event()
    events: list[dict] = []

    def emit(ev: dict) -> None:
        events.append(ev)
        if ev["type"] in ("done", "error"):
            done.set()

    h = d.start_turn(**turn, emit=emit)
    assert done.wait(120), "turn did not finish"
    return events, h


def prefilled(d: Daemon) -> int:
    return sum(e.counters.tokens_prefilled for e in d.engines.values())


LONG = SamplingParams(max_tokens=1000, temperature=0, ignore_eos=True)


class Stream:
    """A turn's events as a client reads them, with a wait for its first token and for its end."""

    def __init__(self, hold: bool = False) -> None:
        self.events: list[dict] = []
        self.first = threading.Event()
        self.done = threading.Event()
        self.go = threading.Event()  # with hold: the engine thread waits in the first token for this
        if not hold:
            self.go.set()

    def __call__(self, ev: dict) -> None:  # the engine thread
        self.events.append(ev)
        if ev["type"] == "token" and not self.first.is_set():
            self.first.set()
            self.go.wait(30)
        if ev["type"] in ("done", "error"):
            self.done.set()


def wait_for_commits(journal: Path, sid: str, done: Callable[[SessionRecord], bool],
                     timeout_s: float = 120.0) -> None:
    """Read the journal another process (a daemon about to be killed) writes, until session ``sid``'s
    record satisfies ``done`` or ``timeout_s`` passes (bounded; the caller checks what it needs)."""
    j = Journal(journal)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rec = j.get(sid)
            if rec is not None and done(rec):
                return
            time.sleep(0.05)
    finally:
        j.close()
