"""The benchmark's output: ratios, the JSON object and the table.

JSON shape: ``{"model", "threads", "weave": {...}, "llama_cpp": {...}, "ratio": {...}}``.  A side's
dict holds the measured keys (tokens/s) plus its informational figures (``INFO_KEYS`` for Weave,
``LLAMA_INFO_KEYS`` for llama.cpp: load time, resident memory) - or ``{"error": message}`` when that
side failed.  ``ratio`` is weave / llama.cpp for every measured key both sides have.
"""

from __future__ import annotations

from typing import Any

from weaved.bench import DERIVED_KEYS, INFO_KEYS, KEYS

_RATIO_KEYS = KEYS[:1] + DERIVED_KEYS + KEYS[1:]  # report order: the two prefill figures together

_LABELS = {
    "prefill_tps": "prefill 512 tokens (tok/s)",
    "prefill_8k_tps": "prefill 8000 tokens (tok/s)",
    "decode_tps": "decode @16 (tok/s)",
    "decode_2k_tps": "decode @2000 (tok/s)",
    "decode_8k_tps": "decode @8000 (tok/s)",
    "batch16_tps": "batch 16 decode (agg tok/s)",
    "batch64_tps": "batch 64 decode (agg tok/s)",
    "load_s": "load until ready (s)",
    "file_mb": "model file (MB)",
    "rss_mb": "resident after load (MB)",
    "rss_anon_mb": "  of it its own, not file pages",
    "rss_end_mb": "resident at the end (MB)",
    "weights_mb": "read per decode token (MB)",
    "decode_gbs": "decode streams (GB/s)",
    "stream_gbs": "machine streams (GB/s)",
}
_DIGITS = {"load_s": 2, "decode_gbs": 1, "stream_gbs": 1}


def ratios(weave: dict[str, Any], llama: dict[str, Any]) -> dict[str, float]:
    """weave / llama.cpp for every measurement key both sides have (INFO_KEYS never)."""
    out = {}
    for k in _RATIO_KEYS:
        w, b = weave.get(k), llama.get(k)
        if isinstance(w, int | float) and isinstance(b, int | float) and b > 0:
            out[k] = w / b
    return out


def build_report(model: str, threads: int, weave: dict[str, Any], llama: dict[str, Any]) -> dict[str, Any]:
    """The JSON object ``weave bench --json`` prints."""
    return {
        "model": model,
        "threads": threads,
        "weave": dict(weave),
        "llama_cpp": dict(llama),
        "ratio": ratios(weave, llama),
    }


def _num(v: Any, digits: int) -> str:
    return f"{v:.{digits}f}" if isinstance(v, int | float) else "-"


def format_table(report: dict[str, Any], reps: int | None = None) -> str:
    """A plain-text table: one row per measured key, then Weave's informational figures."""
    w, b, r = report["weave"], report["llama_cpp"], report["ratio"]
    head = f"model {report['model']}  threads {report['threads']}"
    if reps is not None:
        head += f"  median of {reps}"
    lines = [head, f"{'measurement':30s} {'weave':>10s} {'llama.cpp':>10s} {'ratio':>7s}"]
    for k in _RATIO_KEYS:
        if k in w or k in b:
            lines.append(
                f"{_LABELS[k]:30s} {_num(w.get(k), 1):>10s} {_num(b.get(k), 1):>10s} {_num(r.get(k), 2):>7s}"
            )
    for k in INFO_KEYS:
        if k in w:
            d = _DIGITS.get(k, 0)
            other = f" {_num(b[k], d):>10s}" if k in b else ""
            lines.append(f"{_LABELS[k]:30s} {_num(w[k], d):>10s}{other}")
    file_mb = w.get("file_mb")
    if isinstance(file_mb, int | float) and file_mb > 0 and isinstance(w.get("rss_mb"), int | float):
        times = [f"{side} {d['rss_mb'] / file_mb:.2f}x" for side, d in (("weave", w), ("llama.cpp", b))
                 if isinstance(d.get("rss_mb"), int | float)]
        lines.append(f"resident after load, of the file: {', '.join(times)}")
        own = [f"{side} {d['rss_anon_mb'] / file_mb:.2f}x" for side, d in (("weave", w), ("llama.cpp", b))
               if isinstance(d.get("rss_anon_mb"), int | float)]
        if own:  # (without the clean pages of a file kept mapped, which the page cache holds anyway)
            lines.append(f"  its own part (not file pages), of the file: {', '.join(own)}")
    if isinstance(w.get("decode_gbs"), int | float) and w.get("stream_gbs"):
        share = w["decode_gbs"] / w["stream_gbs"]
        lines.append(f"decode @16 reads its weights at {w['decode_gbs']:.1f} GB/s, "
                     f"of what the machine streams: {share:.0%}")
    for side, d in (("weave", w), ("llama.cpp", b)):
        if "error" in d:
            lines.append(f"{side} failed: {d['error']}")
    lines.append("ratio: Weave / llama.cpp (above 1: Weave is faster); decode @N: one sequence with N tokens "
                 "of context; prefill 8000: the context decode @8000 starts from, in 512-token chunks; "
                 "batch K: K sequences decoding at once; llama.cpp: each figure the better of its flash attention "
                 "auto and off")
    lines += [f"warning: {m}" for m in report.get("warnings") or ()]
    return "\n".join(lines)
