"""A streamed answer's log-probabilities go out in the chunk that carries their text: where the answer's
parser holds text back (blank space that may precede a call), its tokens' entries wait with it."""

from __future__ import annotations

import pytest

from weaved.agent.formats import HERMES
from weaved.agent.stream import AnswerParser
from weaved.api.logprobs import AnswerEntries


def stream(pieces: list[str]) -> list[tuple[str, str]]:
    """(content said, text of the entries released) per token, then at the end."""
    parser = AnswerParser(HERMES)
    gate = AnswerEntries(parser)
    at, out = 0, []
    for text in pieces:
        said = "".join(d.get("content", "") for d in parser.push_token(text))
        released = gate.push({"at": at, "text": text}, text)
        out.append((said, "".join(released)))
        at += len(text)
    said = "".join(d.get("content", "") for d in parser.finish())
    out.append((said, "".join(gate.finish())))
    return out


@pytest.mark.parametrize("pieces", [["Para", " one.", "\n\n", "Para", " two."],
                                    ["Hi", " \n", "\n", "there"],
                                    ["Done.", "\n\n"]])
def test_each_chunks_entries_are_its_texts(pieces):
    steps = stream(pieces)
    assert all(said == released for said, released in steps), steps
    assert "".join(s for s, _ in steps) == "".join(pieces)


def test_the_blank_space_before_a_call_has_its_entries_with_the_call():
    """Blank space that turns out to precede a call is no content: its tokens' entries go out with the
    call's (a call's syntax is listed, as its tokens are the answer)."""
    steps = stream(["Sure.", "\n\n", "<tool_call>", '\n{"name": "f", "arguments": {}}\n', "</tool_call>"])
    assert steps[0] == ("Sure.", "Sure.") and steps[1] == ("", "")
    assert steps[2][1].startswith("\n\n<tool_call>")
