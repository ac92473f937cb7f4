"""A JSON string's body decoded as it arrives, piece by piece: the text answer of the generic
tool-call envelope (``{"response": "..."}``) streamed as content while the model writes it.  An escape
cut between two pieces waits for the rest; a lone surrogate half (JSON allows it, no text holds it)
becomes the replacement character."""

from __future__ import annotations

import json


class JsonString:
    """Decodes a JSON string's body as it arrives (the opening quote already consumed)."""

    def __init__(self):
        self._pending = ""

    def feed(self, text: str) -> tuple[str, str, bool]:
        """(decoded text, unconsumed rest, whether the closing quote was reached)."""
        s = self._pending + text
        self._pending = ""
        out, i = [], 0
        while i < len(s):
            ch = s[i]
            if ch == '"':
                return "".join(out), s[i + 1:], True
            if ch != "\\":
                out.append(ch)
                i += 1
                continue
            esc = s[i:i + 2] if s[i + 1:i + 2] != "u" else s[i:i + 6]
            if len(esc) < 2 or (esc[1] == "u" and len(esc) < 6):
                self._pending = s[i:]
                return "".join(out), "", False
            code = hex4(esc[2:]) if esc[1] == "u" else None
            if code is not None and 0xD800 <= code < 0xE000:  # a surrogate: valid only as a high-low pair
                nxt = s[i + 6:i + 12]
                if nxt in ("", "\\") or (nxt.startswith("\\u") and len(nxt) < 6):
                    self._pending = s[i:]  # (what follows decides)
                    return "".join(out), "", False
                low = hex4(nxt[2:]) if nxt.startswith("\\u") else None
                if code < 0xDC00 and low is not None and 0xDC00 <= low < 0xE000:
                    esc = s[i:i + 12]
                else:  # a lone half (JSON allows it; no text holds it): the replacement character
                    out.append("\ufffd")
                    i += 6
                    continue
            try:
                out.append(json.loads('"' + esc + '"'))
            except ValueError:  # (not an escape JSON knows: the text as written)
                out.append(esc)
            i += len(esc)
        return "".join(out), "", False


def hex4(digits: str) -> int | None:
    """The value of four hex digits, or None."""
    try:
        return int(digits, 16) if len(digits) == 4 else None
    except ValueError:
        return None
