"""The peers added at run time (``weave peers add``), kept in the data directory so they survive a restart.

One JSON file, ``<data_dir>/peers.json``: ``{"version": 1, "peers": [{"name", "url", "token"}]}``.  It
holds the shared tokens, so it is created with mode 0600 and replaced atomically (a temporary file
in the same directory, fsync, rename): a crash mid-write leaves the old list, never half a file.
Profile peers are never written here; the profile stays their only source.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from weaved.config.profile import PeerConfig
from weaved.config.tables import Invalid

FILE_NAME = "peers.json"
VERSION = 1


def load_peers(path: Path, log: Callable[[str], None] = print) -> list[PeerConfig]:
    """The peers saved at ``path`` (none when the file does not exist).  A damaged file or entry is
    reported through ``log`` and skipped: a bad list must not keep the daemon from starting."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError, ValueError) as e:
        log(f"run-time peers not restored: cannot read {path}: {e}")
        return []
    if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("peers"), list):
        log(f"run-time peers not restored: {path} is not a version-{VERSION} peer list")
        return []
    peers: list[PeerConfig] = []
    for i, entry in enumerate(data["peers"]):
        try:
            if not isinstance(entry, dict):
                raise TypeError("not an object")
            peers.append(PeerConfig(str(entry["name"]), str(entry["url"]), str(entry["token"])))
        except (KeyError, TypeError, Invalid) as e:
            log(f"run-time peer #{i} in {path} skipped: {e}")
    return peers


def save_peers(path: Path, peers: list[PeerConfig]) -> None:
    """Replace the list at ``path`` (mode 0600) with ``peers``; OSError when the disk refuses."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"version": VERSION, "peers": [{"name": p.name, "url": p.url, "token": p.token} for p in peers]}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(body, f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)  # O_CREAT's mode is masked by the umask, and an old tmp may have another
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
