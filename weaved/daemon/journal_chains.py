"""The journal's records of Responses chains and detached turns, beside each session's own.

A mixin of ``Journal``: it reads and writes through the journal's ``_tx`` (one write transaction under
its lock) and ``_snapshot`` (one consistent read).
"""

from __future__ import annotations

import json
import sqlite3
import time
from contextlib import AbstractContextManager


class ChainRecords:
    """Stored ``/v1/responses`` answers (where each chain's transcript ended) and detached turns (their
    requests, to run again after a restart that cut them)."""

    def _tx(self) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError

    def _snapshot(self) -> AbstractContextManager[sqlite3.Connection]:
        raise NotImplementedError

    # -- detached turns: run again after a restart that cut them ------------------------------------

    def set_detached(self, session: str, body: dict, messages: int) -> None:
        """Record ``session``'s detached turn (its request ``body``; the transcript's length before it)
        until ``drop_detached``: a stop or a crash in between leaves it here to be run again."""
        with self._tx() as db:
            self._set_detached(db, session, body, messages)

    def _set_detached(self, db: sqlite3.Connection, session: str, body: dict, messages: int) -> None:
        db.execute("INSERT OR REPLACE INTO detached (session, body, messages) VALUES (?, ?, ?)",
                   (session, json.dumps(body, ensure_ascii=False), messages))

    def drop_detached(self, session: str) -> None:
        with self._tx() as db:
            db.execute("DELETE FROM detached WHERE session=?", (session,))

    def detached(self) -> list[tuple[str, dict, int]]:
        """(session, request body, transcript length before the turn) of every detached turn not ended."""
        with self._snapshot() as db:
            rows = db.execute("SELECT session, body, messages FROM detached ORDER BY rowid").fetchall()
        return [(sid, json.loads(body), n) for sid, body, n in rows]

    # -- stored responses (/v1/responses chains) -----------------------------------------------------

    def add_response(self, id: str, session: str, body: dict, messages: int | None = None) -> None:
        """Store a response of ``session``'s chain; ``messages``: the session's transcript length with
        its answer (what a continuation of it starts from)."""
        with self._tx() as db:
            db.execute("INSERT INTO responses (id, session, created, body, messages) VALUES (?, ?, ?, ?, ?)",
                       (id, session, time.time(), json.dumps(body, ensure_ascii=False), messages))

    def response_end(self, id: str) -> int | None:
        """The transcript length of its session when response ``id`` was stored (None: unknown, or
        stored by a Weave that did not record it)."""
        with self._snapshot() as db:
            row = db.execute("SELECT messages FROM responses WHERE id=?", (id,)).fetchone()
        return None if row is None else row[0]

    def get_response(self, id: str) -> tuple[str, dict] | None:
        """(session, body) of a stored response, or None (unknown or deleted)."""
        with self._snapshot() as db:
            row = db.execute("SELECT session, body FROM responses WHERE id=? AND body != ''", (id,)).fetchone()
        return None if row is None else (row[0], json.loads(row[1]))

    def latest_response(self, session: str) -> str | None:
        """The id of the last response stored in ``session``'s chain - deleted or not: the session's
        context holds its turn either way, so no earlier response can continue the chain."""
        with self._snapshot() as db:
            row = db.execute("SELECT id FROM responses WHERE session=? ORDER BY created DESC, rowid DESC LIMIT 1",
                             (session,)).fetchone()
        return None if row is None else row[0]

    def delete_response(self, id: str) -> int:
        """Delete a stored response (its row stays, emptied, as its chain's record of where it went);
        the number of its chain's responses still stored."""
        with self._tx() as db:
            row = db.execute("SELECT session FROM responses WHERE id=?", (id,)).fetchone()
            db.execute("UPDATE responses SET body='' WHERE id=?", (id,))
            if row is None:
                return 0
            (left,) = db.execute("SELECT COUNT(*) FROM responses WHERE session=? AND body != ''", row).fetchone()
        return left

    def stored_responses(self, session: str) -> int:
        """How many stored (not deleted) responses session ``session``'s chain holds."""
        with self._snapshot() as db:
            (n,) = db.execute("SELECT COUNT(*) FROM responses WHERE session=? AND body != ''", (session,)).fetchone()
        return n

    def chain_sessions(self) -> set[str]:
        """The sessions that hold a /v1/responses chain (any response stored in them, deleted or not)."""
        with self._snapshot() as db:
            return {r[0] for r in db.execute("SELECT DISTINCT session FROM responses")}
