"""Which of a session's tokens a turn keeps when the chat template's rendering is not an extension of what
they spell: from where the text changed - in bytes, so a character split over two tokens counts whole -
or the tokens a fresh tokenization shares with them, whichever keeps more (a tokenizer whose pieces never
spell the rendered text has only that)."""

from __future__ import annotations

from weaved.daemon.turns import Context, chat_turn_tokens


class ByteTokenizer:
    """One token per byte, plus whole-string tokens ``specials`` (``spaced``: their pieces carry a leading
    space the text does not, as llama.cpp writes SentencePiece vocabularies' special tokens)."""

    def __init__(self, specials: list[str], spaced: bool = False):
        self.specials = specials
        self.spaced = spaced

    def token_bytes(self, t: int) -> bytes:
        if t < 256:
            return bytes([t])
        s = self.specials[t - 256]
        return (" " + s if self.spaced else s).encode()

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        out, data, i = [], text.encode(), 0
        while i < len(data):
            for j, s in enumerate(self.specials):
                if data.startswith(s.encode(), i):
                    out.append(256 + j)
                    i += len(s.encode())
                    break
            else:
                out.append(data[i])
                i += 1
        return out

    encode_chat = encode

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes(t) for t in ids).decode("utf-8", errors="replace")

    def render_chat(self, messages, add_generation_prompt=True):
        raise AssertionError("render is given")


def render(messages: list[dict]) -> str:  # a template that trims what it writes
    return "".join(f"<{m['role']}>{m['content'].strip()}</{m['role']}>" for m in messages) + "<assistant>"


def test_a_character_split_over_tokens_keeps_everything_before_it():
    """Byte tokens of CJK text changed only in its last character: all but that character's bytes kept."""
    tok = ByteTokenizer(["<user>", "</user>", "<assistant>", "</assistant>"])
    long = "海" * 1600 + "天"
    said = render([{"role": "user", "content": long}])
    view = Context(None, [{"role": "user", "content": "海" * 1600 + "地"}], tok.encode(said.replace("天", "地")), [])
    new, keep = chat_turn_tokens(tok, view, [], render=lambda m: said)
    assert keep >= 1 + 3 * 1600  # all but the changed character (<user> is one token)
    assert tok.decode(view.committed[:keep] + new) == said


def test_pieces_that_never_spell_the_text_keep_the_tokens_a_fresh_tokenization_shares():
    """llama.cpp writes a space after a SentencePiece vocabulary's special tokens: the session's pieces never
    spell the rendering, so the tokens a fresh tokenization shares with them are kept - not one."""
    tok = ByteTokenizer(["<user>", "</user>", "<assistant>", "</assistant>"], spaced=True)
    before = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there"}]
    view = Context(None, before, tok.encode(render(before)[: -len("<assistant>")]), [])
    new, keep = chat_turn_tokens(tok, view, [{"role": "user", "content": "More"}], render=render)
    assert keep == len(view.committed)
    assert new == tok.encode(render([*before, {"role": "user", "content": "More"}]))[keep:]
