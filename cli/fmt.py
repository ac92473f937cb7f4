"""Plain-text formatting for the client commands and ``weave top``: tables, sizes, durations, placements.

No rich here on purpose: the commands print aligned columns a script can also cut, and start fast.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

DASH = "-"
# What a terminal would act on rather than show: C0 controls but newline and tab (ESC starts escape
# sequences that move the cursor, retitle the window or write to the clipboard), DEL, the C1 controls
# (U+009B is a one-character CSI to some terminals) and the bidirectional overrides that reorder text
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` safe to print on a terminal: each control character shown as its escape (``\\x1b``,
    ``\\u202e``), newlines and tabs kept.  For everything that came from the daemon or a model."""
    return _UNPRINTABLE.sub(_escape, text)


def _escape(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, width: int | None = None,
          right: Sequence[int] = ()) -> str:
    """Columns aligned on two spaces; ``None`` cells print as ``-``; columns in ``right`` are right-aligned.

    With ``width`` the last column is cut to fit (with an ellipsis); otherwise nothing is cut.
    """
    cells = [[DASH if c is None else printable(str(c)) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = []
    for row in [list(headers), *cells]:
        parts = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        parts[-1] = row[-1]  # no trailing padding
        line = "  ".join(parts)
        if width is not None and len(line) > width:
            line = line[: max(width - 1, 0)] + "…"
        lines.append(line)
    return "\n".join(lines)


def size(n: float | None) -> str:
    """Bytes in binary units: ``512 B``, ``1.5 KiB``, ``3.2 GiB``."""
    if n is None:
        return DASH
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def seconds(s: float | None) -> str:
    """``850ms``, ``12.5s``, ``3m20s``, ``2h05m``; ``-`` for None."""
    if s is None:
        return DASH
    sign, s = ("-" if s < 0 else ""), abs(s)
    if s < 1:
        return f"{sign}{s * 1000:.0f}ms"
    if s < 60:
        return f"{sign}{s:.1f}s"
    if s < 3600:
        return f"{sign}{int(s // 60)}m{int(s % 60):02d}s"
    return f"{sign}{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def rate(tps: float | None) -> str:
    return DASH if tps is None else f"{tps:.1f}"


def state_of(session: dict) -> str | None:
    """A status session row's state as shown: ``prefill:2048/8192`` while its prompt is being fed (the
    row's state is ``waiting`` then, as it is in the queue; one word, so a table splits on whitespace)."""
    state, p = session.get("state"), session.get("prefill")
    if state and isinstance(p, dict) and p.get("total"):
        return f"prefill:{p.get('done', 0)}/{p['total']}"
    return state


def placement_summary(placement: dict | None) -> str:
    """``pool cpu (standard prefill, standard decode): reason; reason``."""
    if not placement:
        return "no placement"
    pool = placement.get("decode_pool", "?")
    prefill, decode = placement.get("prefill_strategy"), placement.get("decode_strategy")
    head = f"pool {pool}"
    if prefill and decode:
        head += f" ({prefill} prefill" + (f" on {placement['prefill_pool']}"
                                          if placement.get("prefill_pool") not in (None, pool) else "")
        head += f", {decode} decode)"
    reasons = "; ".join(placement.get("reasons") or ())
    return f"{head}: {reasons}" if reasons else head


def sla_summary(sla: dict | None) -> str:
    """``interactive, TTFT 500ms, TTLT 30.0s``."""
    if not sla:
        return DASH
    parts = [str(sla.get("class") or DASH)]
    if sla.get("ttft_ms") is not None:
        parts.append(f"TTFT {seconds(sla['ttft_ms'] / 1000)}")
    if sla.get("ttlt_s") is not None:
        parts.append(f"TTLT {seconds(sla['ttlt_s'])}")
    return ", ".join(parts)


def variant(v: dict) -> str:
    """``max 64, chunk 256, speculative``: the pool's engine variant in a few words."""
    parts = []
    if v.get("max_batch") is not None:
        parts.append(f"max {v['max_batch']}")
    if v.get("prefill_chunk") is not None:
        parts.append(f"chunk {v['prefill_chunk']}")
    if v.get("speculative"):
        parts.append("speculative")
    return ", ".join(parts) or DASH


def peer_text(p: dict) -> str:
    """``b http://10.0.0.2:7411 (alive, 0.4ms, 30/30 layers, 12.0 GiB KV free)``; a peer that is not
    alive ends with its last error."""
    state = p.get("state") or ("alive" if p.get("alive") else "down" if "alive" in p else None)
    parts = [state or "unknown"]
    if p.get("latency_ms") is not None:
        parts.append(f"{p['latency_ms']:.1f}ms")
    layers = p.get("layers") or {}
    if state == "alive" and layers.get("of"):
        parts.append(f"{layers.get('count', 0)}/{layers['of']} layers")
    kv = p.get("kv") or {}
    if state == "alive" and kv.get("free_bytes") is not None:
        parts.append(f"{size(kv['free_bytes'])} KV free")
    err = p.get("last_error") if state != "alive" else None
    text = f"{p.get('name', '?')} {p.get('url', '')} ({', '.join(parts)})".replace("  ", " ")
    return f"{text}: {err}" if err else text
