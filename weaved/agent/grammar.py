"""Constrained decoding with llguidance: a grammar per request, a token mask per sampled token.

``GrammarEngine`` belongs to one served model: it builds llguidance's tokenizer from llama.cpp's own
vocabulary (the same token bytes Weave decodes with; control tokens are marked special, so a grammar
names them as ``<|im_end|>``), once, on first use.  ``compile`` checks a grammar and returns a
``GrammarConstraint`` - the engine's ``TokenConstraint`` - for one sequence.

Why llguidance (over xgrammar): it builds its tokenizer from llama.cpp's vocabulary object directly,
so the token bytes and special-token set are exactly those Weave samples from (xgrammar wants a
Hugging Face tokenizer and needs ``transformers``); its Lark grammars have lazy lexemes for "free
text until the tool-call trigger" and inline JSON schemas, which tool calling needs; it has no Python
dependencies; and its masks cost tens of microseconds (``weave bench --scenario grammar`` measures).
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from weaved.engine.constraint import ConstraintError, TokenConstraint
from weaved.errors import InvalidRequest

# A grammar is compiled while the request waits: bound what one may cost (llguidance's own limits
# refuse larger ones with a clear error).
MAX_GRAMMAR_BYTES = 256 * 1024
# Masks computed ahead, while the model's forward runs (llguidance releases the GIL): one worker per
# pool engine would be enough; a few serve every engine of the daemon.
_AHEAD = ThreadPoolExecutor(max_workers=2, thread_name_prefix="weave-mask")


class GrammarEngine:
    """llguidance for one tokenizer (``weaved.model.tokenizer.Tokenizer``)."""

    def __init__(self, tokenizer, n_vocab: int | None = None):
        self._tok = tokenizer
        self.n_vocab = int(n_vocab or tokenizer.vocab_size)  # the logits' width
        self._ll = None
        self._lock = threading.Lock()

    @property
    def lltokenizer(self):
        """llguidance's tokenizer (built once, on first use)."""
        with self._lock:
            if self._ll is None:
                self._ll = self._build()
            return self._ll

    def _build(self):
        """llguidance's tokenizer over llama.cpp's vocabulary: each token's bytes as llama.cpp writes them,
        control tokens (and user-defined ``<...>`` ones, as Qwen's ``<tool_call>``) marked special with
        llguidance's ``0xff`` prefix; tokenizing goes through llama.cpp's own tokenizer."""
        import ctypes

        import llama_cpp
        from llguidance import LLTokenizer

        vocab = self._tok.llama_vocab()
        buf = ctypes.create_string_buffer(16 * 1024)
        control, user = llama_cpp.LLAMA_TOKEN_ATTR_CONTROL, llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED
        tokens: list[bytes] = []
        for t in range(llama_cpp.llama_vocab_n_tokens(vocab)):
            n = llama_cpp.llama_token_to_piece(vocab, t, buf, len(buf), 0, True)
            if n < 0:
                raise ValueError(f"token {t} is longer than {len(buf)} bytes")
            piece = bytes(buf[:n])
            attr = llama_cpp.llama_vocab_get_attr(vocab, t)
            if attr & control or (attr & user and piece.startswith(b"<") and piece.endswith(b">")):
                piece = b"\xff" + piece
            tokens.append(piece)
        tokens += [b""] * (self.n_vocab - len(tokens))  # a logits row wider than the vocabulary: never allowed
        tokenize = ctypes.cast(_libllama().llama_tokenize, ctypes.c_void_p).value
        eog = sorted(self._tok.eog_ids) or None
        return LLTokenizer.from_llamacpp(tokens=tokens, vocab_ptr=vocab, tokenize_fptr=tokenize, eos_token=eog,
                                         slices=None)

    def special_id(self, text: str) -> int | None:
        """The id of ``text`` when it is one special (control) token of this vocabulary, which a Lark
        grammar must name as ``<[id]>`` rather than spell as a string; else None."""
        ids = self._tok.encode(text, add_bos=False, special=True)
        return ids[0] if len(ids) == 1 and self.lltokenizer.is_special_token(ids[0]) else None

    def compile(self, lark: str, *, param: str = "response_format") -> GrammarConstraint:
        """A fresh constraint for ``lark`` (llguidance's Lark dialect); InvalidRequest naming ``param``
        when the grammar (usually a client's JSON schema) is not valid."""
        from llguidance import LLMatcher

        if len(lark) > MAX_GRAMMAR_BYTES:
            raise InvalidRequest(f"the grammar built from {param} is larger than {MAX_GRAMMAR_BYTES} bytes",
                                 param=param)
        grammar = LLMatcher.grammar_from_lark(lark)
        matcher = LLMatcher(self.lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"{param} cannot be enforced: {compile_error(matcher.get_error())}", param=param)
        return GrammarConstraint(matcher, self.n_vocab)


class GrammarConstraint(TokenConstraint):
    """One sequence's matcher.  ``allowed`` computes llguidance's bitmask into a reused buffer and
    unpacks it to booleans [n_vocab]; ``accept`` advances the matcher."""

    def __init__(self, matcher, n_vocab: int):
        self._m = matcher
        self._n = n_vocab
        self._bits = np.zeros(((n_vocab + 31) // 32,), np.int32)  # [ceil(n/32)] llguidance's layout
        self._ahead: Future | None = None  # the next mask, being computed while the forward runs

    def prefetch(self) -> None:
        if self._ahead is None:
            self._ahead = _AHEAD.submit(self._compute)

    def _compute(self) -> np.ndarray:
        m = self._m
        m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if m.is_error():
            raise ConstraintError(_first_line(m.get_error()))
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._n].view(bool)  # [n_vocab]

    def allowed(self) -> np.ndarray:
        ahead, self._ahead = self._ahead, None
        return ahead.result() if ahead is not None else self._compute()

    def accept(self, token: int) -> None:
        if self._ahead is not None:  # a mask computed for the state before this token is stale
            with contextlib.suppress(ConstraintError):  # (a failed one: consume_token says why below)
                self._ahead.result()
            self._ahead = None
        if not self._m.consume_token(int(token)):
            raise ConstraintError(f"token {token} is not allowed here: {_first_line(self._m.get_error())}")

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        if self._ahead is not None:  # the matcher is busy computing a mask: wait for it
            self._ahead.result()
        return int(self._m.validate_tokens([int(t) for t in tokens]))

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str | None:
        return _first_line(self._m.get_error()) if self._m.is_error() else None


def _libllama():
    """llama.cpp's shared library as llama-cpp-python loaded it (dlopen hands back the same handle): the
    grammar engine tokenizes through its ``llama_tokenize`` directly."""
    import ctypes
    from pathlib import Path

    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libllama.so", "libllama.dylib", "llama.dll"):
        if (lib_dir / name).exists():
            return ctypes.CDLL(str(lib_dir / name))
    raise RuntimeError(f"llama.cpp's library was not found in {lib_dir}")


def compile_error(text: str) -> str:
    """llguidance's compile error as one line a client can act on: without its position in the grammar
    Weave wrote (``at 1(8): ``) and the echo of that grammar, the detail lines (a regex's) kept."""
    lines = (text or "unknown error").strip().splitlines()
    echo = next((i for i, line in enumerate(lines) if re.match(r"\s*\d+ \|", line)), len(lines))
    lines = [line.strip() for line in lines[:echo] if line.strip() and set(line.strip()) != {"^"}]
    lines[0] = re.sub(r"^at \d+\(\d+\): ", "", lines[0])
    details = ": ".join(line.removeprefix("error: ") for line in lines[1:])
    return (lines[0] + (" " + details if details else ""))[:500]


def _first_line(text: str) -> str:
    return (text or "unknown error").strip().splitlines()[0][:500]
