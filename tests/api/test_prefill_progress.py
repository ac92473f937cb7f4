"""A prompt that takes several steps says how far it came: each stream carries ``: prefill N/M``
comments before its first text (clients skip comments); answers without a stream are unchanged."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.api.fake_daemon import FakeDaemon
from weaved.api.app import create_app

LONG = "tell me about the sea " * 4  # 88 bytes: several 16-token chunks of the byte tokenizer


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(FakeDaemon(context_length=4096, prefill_chunk=16)),
                    raise_server_exceptions=False) as c:
        yield c


def _lines(client: TestClient, path: str, body: dict) -> list[str]:
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        return [line for line in r.iter_lines() if line]


def _progress_before(lines: list[str], first_output: int) -> list[tuple[int, int]]:
    """The progress comments' (fed, of), checked to come before line ``first_output`` and to rise."""
    marks = [i for i, line in enumerate(lines) if line.startswith(": prefill ")]
    assert marks and max(marks) < first_output, lines[:8]
    out = []
    for i in marks:
        fed, of = lines[i].removeprefix(": prefill ").split("/")
        out.append((int(fed), int(of)))
    assert [f for f, _ in out] == sorted(f for f, _ in out) and len({of for _, of in out}) == 1
    assert all(0 < f < of for f, of in out)
    return out


def _first_text(lines: list[str], key: str) -> int:
    """The first data line whose choice carries text under ``key``."""
    for i, line in enumerate(lines):
        if line.startswith("data: {"):
            choices = json.loads(line[6:]).get("choices") or [{}]
            part = choices[0].get("delta", choices[0]) if key == "content" else choices[0]
            if part.get(key):
                return i
    raise AssertionError(f"no {key} in {lines[:8]}")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/sessions/{sid}/turns"])
def test_a_chat_stream_says_its_prompts_progress_before_its_first_chunk(client, path):
    if "{sid}" in path:
        path = path.format(sid=client.post("/v1/sessions", json={}).json()["id"])
    lines = _lines(client, path, {"messages": [{"role": "user", "content": LONG}], "stream": True})
    assert len(_progress_before(lines, _first_text(lines, "content"))) >= 4
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == \
        "Hello from Weave!"
    assert lines[-1] == "data: [DONE]"


def test_a_text_completions_stream_carries_it_too(client):
    lines = _lines(client, "/v1/completions", {"prompt": LONG, "stream": True, "max_tokens": 32})
    assert _progress_before(lines, _first_text(lines, "text"))


def test_a_responses_stream_carries_it_between_its_named_events(client):
    lines = _lines(client, "/v1/responses", {"input": LONG, "stream": True})
    marks = [i for i, line in enumerate(lines) if line.startswith(": prefill ")]
    delta = next(i for i, line in enumerate(lines) if "response.output_text.delta" in line)
    assert marks and max(marks) < delta


def test_answers_without_a_stream_are_unchanged(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": LONG}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "Hello from Weave!"
    r = client.post("/v1/completions", json={"prompt": LONG, "max_tokens": 32})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "Hello from Weave!"
    r = client.post("/v1/responses", json={"input": LONG})
    assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == "Hello from Weave!"
