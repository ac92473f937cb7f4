"""llama.cpp's vocabulary of a GGUF, through its C API (llama-cpp-python's bindings of ``llama.h``).

Only the vocabulary is loaded (``vocab_only``: no weights, no context).  The high-level ``Llama`` class
would also compile every chat template the file holds, so a file whose own template does not compile
could not be served even with a template given in its place; and its ids of the special tokens are
llama.cpp's own reading of the metadata - an id past the vocabulary is refused there, not taken as is.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from pathlib import Path

_init_lock = threading.Lock()
_initialized = False


def _backend(llama_cpp) -> None:
    global _initialized
    with _init_lock:
        if not _initialized:
            llama_cpp.llama_backend_init()
            _initialized = True


class LlamaVocab:
    """The vocabulary of the GGUF at ``path``; ValueError when llama.cpp cannot load it."""

    def __init__(self, path: str | Path):
        import llama_cpp

        self._lib = llama_cpp
        _backend(llama_cpp)
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode("utf-8"), params)
        if not self.model:
            raise ValueError(f"llama.cpp could not load the vocabulary of {path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))

    def close(self) -> None:
        if self.model:
            self._lib.llama_model_free(self.model)
            self.model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # (interpreter shutdown: the library may be gone)
            pass

    def special(self, which: str) -> int | None:
        """llama.cpp's id of ``bos`` or ``eos`` (None when the vocabulary has none)."""
        tid = int(getattr(self._lib, f"llama_vocab_{which}")(self.vocab))
        return tid if 0 <= tid < self.n_vocab else None

    def tokenize(self, text: bytes, add_bos: bool, special: bool) -> list[int]:
        n = len(text) + 2  # (a token holds at least one byte; BOS and EOS may be added)
        buf = (self._lib.llama_token * n)()
        got = self._lib.llama_tokenize(self.vocab, text, len(text), buf, n, add_bos, special)
        if got < 0:  # (more than one token a byte: never for llama.cpp's tokenizers, but ask for the room)
            n = -got
            buf = (self._lib.llama_token * n)()
            got = self._lib.llama_tokenize(self.vocab, text, len(text), buf, n, add_bos, special)
            if got < 0:
                raise RuntimeError(f"llama.cpp could not tokenize {len(text)} bytes")
        return list(buf[:got])

    def piece(self, token: int, special: bool = True) -> bytes:
        """The bytes of one token as llama.cpp writes it (special tokens' text too)."""
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = self._lib.llama_token_to_piece(self.vocab, self._lib.llama_token(token), buf, size, 0, special)
            if n >= 0:
                return buf.raw[:n]
            size = -n  # (a longer piece: llama.cpp says how long)

    def detokenize(self, tokens: Sequence[int], special: bool = True) -> bytes:
        return b"".join(self.piece(t, special) for t in tokens)

    def is_eog(self, token: int) -> bool:
        return bool(self._lib.llama_vocab_is_eog(self.vocab, token))

    def add_bos(self) -> bool:
        return bool(self._lib.llama_vocab_get_add_bos(self.vocab))
