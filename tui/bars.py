"""Text gauges for the panels: horizontal bars and one-character level blocks."""

from __future__ import annotations

BLOCKS = " ▁▂▃▄▅▆▇█"


def bar(percent: float, width: int) -> str:
    """``████▌░░░░░``: ``percent`` (0-100) of ``width`` cells, in eighths of a cell."""
    p = min(max(percent, 0.0), 100.0) / 100.0
    eighths = round(p * width * 8)
    full, part = divmod(eighths, 8)
    partial = " ▏▎▍▌▋▊▉"[part] if part and full < width else ""
    return ("█" * full + partial).ljust(width, "░")[:width]


def level(percent: float) -> str:
    """One character whose height shows ``percent`` (0-100)."""
    p = min(max(percent, 0.0), 100.0)
    return BLOCKS[round(p / 100 * (len(BLOCKS) - 1))]


def style_for(percent: float) -> str:
    """A colour for a load: calm, busy, saturated."""
    return "green" if percent < 60 else "yellow" if percent < 85 else "red"
