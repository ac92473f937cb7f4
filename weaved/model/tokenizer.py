"""Tokenizer and chat template, from llama.cpp (llama-cpp-python with ``vocab_only=True``).

Using llama.cpp's own tokenizer makes our token ids exactly llama.cpp's for the same GGUF, which
is what lets it serve as the reference for everything downstream.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from pathlib import Path

from weaved.model.gguf_file import GGUFFile


class Tokenizer:
    def __init__(self, path: str | Path, gguf: GGUFFile | None = None):
        import llama_cpp

        _quiet_llama_logs(llama_cpp)
        self.path = Path(path)
        self._llama = llama_cpp.Llama(str(self.path), vocab_only=True, verbose=False)
        meta = gguf or GGUFFile(self.path)
        self.vocab_size = int(self._llama.n_vocab())
        self.bos_id = _opt_int(meta.get("tokenizer.ggml.bos_token_id"))
        self.eos_id = _opt_int(meta.get("tokenizer.ggml.eos_token_id"))
        self.add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        self.chat_template: str | None = meta.get("tokenizer.chat_template")
        # end-of-generation tokens: eos, eot, eom where the vocabulary names them
        eog = {self.eos_id}
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            eog.add(_opt_int(meta.get(key)))
        self.eog_ids: frozenset[int] = frozenset(i for i in eog if i is not None)
        self._formatter = None

    def encode(self, text: str, *, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of ``text``; BOS is added when the model asks for it (``add_bos=None``)."""
        bos = self.add_bos if add_bos is None else add_bos
        return self._llama.tokenize(text.encode("utf-8"), add_bos=bos, special=special)

    def token_bytes(self, token: int) -> bytes:
        return self._llama.detokenize([token], special=True)

    def decode(self, ids: Sequence[int]) -> str:
        return self._llama.detokenize(list(ids), special=True).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text for ``messages`` by the model's own chat template (Jinja2, as llama.cpp)."""
        if not self.chat_template:
            raise ValueError(f"{self.path.name} has no chat template; use the completions API instead")
        if self._formatter is None:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            eos = self.token_bytes(self.eos_id).decode("utf-8", "replace") if self.eos_id is not None else ""
            bos = self.token_bytes(self.bos_id).decode("utf-8", "replace") if self.bos_id is not None else ""
            self._formatter = Jinja2ChatFormatter(
                self.chat_template, eos_token=eos, bos_token=bos, add_generation_prompt=add_generation_prompt
            )
        return self._formatter(messages=messages).prompt


class StreamDecoder:
    """Turns tokens into text as they arrive; holds back bytes of an unfinished UTF-8 character."""

    def __init__(self, tok: Tokenizer):
        self._tok = tok
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        return self._dec.decode(self._tok.token_bytes(token))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


_LOG_CALLBACK = None  # kept alive: llama.cpp holds a pointer to it


def _quiet_llama_logs(llama_cpp) -> None:
    """Route llama.cpp's own log lines (context warnings of the vocabulary-only model) nowhere."""
    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:
        import ctypes

        _LOG_CALLBACK = llama_cpp.llama_log_callback(lambda level, text, user: None)
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


def _opt_int(v) -> int | None:
    return None if v is None else int(v)
