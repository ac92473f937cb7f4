"""``n`` > 1: several answers to one prompt from one prefill - the other choices are forks of the first.

Choice 0 runs as any turn, in a throwaway session.  When it has fed its whole prompt (its first token is
sampled), choices 1..n-1 start, each in its own throwaway session that shares choice 0's context but the
prompt's last token (full blocks through a prefix file, the rest of the rows copied) and feeds that one
token: its logits row is bit for bit choice 0's, and each choice samples from it with its own seed.  A
constrained answer (tools, response_format) gives each choice its own grammar state from the answer's
start, compiled from choice 0's answer plan.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace

from weaved.daemon.turns import TurnHandle
from weaved.engine.sampling import SamplingParams
from weaved.errors import InvalidRequest, WeaveError
from weaved.kv.cache import KVCache
from weaved.kv.errors import KVStoreError
from weaved.routing.types import SLA, SLAClass

log = logging.getLogger("weave.daemon")

MAX_CHOICES = 16
_GOLDEN = 0x9E3779B97F4A7C15


def choice_seed(seed: int | None, k: int) -> int | None:
    """Choice ``k``'s seed from the request's (the same request, the same n answers; None stays random)."""
    return None if seed is None else (seed + k * _GOLDEN) % 2**64


class LateHandle:
    """A choice's turn handle before its turn has started (it starts once choice 0 has prefilled):
    ``wait`` gives the handle; ``cancel`` before then keeps the choice from starting."""

    def __init__(self):
        self._ready = threading.Event()
        self._lock = threading.Lock()  # a cancel and the handle's arrival: whichever comes second acts
        self.handle: TurnHandle | None = None
        self.cancelled = False

    def set(self, handle: TurnHandle | None) -> None:
        with self._lock:
            self.handle = handle
            late_cancel = self.cancelled and handle is not None  # cancelled while the turn was starting
        self._ready.set()
        if late_cancel:
            handle.cancel()

    @property
    def ready(self) -> bool:
        """Whether ``set`` has been called (a handle, or None for a choice that did not start)."""
        return self._ready.is_set()

    def wait(self, timeout: float | None = None) -> TurnHandle | None:
        self._ready.wait(timeout)
        return self.handle

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            handle = self.handle
        if handle is not None:
            handle.cancel()


class TurnChoices:
    """``Daemon.start_choices`` (a mixin of the daemon)."""

    def start_choices(self, n: int, *, messages: list[dict] | None = None, prompt: str | list[int] | None = None,
                      params: SamplingParams, sla: SLA | None = None, emits: list[Callable[[dict], None]],
                      answer=None) -> tuple[TurnHandle, list[LateHandle]]:
        """Start ``n`` answers to one prompt (no session): choice 0's handle now, the others' once it
        has prefilled.  A choice that cannot start emits an error event."""
        if not 2 <= n <= MAX_CHOICES:
            raise InvalidRequest(f"n must be between 1 and {MAX_CHOICES}", param="n")
        late = [LateHandle() for _ in range(n - 1)]
        started, first_handle = threading.Event(), LateHandle()

        def first(ev: dict) -> None:  # choice 0's events (engine thread)
            if not started.is_set() and ev["type"] in ("token", "done", "error"):
                started.set()
                if ev["type"] == "token":
                    try:
                        self._start_forks(first_handle.wait(), late, params, sla, emits)
                    except Exception:  # a bug: the choices not started yet fail, none is left waiting
                        log.exception("starting the other choices failed")
                        for k, lh in enumerate(late, start=1):
                            if not lh.ready:
                                lh.set(None)
                                emits[k]({"type": "error", "message": "this choice could not start", "status": 500})
                else:  # choice 0 ended without a token: the others cannot share its prompt
                    for k, lh in enumerate(late, start=1):
                        lh.set(None)
                        emits[k]({"type": "error", "message": "the first choice ended before its prompt was fed",
                                  "status": 500})
            emits[0](ev)

        p0 = replace(params, seed=choice_seed(params.seed, 0)) if params.seed is not None else params
        handle0 = None
        try:
            handle0 = self.start_turn(session_id=None, messages=messages, prompt=prompt, params=p0, sla=sla,
                                      emit=first, answer=answer)
        finally:
            first_handle.set(handle0)  # choice 0's first event waits for it
        return handle0, late

    def _start_forks(self, handle0: TurnHandle | None, late: list[LateHandle], params: SamplingParams, sla: SLA | None,
                     emits: list[Callable[[dict], None]]) -> None:
        """Choices 1..n-1 as forks of choice 0 right after its prompt (engine thread of choice 0)."""
        with self._lock:
            s0 = self.sessions.get(handle0.session_id) if handle0 is not None else None
            tokens = list(s0.committed) if s0 is not None else []
        if s0 is not None and isinstance(s0.kv, KVCache) and len(tokens) > 1:
            # the prompt's full blocks as a prefix file, copied once and not under the daemon's lock (the
            # forks below then only map it); choice 0's session is this turn's alone, its rows are fed
            try:
                self.store.publish_prefix(s0.kv, tokens[:-1])
            except (KVStoreError, OSError):  # no prefix file (e.g. a full disk): each fork copies its rows
                pass
        for k, lh in enumerate(late, start=1):
            if lh.cancelled or s0 is None or not isinstance(s0.kv, KVCache) or not tokens:
                lh.set(None)
                emits[k]({"type": "error", "message": "this choice could not start", "status": 500})
                continue
            child = None
            try:
                info = self.create_session(sla or SLA(SLAClass.INTERACTIVE), s0.max_context, None, ephemeral=True)
                with self._lock:
                    child = self.sessions[info["id"]]
                    self.store.fork_prefix(s0.kv, child.kv, tokens[:-1])
                    child.committed.extend(tokens[:-1])
                pk = replace(params, seed=choice_seed(params.seed, k)) if params.seed is not None else params
                lh.set(self.start_turn(session_id=info["id"], prompt=tokens[-1:], params=pk, sla=sla,
                                       emit=emits[k], answer_plan=handle0.answer))
            except WeaveError as e:
                lh.set(None)
                emits[k]({"type": "error", "message": e.message, "status": e.status})
            except (KVStoreError, OSError) as e:  # the KV cap or the disk: the server's capacity
                if child is not None:
                    self._drop_ephemeral(child)
                lh.set(None)
                emits[k]({"type": "error", "message": f"this choice could not start: {e}", "status": 503})
