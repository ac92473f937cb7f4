"""The journal's SQLite schema, how an older journal is brought up to it, and how token ids are stored.

Token ids are stored compactly: each commit appends one row of little-endian int32s keyed by
(session, first position), so a decode step writes a few bytes rather than rewriting a list, and
truncation only touches the rows at and after the cut.
"""

from __future__ import annotations

import sqlite3
import sys
from array import array
from pathlib import Path


class JournalError(Exception):
    """The journal file cannot be used (e.g. written by a newer version)."""


SCHEMA_VERSION = 5

# Statements are split on ";" (executescript would commit our transaction): keep ";" out of comments.
_SCHEMA = """
CREATE TABLE sessions (
    id          TEXT PRIMARY KEY,
    created     REAL NOT NULL,
    updated     REAL NOT NULL,
    sla         TEXT NOT NULL,              -- JSON: class, ttft_ms, ttlt_s, ...
    max_context INTEGER NOT NULL,
    system      TEXT,
    placement   TEXT,                       -- JSON (with its reasons) or NULL
    status      TEXT NOT NULL,
    kv_length   INTEGER NOT NULL DEFAULT 0, -- committed positions == number of committed token ids
    forked_from TEXT                        -- the session it was forked from (NULL: not a fork)
);
CREATE TABLE messages (
    session   TEXT NOT NULL,
    seq       INTEGER NOT NULL,
    role      TEXT NOT NULL,
    content   TEXT NOT NULL,
    token_ids BLOB,                         -- int32 little-endian, NULL when not tokenized
    kv_at     INTEGER NOT NULL,             -- committed KV length when the message was recorded
    created   REAL NOT NULL,
    finish_reason TEXT,                     -- an answer's: stop, length, cancelled, interrupted, ...
    extra     TEXT,                         -- JSON: tool_calls, tool_call_id, name, reasoning_content, answer
    PRIMARY KEY (session, seq)
) WITHOUT ROWID;
CREATE TABLE responses (
    id      TEXT PRIMARY KEY,               -- a stored /v1/responses answer: resp_...
    session TEXT NOT NULL,                  -- the session its chain continues in
    created REAL NOT NULL,
    body    TEXT NOT NULL,                  -- JSON: the response object as returned
    messages INTEGER                        -- its session's transcript length once it was answered
);
CREATE TABLE detached (
    session  TEXT PRIMARY KEY,              -- a session whose detached turn has not ended yet
    body     TEXT NOT NULL,                 -- JSON: the turn's request, to run again after a restart
    messages INTEGER NOT NULL               -- its session's transcript length before the turn
);
CREATE TABLE tokens (
    session TEXT NOT NULL,
    start   INTEGER NOT NULL,               -- position of the first id in this row
    ids     BLOB NOT NULL,                  -- int32 little-endian
    PRIMARY KEY (session, start)
) WITHOUT ROWID;
"""


def migrate(db: sqlite3.Connection, path: Path) -> None:
    """Create the schema in a new journal, or bring an older one up to ``SCHEMA_VERSION`` (inside the
    caller's transaction); JournalError for a journal a newer Weave wrote."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version == 0:
        for stmt in _SCHEMA.split(";"):
            if stmt.strip():
                db.execute(stmt)
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    elif version in (1, 2, 3, 4):
        # answers gained their finish reason (2); messages their extras and responses (3); a
        # response where its chain's transcript ended, a fork its parent (4); detached turns (5)
        if version == 1:
            db.execute("ALTER TABLE messages ADD COLUMN finish_reason TEXT")
        if version < 3:
            db.execute("ALTER TABLE messages ADD COLUMN extra TEXT")
            db.execute("CREATE TABLE responses (id TEXT PRIMARY KEY, session TEXT NOT NULL, "
                       "created REAL NOT NULL, body TEXT NOT NULL)")
        if version < 4:
            db.execute("ALTER TABLE responses ADD COLUMN messages INTEGER")
            db.execute("ALTER TABLE sessions ADD COLUMN forked_from TEXT")
        db.execute("CREATE TABLE detached (session TEXT PRIMARY KEY, body TEXT NOT NULL, "
                   "messages INTEGER NOT NULL)")
        db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    elif version != SCHEMA_VERSION:
        raise JournalError(f"journal {path} has schema version {version}; this Weave reads {SCHEMA_VERSION}")


def pack_ids(ids: list[int]) -> bytes:
    a = array("i", ids)  # int32
    if sys.byteorder == "big":
        a.byteswap()
    return a.tobytes()


def unpack_ids(blob: bytes) -> list[int]:
    a = array("i")
    a.frombytes(blob)
    if sys.byteorder == "big":
        a.byteswap()
    return a.tolist()
