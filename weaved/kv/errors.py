"""The KV store's errors (``weaved.kv.store`` re-exports them)."""

from __future__ import annotations


class KVStoreError(Exception):
    """A KV file operation failed; the message says which session and why."""


class KVCapExceeded(KVStoreError):
    """Reserving more positions would exceed the store's cap on total KV bytes."""

    http_status = 503  # the node is full: retry later, or free sessions


class DiskFull(KVStoreError):
    """The file system could not allocate blocks for the positions to be written."""
