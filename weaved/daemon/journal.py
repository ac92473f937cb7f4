"""The journal: a SQLite record of every session, its transcript and its committed tokens.

What it holds: each session's SLA tags, max context, system prompt, placement (with its reasons),
status and times; the transcript (messages with the token ids they were rendered to); and the
session's committed tokens, whose count is the committed KV length.

The invariant the daemon relies on (docs/architecture.md, "KV cache"): a token is committed - its id appended and
``kv_length`` advanced - in one transaction, and only after the caller has written its KV rows.  So
after a crash every session resumes from ``kv_length`` with ``kv_length == len(tokens)`` and the KV
file holding valid rows for all of them.

Its schema and the storage of token ids: ``journal_schema``; stored responses and detached turns:
``journal_chains``.

Thread safety: one connection (``check_same_thread=False``) guarded by one lock.  The engine thread
commits and the API's event loop reads; every operation is short, so serialising them costs less than
the lock contention and busy-retries of several connections, and each read is one consistent
snapshot.  Other processes may open the same file: WAL lets their reads proceed during our writes.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from weaved.daemon.journal_chains import ChainRecords
from weaved.daemon.journal_schema import JournalError, migrate, pack_ids, unpack_ids
from weaved.errors import InsufficientStorage

__all__ = ["Journal", "JournalError", "JournalFull", "SessionRecord"]


class JournalFull(JournalError, InsufficientStorage):
    """A write found the data directory's disk full (nothing of it was kept)."""

    def __init__(self, message: str):
        InsufficientStorage.__init__(self, message)


@dataclass(frozen=True)
class SessionRecord:
    id: str
    sla: dict
    max_context: int
    system: str | None
    placement: dict | None
    status: str
    created: float
    updated: float
    kv_length: int
    tokens: list[int]  # committed token ids; len(tokens) == kv_length
    # {"seq", "role", "content", "token_ids" (list | None), "kv_at", "created", "finish_reason" (None but
    # for answers)} and a message's extras ("tool_calls", "tool_call_id", "name", "reasoning_content")
    messages: list[dict]
    forked_from: str | None = None  # the session it was forked from


class Journal(ChainRecords):
    """Session store over one SQLite file in WAL mode."""

    def __init__(self, path: Path, *, fsync: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self.lost_said = False  # the file was found removed while open (said once in the log)
        new = not self.path.exists()
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, so a transaction is exactly what we say.
        self._db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=10.0)
        if new:  # transcripts are the user's alone (SQLite gives its -wal and -shm files the same mode)
            self.path.chmod(0o600)
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a commit is appended to the WAL but fsynced only at checkpoints.  It
        # survives the daemon being killed (the WAL is in the OS's page cache and is replayed on open)
        # and can never corrupt the database; only a power loss may drop the last few commits, which
        # rolls sessions back consistently (tokens and kv_length together).  FULL would cost an fsync
        # per committed token.
        # With ``fsync`` (the profile's durability "fsync") every commit is fsynced: FULL.
        self._db.execute(f"PRAGMA synchronous={'FULL' if fsync else 'NORMAL'}")
        with self._tx():
            migrate(self._db, self.path)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One transaction under the lock.  IMMEDIATE takes the write lock up front so a read-then-write
        (e.g. checking kv_length before appending) cannot race another process's writer."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
                self._db.execute("COMMIT")
                if not self.lost_said and not self.path.exists():
                    self._said_lost()
            except BaseException as e:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                if isinstance(e, sqlite3.Error) and getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
                    raise JournalFull(f"the journal ({self.path}) could not be written: its disk is full") from e
                raise

    def _said_lost(self) -> None:
        """The file was removed behind the daemon: SQLite goes on writing the removed file, so nothing
        fails now, but nothing recorded survives a restart - said once, loudly."""
        self.lost_said = True
        logging.getLogger("weave.daemon").error(
            "the journal %s was removed while the daemon runs: what it records now is lost at the next stop, and "
            "the next start refuses the KV files it leaves without one; restore it from a backup, or stop the "
            "daemon and move its kv directory aside", self.path)

    def _kv_length(self, db: sqlite3.Connection, id: str) -> int:
        row = db.execute("SELECT kv_length FROM sessions WHERE id=?", (id,)).fetchone()
        if row is None:
            raise KeyError(f"no session {id!r} in the journal")
        return row[0]

    # -- sessions ----------------------------------------------------------------------------------

    def create_session(
        self, id: str, sla: dict, max_context: int, system: str | None, placement: dict | None,
        status: str = "active", forked_from: str | None = None,
    ) -> None:
        now = time.time()
        with self._tx() as db:
            if db.execute("SELECT 1 FROM sessions WHERE id=?", (id,)).fetchone():
                raise ValueError(f"session {id!r} already exists in the journal")
            db.execute(
                "INSERT INTO sessions (id, created, updated, sla, max_context, system, placement, status, forked_from)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (id, now, now, json.dumps(sla), max_context, system,
                 None if placement is None else json.dumps(placement), status, forked_from),
            )

    def _set(self, id: str, column: str, value: object) -> None:
        with self._tx() as db:
            cur = db.execute(
                f"UPDATE sessions SET {column}=?, updated=? WHERE id=?", (value, time.time(), id)
            )
            if cur.rowcount == 0:
                raise KeyError(f"no session {id!r} in the journal")

    def set_placement(self, id: str, placement: dict | None) -> None:
        self._set(id, "placement", None if placement is None else json.dumps(placement))

    def set_status(self, id: str, status: str) -> None:
        self._set(id, "status", status)

    def set_system(self, id: str, system: str | None) -> None:
        self._set(id, "system", system)

    def set_sla(self, id: str, sla: dict) -> None:
        self._set(id, "sla", json.dumps(sla))

    def delete(self, id: str) -> None:
        """Forget a session entirely (no error if it is unknown)."""
        with self._tx() as db:
            for table, key in (("tokens", "session"), ("messages", "session"), ("responses", "session"),
                               ("detached", "session"), ("sessions", "id")):
                db.execute(f"DELETE FROM {table} WHERE {key}=?", (id,))

    # -- transcript and tokens ---------------------------------------------------------------------

    def _append_message(self, id: str, role: str, content: str, token_ids: list[int] | None,
                        finish_reason: str | None = None, extra: dict | None = None) -> int:
        with self._tx() as db:
            return self._insert_message(db, id, role, content, token_ids, finish_reason, extra)

    def _insert_message(self, db: sqlite3.Connection, id: str, role: str, content: str,
                        token_ids: list[int] | None, finish_reason: str | None = None,
                        extra: dict | None = None) -> int:
        now = time.time()
        kv_at = self._kv_length(db, id)
        (seq,) = db.execute("SELECT COALESCE(MAX(seq), -1) + 1 FROM messages WHERE session=?", (id,)).fetchone()
        db.execute(
            "INSERT INTO messages (session, seq, role, content, token_ids, kv_at, created, finish_reason, extra)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (id, seq, role, content, None if token_ids is None else pack_ids(token_ids), kv_at, now,
             finish_reason, None if not extra else json.dumps(extra, ensure_ascii=False)),
        )
        db.execute("UPDATE sessions SET updated=? WHERE id=?", (now, id))
        return seq

    def add_turn_input(self, id: str, messages: list[tuple[str, str, list[int] | None, dict | None]],
                       detached: tuple[dict, int] | None = None) -> None:
        """Record a turn's input in one transaction - its messages (role, content, token ids, extra) and,
        for a detached turn, its request and the transcript's length before it - or nothing of it."""
        with self._tx() as db:
            if detached is not None:
                self._set_detached(db, id, *detached)
            for role, content, token_ids, extra in messages:
                self._insert_message(db, id, role, content, token_ids, extra=extra)

    def add_message(self, id: str, role: str, content: str, token_ids: list[int] | None,
                    extra: dict | None = None) -> int:
        """Record one of a turn's input messages (before any work on it; ``extra``: its tool calls, the
        call it answers, ...); returns its sequence number."""
        return self._append_message(id, role, content, token_ids, extra=extra)

    def finish_message(self, id: str, role: str, content: str, token_ids: list[int] | None = None,
                       finish_reason: str | None = None, extra: dict | None = None) -> int:
        """Record the reply once the turn ends (its tokens are already committed), with why it ended
        (``extra``: its parsed form)."""
        return self._append_message(id, role, content, token_ids, finish_reason, extra)

    def commit_tokens(self, id: str, token_ids: list[int], new_kv_length: int) -> None:
        """Append ``token_ids`` and advance ``kv_length`` to ``new_kv_length`` in one transaction.

        Call only after their KV rows are written.  ``new_kv_length`` must be the old length plus
        ``len(token_ids)``: a mismatch means the caller and the journal disagree, and nothing changes.
        """
        with self._tx() as db:
            old = self._kv_length(db, id)
            if new_kv_length != old + len(token_ids):
                raise ValueError(
                    f"session {id!r}: committing {len(token_ids)} tokens at kv_length {old} cannot "
                    f"reach {new_kv_length}"
                )
            if not token_ids:
                return
            db.execute(
                "INSERT INTO tokens (session, start, ids) VALUES (?, ?, ?)", (id, old, pack_ids(token_ids))
            )
            db.execute(
                "UPDATE sessions SET kv_length=?, updated=? WHERE id=?", (new_kv_length, time.time(), id)
            )

    def truncate(self, id: str, kv_length: int) -> None:
        """Forget committed tokens from position ``kv_length`` on (mirrors ``KVCache.truncate``)."""
        with self._tx() as db:
            self._truncate(db, id, kv_length)

    def _truncate(self, db: sqlite3.Connection, id: str, kv_length: int) -> None:
        old = self._kv_length(db, id)
        if not 0 <= kv_length <= old:
            raise ValueError(f"session {id!r}: cannot truncate kv_length {old} to {kv_length}")
        db.execute("DELETE FROM tokens WHERE session=? AND start>=?", (id, kv_length))
        row = db.execute(
            "SELECT start, ids FROM tokens WHERE session=? AND start<? ORDER BY start DESC LIMIT 1",
            (id, kv_length),
        ).fetchone()
        if row is not None and row[0] + len(row[1]) // 4 > kv_length:  # the cut falls inside this row
            db.execute(
                "UPDATE tokens SET ids=? WHERE session=? AND start=?",
                (row[1][: (kv_length - row[0]) * 4], id, row[0]),
            )
        db.execute("UPDATE sessions SET kv_length=?, updated=? WHERE id=?", (kv_length, time.time(), id))

    def rewind(self, id: str, messages: int, kv_length: int) -> None:
        """Forget the transcript from message ``messages`` on and the committed tokens from position
        ``kv_length`` on, in one transaction (a session taken back to an earlier turn's end)."""
        with self._tx() as db:
            self._truncate(db, id, kv_length)
            db.execute("DELETE FROM messages WHERE session=? AND seq>=?", (id, messages))

    # -- reads -------------------------------------------------------------------------------------

    def _record(self, db: sqlite3.Connection, row: tuple, with_tokens: bool) -> SessionRecord:
        id, created, updated, sla, max_context, system, placement, status, kv_length, forked_from = row
        tokens: list[int] = []
        if with_tokens:
            blobs = db.execute("SELECT ids FROM tokens WHERE session=? ORDER BY start", (id,)).fetchall()
            tokens = unpack_ids(b"".join(b for (b,) in blobs))
        messages = [
            {"seq": seq, "role": role, "content": content, "token_ids": None if ids is None else unpack_ids(ids),
             "kv_at": kv_at, "created": mcreated, "finish_reason": finish, **(json.loads(extra) if extra else {})}
            for seq, role, content, ids, kv_at, mcreated, finish, extra in db.execute(
                "SELECT seq, role, content, token_ids, kv_at, created, finish_reason, extra FROM messages"
                " WHERE session=? ORDER BY seq", (id,))
        ]
        return SessionRecord(
            id=id, sla=json.loads(sla), max_context=max_context, system=system,
            placement=None if placement is None else json.loads(placement), status=status,
            created=created, updated=updated, kv_length=kv_length, tokens=tokens, messages=messages,
            forked_from=forked_from,
        )

    _COLUMNS = "id, created, updated, sla, max_context, system, placement, status, kv_length, forked_from"

    @contextmanager
    def _snapshot(self) -> Iterator[sqlite3.Connection]:
        """A read transaction: every query inside sees the same committed state."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                yield self._db
            finally:
                self._db.execute("COMMIT")

    def get(self, id: str) -> SessionRecord | None:
        with self._snapshot() as db:
            row = db.execute(f"SELECT {self._COLUMNS} FROM sessions WHERE id=?", (id,)).fetchone()
            return None if row is None else self._record(db, row, with_tokens=True)

    def list(self, with_tokens: bool = True,
             damaged: Callable[[str, Exception], None] | None = None) -> list[SessionRecord]:
        """Every session, oldest first.  ``with_tokens=False`` leaves ``tokens`` empty (cheap listing;
        ``kv_length`` still says how many are committed).  ``damaged(id, error)``: a session whose record
        cannot be read (a field that is not its JSON) is left out and reported, not the whole list."""
        with self._snapshot() as db:
            rows = db.execute(f"SELECT {self._COLUMNS} FROM sessions ORDER BY created, id").fetchall()
            out = []
            for row in rows:
                try:
                    out.append(self._record(db, row, with_tokens))
                except (ValueError, TypeError) as e:
                    if damaged is None:
                        raise
                    damaged(row[0], e)
            return out

    def close(self) -> None:
        with self._lock:
            self._db.close()
