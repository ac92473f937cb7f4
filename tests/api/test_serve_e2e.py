"""End to end: ``weave serve`` with the real default model, spoken to by the official openai SDK, curl-like
httpx calls and bad input; SIGTERM leaves no socket and a consistent journal that a restart recovers."""

from __future__ import annotations

import json
import signal
import sqlite3
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.api.conftest import uds_client
from tests.api.serve_proc import weave_serve

pytestmark = pytest.mark.slow

KEY = "e2e-key"
MAX_SESSIONS = 4
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
COUNTING = "Counting from 1 to 1000: 1, 2, 3, 4, 5, 6, 7, 8,"  # greedy: a long continuation, no early stop


@pytest.fixture(scope="module")
def profile_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped cpu-only profile with a small session limit (to reach it in a test)."""
    from importlib.resources import files

    text = files("weaved.profiles").joinpath("cpu-only.toml").read_text()
    assert "max_sessions = 256" in text
    path = tmp_path_factory.mktemp("profile") / "small.toml"
    path.write_text(text.replace("max_sessions = 256", f"max_sessions = {MAX_SESSIONS}"))
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, smollm2_q4_0: Path, profile_file: Path):
    tmp = tmp_path_factory.mktemp("serve")
    with weave_serve(tmp, "--model", str(smollm2_q4_0), "--profile", str(profile_file),
                     "--listen", "127.0.0.1:0", "--api-key", KEY) as proc:
        yield proc
    assert proc.proc.returncode == 0, proc.output
    assert not proc.socket.exists()
    assert "Task was destroyed" not in proc.output  # e.g. an events subscriber's pending read, left behind


@pytest.fixture
def http(served):
    with uds_client(served.socket, timeout=120.0) as c:
        yield c
        for s in c.get("/v1/sessions").json()["data"]:  # leave the daemon empty for the next test
            c.delete(f"/v1/sessions/{s['id']}")


@pytest.fixture
def sdk(served):
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(served.socket)), timeout=120.0) as h:
        yield openai.OpenAI(base_url="http://weave/v1", api_key="x", http_client=h, max_retries=0)


def test_openai_sdk_chat_and_stream_over_the_socket(sdk, served):
    out = sdk.chat.completions.create(model="default", messages=QUESTION, max_tokens=12, temperature=0,
                                      extra_body={"sla": {"class": "interactive", "ttft_ms": 2000}})
    assert "Paris" in out.choices[0].message.content
    assert out.usage.prompt_tokens > 10 and 0 < out.usage.completion_tokens <= 12
    assert out.model_extra["weave"]["placement"]["decode_pool"] == "cpu"
    stream = sdk.chat.completions.create(model="default", messages=QUESTION, max_tokens=12, temperature=0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"sla": {"class": "background"}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content  # greedy: the same answer, streamed
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens


def test_openai_sdk_over_tcp_needs_the_key(served):
    client = openai.OpenAI(base_url=f"{served.tcp_url}/v1", api_key=KEY, max_retries=0)
    out = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=8, temperature=0)
    assert "Paris" in out.choices[0].message.content
    r = httpx.post(f"{served.tcp_url}/v1/chat/completions", json={"messages": QUESTION}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_session_second_turn_reuses_the_kv(http):
    sid = http.post("/v1/sessions", json={"sla": {"class": "background"}, "system": "Be brief."}).json()["id"]
    first = http.post(f"/v1/sessions/{sid}/turns", json={"messages": QUESTION, "max_tokens": 8,
                                                         "temperature": 0}).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    context = http.get(f"/v1/sessions/{sid}").json()["context_tokens"]
    follow = [{"role": "user", "content": "And of Italy?"}]
    lines = []
    with http.stream("POST", f"/v1/sessions/{sid}/turns",
                     json={"messages": follow, "max_tokens": 8, "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}}) as r:
        lines = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    usage = lines[-1]["usage"]
    # everything the first turn left in the KV is reused; only the new message's tokens are prefilled
    assert usage["prompt_tokens_details"]["cached_tokens"] >= context - 1
    assert usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"] < 30
    got = http.get(f"/v1/sessions/{sid}").json()
    assert [m["role"] for m in got["messages"]] == ["user", "assistant", "user", "assistant"]


def test_completions_echo_logprobs(http):
    r = http.post("/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 2,
                                           "temperature": 0, "echo": True, "logprobs": 2}).json()
    lp = r["choices"][0]["logprobs"]
    n = len(lp["tokens"])
    assert n == r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(x <= 0 for x in lp["token_logprobs"][1:])
    # up to logprobs + 1 alternatives: the token itself is always among them, as OpenAI's
    assert all(len(t) <= 3 and t[tok] == x
               for tok, x, t in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True))
    assert r["choices"][0]["text"].startswith("The capital of France is")
    for tok, lp_, top in zip(lp["tokens"][-2:], lp["token_logprobs"][-2:], lp["top_logprobs"][-2:], strict=True):
        assert top[tok] == lp_ == max(top.values())  # greedy: each generated token is the most likely one
    # max_tokens 0: the prompt alone, scored - the same entries for its tokens, nothing generated
    for stream in (False, True):
        body = {"prompt": "The capital of France is", "max_tokens": 0, "echo": True, "logprobs": 2, "stream": stream}
        if stream:
            chunks = [json.loads(x.removeprefix("data: ")) for x in http.post("/v1/completions", json=body).text
                      .splitlines() if x.startswith("data: {")]
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            reason = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
            scored = {k: sum(((c["choices"][0]["logprobs"] or {}).get(k, []) for c in chunks if c["choices"]), [])
                      for k in ("tokens", "token_logprobs")}
        else:
            alone = http.post("/v1/completions", json=body).json()
            text, reason, scored = alone["choices"][0]["text"], alone["choices"][0]["finish_reason"], \
                alone["choices"][0]["logprobs"]
            assert alone["usage"]["completion_tokens"] == 0
        assert text == "The capital of France is" and reason == "length"
        assert scored["tokens"] == lp["tokens"][:-2] and scored["token_logprobs"] == lp["token_logprobs"][:-2]


def test_bad_input_against_the_real_daemon(http):
    keep = http.post("/v1/sessions", json={}).json()["id"]
    http.post(f"/v1/sessions/{keep}/turns", json={"messages": QUESTION, "max_tokens": 4, "temperature": 0})
    before = http.get(f"/v1/sessions/{keep}").json()

    def err(r, status):
        assert r.status_code == status, r.text
        return r.json()["error"]

    ctx = http.get("/v1/models").json()["data"][0]["context_length"]
    long = [{"role": "user", "content": "hello " * (ctx + 100)}]
    assert err(http.post("/v1/chat/completions", json={"messages": long, "max_tokens": 1}), 400)["code"] \
        == "context_length_exceeded"
    assert err(http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": ctx}), 400)["param"] \
        == "max_tokens"
    assert err(http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 0}), 400)
    assert err(http.post("/v1/chat/completions", json={"messages": []}), 400)["param"] == "messages"
    assert err(http.post("/v1/sessions/s-nope/turns", json={"messages": QUESTION}), 404)["param"] == "session"
    assert err(http.post("/v1/sessions", json={"max_context": ctx + 1}), 400)["param"] == "max_context"
    assert err(http.post("/v1/sessions", json={"sla": {"class": "urgent"}}), 400)["param"] == "sla.class"
    assert err(http.post("/v1/chat/completions", content=b"{nope"), 400)
    assert err(http.post("/v1/chat/completions", content=b'{"messages": "\xff"}'), 400)
    assert err(http.post("/v1/completions", json={"prompt": [1, 10**7]}), 400)["param"] == "prompt"
    # too many sessions: the profile allows MAX_SESSIONS
    made = [http.post("/v1/sessions", json={}) for _ in range(MAX_SESSIONS)]
    assert [r.status_code for r in made].count(503) >= 1
    assert err(made[-1], 503)["type"] == "overloaded_error"
    for r in made:
        if r.status_code == 200:
            http.delete(f"/v1/sessions/{r.json()['id']}")
    assert http.get(f"/v1/sessions/{keep}").json() == before  # nothing changed for the bystander
    ok = http.post(f"/v1/sessions/{keep}/turns", json={"messages": QUESTION, "max_tokens": 2})
    assert ok.status_code == 200


def test_client_disconnect_cancels_the_generation(http):
    sid = http.post("/v1/sessions", json={}).json()["id"]
    with http.stream("POST", "/v1/completions", json={"prompt": COUNTING, "max_tokens": 2000, "stream": True,
                                                      "temperature": 0, "session": sid}) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen >= 3:
                break
    deadline = time.monotonic() + 120
    while (s := http.get(f"/v1/sessions/{sid}").json())["status"] != "idle":
        assert time.monotonic() < deadline, "the turn was not cancelled"
        time.sleep(0.1)
    assert s["context_tokens"] < 1000
    assert 'weave_turns_total{finish_reason="cancelled",sla_class="interactive"} 1.0' in http.get("/metrics").text
    assert all(p["batch_depth"] == 0 for p in http.get("/v1/status").json()["pools"])


def test_metrics_and_events(http, served):
    with http.stream("GET", "/v1/events") as ev:
        lines = ev.iter_lines()
        next(lines)
        sid = http.post("/v1/sessions", json={"sla": {"class": "batch"}}).json()["id"]
        http.post(f"/v1/sessions/{sid}/promote")
        got = []
        for line in lines:
            if line.startswith("data: "):
                got.append(json.loads(line[6:])["type"])
            if len(got) == 2:
                break
    assert got == ["placement", "promotion"]
    for _ in range(5):  # subscribers that leave while the stream waits for an event
        with http.stream("GET", "/v1/events") as ev:
            next(ev.iter_lines())
    # (a turn of its own: the first-token histogram has a sample whichever tests ran before)
    assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 2}).status_code == 200
    before = http.get("/metrics").text
    # an SLA with a first-token target a 2-token answer meets: counted per target, as the client saw it
    sla = {"class": "background", "ttft_ms": 600000}
    assert http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                   "sla": sla}).status_code == 200
    text = http.get("/metrics").text
    assert 'weave_pool_queue_depth{pool="cpu"}' in text and 'weave_kv_bytes{tier="file"}' in text
    assert "weave_time_to_first_token_seconds_bucket" in text

    def value(text: str, series: str) -> float:
        return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(series + " ")),
                    0.0)

    met = 'weave_sla_targets_total{outcome="met",sla_class="background",target="ttft"}'
    assert value(text, met) == value(before, met) + 1
    budget = 'weave_sla_targets_total{outcome="met",sla_class="background",target="ttlt"}'  # the class's budget
    assert value(text, budget) == value(before, budget) + 1
    turns = 'weave_turn_seconds_count{sla_class="background"}'
    assert value(text, turns) == value(before, turns) + 1
    assert value(text, 'weave_pool_steps_total{pool="cpu"}') > value(before, 'weave_pool_steps_total{pool="cpu"}')
    assert value(text, 'weave_pool_tokens_total{kind="generated",pool="cpu"}') >= 4
    assert value(text, "weave_disk_free_bytes") > 0 and value(text, "process_resident_memory_bytes") > 0
    assert value(text, "process_open_fds") > 0 and "weave_unrecovered_sessions 0.0" in text


def test_sigterm_leaves_no_socket_and_a_consistent_journal(tmp_path: Path, smollm2_q4_0: Path):
    with weave_serve(tmp_path, "--model", str(smollm2_q4_0), "--profile", "cpu-only") as proc:
        with uds_client(proc.socket, timeout=120.0) as c:
            sid = c.post("/v1/sessions", json={"sla": {"class": "background"}}).json()["id"]
            c.post(f"/v1/sessions/{sid}/turns", json={"messages": QUESTION, "max_tokens": 4, "temperature": 0})
            with c.stream("POST", "/v1/completions", json={"prompt": COUNTING, "max_tokens": 2000, "stream": True,
                                                           "temperature": 0, "session": sid}) as r:
                chunks = []
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                        if len(chunks) == 3:
                            proc.proc.send_signal(signal.SIGTERM)  # mid-generation
            assert chunks[-1]["choices"][0]["finish_reason"] == "shutdown"
        assert proc.proc.wait(60) == 0, proc.output
    assert not proc.socket.exists()
    assert "stopped" in proc.output
    journal = proc.data_dir / "journal.sqlite"
    db = sqlite3.connect(journal)
    assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    db.close()
    from weaved.daemon.journal import Journal

    j = Journal(journal)
    rec = j.get(sid)
    j.close()
    assert rec is not None and len(rec.tokens) == rec.kv_length > 0
    # a restart recovers the session with all its committed context
    with weave_serve(tmp_path, "--model", str(smollm2_q4_0), "--profile", "cpu-only") as proc2:
        with uds_client(proc2.socket, timeout=120.0) as c:
            got = c.get(f"/v1/sessions/{sid}").json()
            assert got["context_tokens"] >= rec.kv_length
            again = c.post("/v1/completions", json={"prompt": " 10,", "max_tokens": 2, "session": sid}).json()
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == rec.kv_length  # nothing recomputed


def test_log_probabilities_follow_the_text_a_stop_string_cuts(http):
    """A stop string spanning tokens takes them out of the text and out of the log-probabilities: the
    listed tokens spell the text, and every offset indexes it (completions and chat alike)."""
    ask = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 1}
    full = http.post("/v1/completions", json=ask).json()["choices"][0]
    toks = full["logprobs"]["tokens"]
    assert "".join(toks) == full["text"] and len(toks) >= 5
    stop = toks[2][-1] + toks[3] + toks[4][:1]  # from the end of the third token into the fifth
    cut = http.post("/v1/completions", json={**ask, "stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["text"] == full["text"][: full["text"].index(stop)]
    lp = cut["logprobs"]
    assert "".join(lp["tokens"]) == toks[0] + toks[1] + toks[2] and "".join(toks[:3]).startswith(cut["text"])
    assert all(o < len(cut["text"]) for o in lp["text_offset"])
    chat = {"messages": QUESTION, "max_tokens": 8, "temperature": 0, "logprobs": True}
    whole = http.post("/v1/chat/completions", json=chat).json()["choices"][0]
    words = [c["token"] for c in whole["logprobs"]["content"]]
    assert "".join(words) == whole["message"]["content"]  # the end-of-turn token is not listed
    stop = words[1][-1] + words[2]
    cut = http.post("/v1/chat/completions", json={**chat, "stop": stop}).json()["choices"][0]
    content = cut["message"]["content"]
    assert content == whole["message"]["content"][: whole["message"]["content"].index(stop)]
    assert "".join(c["token"] for c in cut["logprobs"]["content"]) == words[0] + words[1]


def test_head_answers_where_get_does_and_the_connection_stays_usable(http):
    head = http.head("/health")
    assert head.status_code == 200 and head.content == b""
    assert http.get("/health").status_code == 200  # the next request on the same connection


def test_a_session_is_rewound_through_the_api(http, served):
    sid = http.post("/v1/sessions", json={"sla": {"class": "batch"}}).json()["id"]
    for text in ("Hi", "Again"):
        assert http.post(f"/v1/sessions/{sid}/turns", json={"messages": [{"role": "user", "content": text}],
                                                            "max_tokens": 2}).status_code == 200
    r = http.post(f"/v1/sessions/{sid}/rewind", json={"turn": 1})
    assert r.status_code == 200 and [m["role"] for m in r.json()["messages"]] == ["user", "assistant"]
    for bad in ({}, {"turn": -1}, {"turn": 5}, {"turn": 1, "keep": True}):
        r = http.post(f"/v1/sessions/{sid}/rewind", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("turn", "keep"), (bad, r.text)
    assert http.post("/v1/sessions/s-nope/rewind", json={"turn": 0}).status_code == 404
