"""Tokenizer and chat template, from llama.cpp (its vocabulary alone: ``weaved.model.llama_vocab``).

Using llama.cpp's own tokenizer makes our token ids exactly llama.cpp's for the same GGUF, which
is what lets it serve as the reference for everything downstream.

BOS follows llama.cpp's rule: the tokenizer adds it when the vocabulary says so (``add_bos``:
``tokenizer.ggml.add_bos_token``, else the tokenizer type's default), and never a second one - a
chat template that writes ``bos_token`` itself has that text stripped before tokenizing (as
llama-server does), and a raw prompt that already starts with it gets none added.
"""

from __future__ import annotations

import codecs
import collections
from collections.abc import Sequence
from pathlib import Path

from weaved.model.chat_template import ChatTemplate
from weaved.model.gguf_file import GGUFFile
from weaved.model.llama_vocab import LlamaVocab


class Tokenizer:
    def __init__(self, path: str | Path, gguf: GGUFFile | None = None, chat_template: str | None = None):
        """``chat_template`` replaces the file's own (a base model ships none)."""
        import llama_cpp

        quiet_llama_logs(llama_cpp)
        self.path = Path(path)
        meta = gguf or GGUFFile(self.path)
        if meta.get("tokenizer.ggml.model") is None:  # llama.cpp would only say it failed to load the file
            raise ValueError(f"{self.path} has no tokenizer (no tokenizer.ggml.model key): Weave needs the "
                             f"model's vocabulary in the file, as llama.cpp does")
        _RECENT_LOG.clear()
        try:
            self._vocab = LlamaVocab(self.path)
        except ValueError as e:  # llama.cpp says why only in its log ("unknown pre-tokenizer type", ...)
            said = [t for level, t in _RECENT_LOG if level in (_WARN, _ERROR) and t]
            raise ValueError(f"{self.path.name}: llama.cpp cannot read its vocabulary"
                             + (f": {' / '.join(said[-3:])}" if said else f" ({e})")) from None
        self.vocab_size = self._vocab.n_vocab
        embd = meta.tensors.get("token_embd.weight")
        if embd is not None and len(embd.shape) == 2 and self.vocab_size > embd.shape[0]:
            raise ValueError(f"{self.path.name}: its vocabulary has {self.vocab_size} tokens, its token embedding "
                             f"{embd.shape[0]} rows: tokens past them have no embedding (a tokenizer from another "
                             f"model?)")
        # llama.cpp's reading of the special tokens: an id the metadata gives past the vocabulary is
        # refused there (it warns and uses its default), never taken as is
        self.bos_id = self._vocab.special("bos")
        self.eos_id = self._vocab.special("eos")
        self.add_bos = self._vocab.add_bos()  # llama.cpp's own decision
        self.chat_template: str | None = chat_template or meta.get("tokenizer.chat_template")
        # end-of-generation tokens as llama.cpp decides them: eos, eot, eom, and the tokens it recognizes
        # by their text (Gemma's <end_of_turn>, ChatML's <|im_end|>, ...); a set lookup per id
        self.eog_ids: frozenset[int] = frozenset(i for i in range(self.vocab_size) if self._vocab.is_eog(i))
        self._formatter = None
        self.bos_text = self.token_bytes(self.bos_id).decode("utf-8", "replace") if self.bos_id is not None else ""

    def encode(self, text: str, *, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of ``text``; BOS is added when the model asks for it (``add_bos=None``)."""
        bos = self.add_bos if add_bos is None else add_bos
        return self._vocab.tokenize(text.encode("utf-8"), add_bos=bos, special=special)

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a raw prompt that starts a context: BOS added when the model asks for it,
        unless the text already starts with the BOS token."""
        bos = self.add_bos and not (self.bos_text and text.startswith(self.bos_text))
        return self.encode(text, add_bos=bos)

    def encode_chat(self, text: str) -> list[int]:
        """Token ids of a rendered chat prompt, as llama-server makes them: when the model adds BOS, a
        BOS the template wrote is stripped first, so the prompt starts with exactly one (or none when
        the model adds none and the template writes none)."""
        if self.add_bos and self.bos_text and text.startswith(self.bos_text):
            text = text[len(self.bos_text):]
        return self.encode(text)

    def token_bytes(self, token: int) -> bytes:
        return self._vocab.piece(token)

    def decode(self, ids: Sequence[int]) -> str:
        return self._vocab.detokenize(ids).decode("utf-8", errors="replace")

    def stream_decoder(self) -> StreamDecoder:
        return StreamDecoder(self)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, *,
                    tools: list[dict] | None = None, kwargs: dict | None = None) -> str:
        """The prompt text for ``messages`` (and ``tools``) by the model's own chat template
        (``weaved.model.chat_template``); TemplateError when the template refuses the conversation."""
        return self.template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                    kwargs=kwargs)

    @property
    def template(self) -> ChatTemplate:
        """The chat template; ValueError when the model has none."""
        if not self.chat_template:
            raise ValueError(f"{self.path.name} has no chat template; use the completions API instead")
        if self._formatter is None:
            eos = self.token_bytes(self.eos_id).decode("utf-8", "replace") if self.eos_id is not None else ""
            self._formatter = ChatTemplate(self.chat_template, bos_token=self.bos_text, eos_token=eos)
        return self._formatter

    def llama_vocab(self):
        """llama.cpp's vocabulary object (for a grammar engine's tokenizer)."""
        return self._vocab.vocab


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


_WARN, _ERROR = 3, 4  # ggml's log levels
_RECENT_LOG: collections.deque[tuple[int, str]] = collections.deque(maxlen=64)


def quiet_llama_logs(llama_cpp) -> None:
    """Route llama.cpp's own log lines (context warnings of the vocabulary-only model) off the terminal,
    keeping the last few: a vocabulary llama.cpp refuses is refused with its words.

    The sink is installed again on every call: llama.cpp holds one process-wide callback, and whatever
    set another since (a reference run, the benchmark) must not leave the refusal without its words."""
    global _LOG_CALLBACK
    import ctypes

    if _LOG_CALLBACK is None:
        def keep(level: int, text: bytes, user) -> None:
            _RECENT_LOG.append((int(level), (text or b"").decode("utf-8", "replace").strip()))

        _LOG_CALLBACK = llama_cpp.llama_log_callback(keep)
    llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
