"""``/v1/completions``: text and token-id prompts, echo, prompt log-probabilities, streaming."""

from __future__ import annotations

from tests.api.fake_daemon import FakeDaemon
from tests.api.test_chat import sse_events


def _last_turn(fake: FakeDaemon) -> dict:
    return [c for n, c in fake.calls if n == "start_turn"][-1]


def test_text_prompt(client, fake: FakeDaemon):
    r = client.post("/v1/completions", json={"model": "fake-model", "prompt": "Once"})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    # OpenAI's default of 16 tokens
    assert body["choices"][0] == {"index": 0, "text": "Hello from Weave", "logprobs": None,
                                  "finish_reason": "length"}
    assert body["usage"]["prompt_tokens"] == 4 and body["usage"]["completion_tokens"] == 16
    assert _last_turn(fake)["prompt"] == "Once" and _last_turn(fake)["echo"] is False


def test_token_id_prompts(client, fake: FakeDaemon):
    for prompt in ([79, 110], [[79, 110]]):
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "echo": True})
        assert r.json()["choices"][0]["text"] == "OnHel"
        assert _last_turn(fake)["prompt"] == [79, 110]
    r = client.post("/v1/completions", json={"prompt": ["Once"], "max_tokens": 1})
    assert r.json()["choices"][0]["text"] == "H"


def test_echo_with_logprobs_returns_prompt_logprobs(client, fake: FakeDaemon):
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "echo": True, "logprobs": 1})
    choice = r.json()["choices"][0]
    assert _last_turn(fake)["echo"] is True
    assert choice["text"] == "abcHe"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["a", "b", "c", "H", "e"]
    assert lp["token_logprobs"] == [None, -1.0, -1.0, -0.5, -0.5]
    assert lp["top_logprobs"] == [None, {"b": -1.0}, {"c": -1.0}, {"H": -0.5}, {"e": -0.5}]
    assert lp["text_offset"] == [0, 1, 2, 3, 4]


def test_logprobs_without_echo(client, fake: FakeDaemon):
    r = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "logprobs": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert _last_turn(fake)["echo"] is False  # no prompt scoring asked for
    # top_logprobs hold the token itself beside its alternatives ("up to logprobs + 1"), none at 0
    assert lp == {"tokens": ["H", "e"], "token_logprobs": [-0.5, -0.5], "top_logprobs": [{"H": -0.5}, {"e": -0.5}],
                  "text_offset": [0, 1]}


def test_streaming_echo_with_logprobs(client):
    body = {"prompt": "ab", "max_tokens": 2, "echo": True, "logprobs": 1, "stream": True,
            "stream_options": {"include_usage": True}}
    events = sse_events(client.post("/v1/completions", json=body).text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["text"] == "ab"  # the echoed prompt first, whole
    assert chunks[0]["choices"][0]["logprobs"]["tokens"] == ["a", "b"]
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == [None, -1.0]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert "".join(texts) == "abHe"
    offsets = [o for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
               for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, 1, 2, 3]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 2


def test_completion_in_a_session(client, fake: FakeDaemon):
    sid = client.post("/v1/sessions", json={}).json()["id"]
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "session": sid})
    assert r.json()["weave"]["session"] == sid
    r = client.post("/v1/completions", json={"prompt": "y", "max_tokens": 2}, headers={"X-Weave-Session": sid})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 3


def test_a_bos_the_tokenizer_added_is_not_an_echoed_token_so_offsets_index_the_text():
    """Echo + logprobs on a model that adds BOS (Gemma): the BOS keeps its entry (the entries are the
    model's positions, as scoring harnesses align them) but takes no room in the text, so each offset is
    where its token starts in the text and none goes backwards."""
    from weaved.api.completions import _Entries

    class Tok:
        bos_id, bos_text = 2, "<bos>"
        pieces = {2: b"<bos>", 10: b"The", 11: b" capital", 12: b" is"}

        def token_bytes(self, t: int) -> bytes:
            return self.pieces[t]

    echo = "The capital is"
    entries = _Entries(Tok(), echo)
    entries.add({"type": "prompt_logprobs", "items": [(2, None, None), (10, -3.0, [(10, -3.0)]),
                                                      (11, -1.0, [(11, -1.0)]), (12, -0.5, [(12, -0.5)])]})
    got = entries.lps.to_dict()
    assert got["tokens"] == ["<bos>", "The", " capital", " is"] and got["text_offset"] == [0, 0, 3, 11]
    shown = list(zip(got["tokens"], got["text_offset"], strict=True))[1:]
    assert [echo[o:o + len(t)] for t, o in shown] == got["tokens"][1:]
    kept = _Entries(Tok(), "<bos>The")  # a prompt that writes the BOS text itself has it in its text
    kept.add({"type": "prompt_logprobs", "items": [(2, None, None), (10, -3.0, [(10, -3.0)])]})
    assert kept.lps.to_dict()["text_offset"] == [0, 5]


class _Bytes:
    """A tokenizer double whose tokens are the given byte strings."""

    def __init__(self, pieces: dict[int, bytes]):
        self.pieces = pieces

    def token_bytes(self, t: int) -> bytes:
        return self.pieces[t]


def _generated(entries, events) -> dict:
    for at, (tok, text) in events:
        entries.add({"type": "token", "token": tok, "text": text, "at": at, "logprob": -1.0,
                     "top_logprobs": [(tok, -1.0)]})
    return entries.lps.to_dict()


def test_offsets_index_the_text_when_a_character_spans_tokens():
    """Two tokens of one character (its UTF-8 bytes split) both start where the character does, in the
    echoed prompt and in the generated text alike; no offset runs past the text."""
    from weaved.api.completions import _Entries

    tok = _Bytes({1: "日".encode()[:2], 2: "日".encode()[2:], 3: b"!"})
    echo = "日!"
    entries = _Entries(tok, echo)
    entries.add({"type": "prompt_logprobs", "items": [(1, None, None), (2, -1.0, []), (3, -1.0, [])]})
    got = _generated(entries, [(0, (1, "")), (0, (2, "日")), (1, (3, "!"))])
    assert got["text_offset"] == [0, 0, 1, 2, 2, 3]
    assert all(o <= len(echo + "日!") for o in got["text_offset"])


def test_tokens_a_stop_string_took_have_no_entries():
    """The text ends before a stop string: tokens wholly inside it are not listed; tokens the stop checks
    held back and then released are, at their place in the text."""
    from weaved.api.completions import _Entries

    tok = _Bytes({1: b"Hello", 2: b" a", 3: b"b", 4: b" as", 5: b" it"})
    # " a" held (it may start " as it"), released with "b"; then " as" held and " it" completes the stop
    got = _generated(_Entries(tok, ""), [(0, (1, "Hello")), (5, (2, "")), (7, (3, " ab")), (8, (4, "")),
                                         (11, (5, ""))])
    assert got["tokens"] == ["Hello", " a", "b"] and got["text_offset"] == [0, 5, 7]
