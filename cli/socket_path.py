"""Where the daemon's Unix socket lives.  Imported by every client command, so it imports nothing heavy."""

from __future__ import annotations

import os
from pathlib import Path

SOCKET_NAME = "weave.sock"


def default_socket_path() -> Path:
    """``$WEAVE_SOCKET``, else ``$XDG_RUNTIME_DIR/weave/weave.sock``, else ``~/.weave/weave.sock``.

    A relative ``XDG_RUNTIME_DIR`` is ignored, as the XDG base directory specification asks.
    """
    if env := os.environ.get("WEAVE_SOCKET"):
        return Path(env).expanduser()
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime):
        return Path(runtime) / "weave" / SOCKET_NAME
    return Path.home() / ".weave" / SOCKET_NAME
