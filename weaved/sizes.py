"""Byte counts as people read them in the daemon's messages (the CLI has its own table formatting)."""

from __future__ import annotations


def human_size(n: float) -> str:
    """``n`` bytes in the largest binary unit it reaches: ``1.50 GiB``, ``40.00 MiB``, ``512 B``."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
