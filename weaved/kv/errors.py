"""The KV store's errors (``weaved.kv.store`` re-exports them)."""

from __future__ import annotations

import errno

from weaved.errors import InsufficientStorage, Overloaded

DISK_FULL = {errno.ENOSPC, errno.EDQUOT}  # the errors of a file system that has no room


class KVStoreError(Exception):
    """A KV file operation failed; the message says which session and why."""


class KVFileLost(KVStoreError):
    """A running session's KV file is gone (removed behind the daemon's back): its turns are refused (409)
    until it is deleted, or the daemon restarts and rebuilds it from the journal."""

    http_status = 409


class KVFileMismatch(KVStoreError):
    """A session's KV file was made for another model (or format): it is kept for the daemon that serves
    that model, never rebuilt over."""


class KVCapExceeded(KVStoreError, Overloaded):
    """Reserving more positions would exceed the store's cap on total KV bytes."""

    http_status = 503  # the node is full: retry later, or free sessions

    def __init__(self, message: str, *, retryable: bool = True):
        Overloaded.__init__(self, message, code="kv_cap_exceeded", retry_after_s=5.0, retryable=retryable)


class DiskFull(KVStoreError, InsufficientStorage):
    """The file system could not allocate blocks for the positions to be written."""

    def __init__(self, message: str):
        InsufficientStorage.__init__(self, message)
