"""Reading profile TOML: typed getters that name the file, the key and the reason of every mistake."""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Callable
from typing import Any

AUTO = "auto"


class ProfileError(ValueError):
    """A profile that cannot be used; ``str()`` reads ``<file>: <key>: <reason>``."""

    def __init__(self, file: str | os.PathLike[str], key: str, reason: str):
        super().__init__(f"{file}: {key}: {reason}" if key else f"{file}: {reason}")
        self.file, self.key, self.reason = str(file), key, reason


class Invalid(ValueError):
    """A field's value is out of range; the loader turns it into a ProfileError naming the key."""

    def __init__(self, field_name: str, reason: str):
        super().__init__(f"{field_name}: {reason}")
        self.field, self.reason = field_name, reason


_MISSING: Any = object()
_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def toml_repr(v: Any) -> str:
    """``v`` as it would be written in the profile (``true``, ``"x"``, ``[1, 2]``), not as Python prints it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_repr(x) for x in v) + "]"
    if isinstance(v, dict):
        return "a table"
    return str(v)


def one_of(choices: tuple[str, ...]) -> str:
    """"one of "a", "b" or "c"": the allowed values of a key, as the profile writes them."""
    quoted = [toml_repr(c) for c in choices]
    return "one of " + (", ".join(quoted[:-1]) + " or " + quoted[-1] if len(quoted) > 1 else quoted[0])


def parse_size(v: int | str) -> int:
    """Bytes from an int or a string such as "8GiB", "512 MB", "1.5GiB" (ValueError otherwise)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", v) if isinstance(v, str) else None
    if m is None or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {toml_repr(v)} (an integer of bytes or a string like \"8GiB\", \"512MB\")")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


class Table:
    """One TOML table: typed getters that remember which keys were read, so ``done`` can reject the rest."""

    def __init__(self, file: str, where: str, data: Any):
        self.file, self.where = file, where
        if not isinstance(data, dict):
            raise ProfileError(file, where, f"must be a table, got {type(data).__name__}")
        self.data, self.seen = data, set[str]()

    def key(self, k: str) -> str:
        return f"{self.where}.{k}" if self.where else k

    def err(self, k: str, reason: str) -> ProfileError:
        return ProfileError(self.file, self.key(k), reason)

    def get(self, k: str, ok: Callable[[Any], bool], what: str, default: Any = _MISSING) -> Any:
        self.seen.add(k)
        if k not in self.data:
            if default is _MISSING:
                typo = difflib.get_close_matches(k, [d for d in self.data if isinstance(d, str)], n=1)
                raise self.err(k, "required key is missing" + (f" (is {typo[0]!r} a typo?)" if typo else ""))
            return default
        v = self.data[k]
        if not ok(v):
            raise self.err(k, f"must be {what}, got {toml_repr(v)}")
        return v

    def integer(self, k: str, default: Any = _MISSING, auto: bool = False) -> Any:
        is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
        return self.get(k, lambda v: is_int(v) or (auto and v == AUTO),
                        'an integer or "auto"' if auto else "an integer", default)

    def number(self, k: str, default: Any = _MISSING) -> Any:
        v = self.get(k, lambda v: isinstance(v, int | float) and not isinstance(v, bool), "a number", default)
        return v if v is None else float(v)

    def text(self, k: str, default: Any = _MISSING, choices: tuple[str, ...] = ()) -> Any:
        what = one_of(choices) if choices else "a string"
        return self.get(k, lambda v: isinstance(v, str) and (not choices or v in choices), what, default)

    def flag(self, k: str, default: Any = _MISSING) -> Any:
        return self.get(k, lambda v: isinstance(v, bool), "true or false", default)

    def sub(self, k: str) -> Table:
        self.seen.add(k)
        return Table(self.file, self.key(k), self.data.get(k, {}))

    def array(self, k: str) -> list[Table]:
        self.seen.add(k)
        v = self.data.get(k, [])
        if not isinstance(v, list):
            raise self.err(k, f"must be an array of tables ([[{k}]]), got {type(v).__name__}")
        return [Table(self.file, f"{self.key(k)}[{i}]", t) for i, t in enumerate(v)]

    def build(self, cls: type, **kw: Any) -> Any:
        try:
            return cls(**kw)
        except Invalid as e:
            raise self.err(e.field, e.reason) from None

    def done(self) -> None:
        unknown = sorted(set(self.data) - self.seen)
        if unknown:
            close = difflib.get_close_matches(unknown[0], sorted(self.seen), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(sorted(self.seen))}"
            raise self.err(unknown[0], f"unknown key ({hint})")


