import pytest

from weaved.engine.stops import StopChecker


def _run(checker, pieces):
    """Feed pieces (str or (str, id)); returns (emitted text, stopped, matched)."""
    out = []
    for p in pieces:
        piece, tid = p if isinstance(p, tuple) else (p, None)
        step = checker.feed(piece, tid)
        out.append(step.text)
        if step.stopped:
            return "".join(out), True, step.matched
    out.append(checker.flush())
    return "".join(out), False, None


def test_no_stops_passes_text_through_immediately():
    c = StopChecker()
    assert c.feed("hello").text == "hello"
    assert c.feed(" world").text == " world"
    assert c.flush() == ""


def test_stop_string_inside_one_piece_truncates_before_it():
    c = StopChecker(["END"])
    step = c.feed("abcENDxyz")
    assert step.text == "abc" and step.stopped and step.matched == "END"
    assert c.stopped


def test_stop_string_spanning_pieces_is_held_back_then_cut():
    c = StopChecker(["</s>"])
    assert c.feed("Hello <").text == "Hello "  # "<" might start "</s>"
    assert c.feed("/").text == ""
    step = c.feed("s>tail")
    assert step.text == "" and step.stopped and step.matched == "</s>"


def test_false_alarm_releases_held_text():
    c = StopChecker(["</s>"])
    assert c.feed("a </").text == "a "
    assert c.feed("b>").text == "</b>"
    assert not c.stopped


def test_flush_releases_tail_at_end_of_output():
    c = StopChecker(["STOP"])
    assert c.feed("go ST").text == "go "
    assert c.flush() == "ST"


def test_earliest_stop_wins_and_longest_at_same_start():
    assert _run(StopChecker(["xyz", "b"]), ["axyzb"]) == ("a", True, "xyz")
    assert _run(StopChecker(["ab", "abc"]), ["zabc"]) == ("z", True, "abc")


def test_held_tail_uses_longest_possible_prefix_of_any_stop():
    c = StopChecker(["abc", "bcd"])
    assert c.feed("xab").text == "x"  # "ab" may start "abc"
    step = c.feed("cd")
    assert step.stopped and step.text == "" and step.matched == "abc"


def test_stop_token_id_emits_held_text_but_not_its_own_piece():
    c = StopChecker(["END"], stop_ids=[2])
    assert c.feed("word E", 10).text == "word "
    step = c.feed("</s>", 2)
    assert step.stopped and step.matched == 2 and step.text == "E"


def test_concatenation_equals_reference_for_every_split():
    text = "The answer is 42.\n\nUser: next"
    stops = ["\n\nUser:", "###"]
    expected = "The answer is 42."
    for cut1 in range(len(text)):
        for cut2 in range(cut1, len(text)):
            pieces = [text[:cut1], text[cut1:cut2], text[cut2:]]
            assert _run(StopChecker(stops), pieces) == (expected, True, "\n\nUser:"), (cut1, cut2)


def test_feed_after_stop_raises_and_empty_stop_rejected():
    c = StopChecker(["x"])
    c.feed("x")
    with pytest.raises(RuntimeError):
        c.feed("y")
    with pytest.raises(ValueError):
        StopChecker([""])


def test_stop_strings_end_the_text_before_a_call_never_the_call():
    """``until`` (a call's start marker): the text before it stops at a stop string; from it on, the
    grammar alone ends the answer - a stop string inside a call's arguments does not cut it."""
    call = 'Let me check.<tool_call>\n{"name": "f", "arguments": {"q": "Observation: x"}}</tool_call>'
    text = "I think so.\nObservation: it rains"
    for source, want in ((call, (call, False, None)), (text, ("I think so.\n", True, "Observation:"))):
        for cut1 in range(len(source)):
            for cut2 in range(cut1, len(source), 7):
                pieces = [source[:cut1], source[cut1:cut2], source[cut2:]]
                assert _run(StopChecker(["Observation:"], until="<tool_call>"), pieces) == want, (cut1, cut2)
    # a stop string before the marker, in the piece that writes it, still ends the text there
    assert _run(StopChecker(["check"], until="<tool_call>"), [call]) == ("Let me ", True, "check")
    # and stop ids (the end of turn) apply throughout
    assert _run(StopChecker(["Observation:"], {7}, until="<tool_call>"), [call, ("", 7)]) == (call, True, 7)


THINK = ("<think>", "</think>")


@pytest.mark.parametrize(("source", "in_reasoning", "want"), [
    # the reasoning block's text never stops the answer; the visible answer after it does
    ("<think>\nhere we are\n</think>\n\nThe answer.\nhere", False, ("<think>\nhere we are\n</think>\n\nT", True, "he")),
    # the prompt opened the block: the answer starts inside it
    ("the rest here</think>Then here", True, ("the rest here</think>T", True, "he")),
    # no block at the answer's start: stop strings apply from the first character
    ("  The <think> here", False, ("  T", True, "he")),
    # a block that never ends: nothing stops it
    ("<think>here and there", False, ("<think>here and there", False, None)),
    # blank text only, then the end
    ("  ", False, ("  ", False, None)),
], ids=["block-then-answer", "prompt-opened", "no-block", "unended", "blank"])
def test_stop_strings_leave_the_reasoning_block_alone(source, in_reasoning, want):
    """A thinking template's answer may open with a reasoning block, which the client gets apart from the
    answer: stop strings end the visible answer only, however the text is split into pieces."""
    for cut1 in range(len(source) + 1):
        for cut2 in range(cut1, len(source) + 1, 3):
            pieces = [source[:cut1], source[cut1:cut2], source[cut2:]]
            got = _run(StopChecker(["he"], reasoning=THINK, in_reasoning=in_reasoning), pieces)
            assert got == want, (cut1, cut2)
