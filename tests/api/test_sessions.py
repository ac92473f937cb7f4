"""The session API and the daemon's own routes (health, status, metrics, models)."""

from __future__ import annotations

from tests.api.fake_daemon import FakeDaemon

USER = [{"role": "user", "content": "hi"}]


def test_session_life(client, fake: FakeDaemon):
    r = client.post("/v1/sessions", json={"sla": {"class": "background", "ttlt_s": 120}, "max_context": 1024,
                                          "system": "You are terse."})
    assert r.status_code == 200
    s = r.json()
    sid = s["id"]
    assert s["placement"]["reasons"] and s["sla"] == {"class": "background", "ttft_ms": None, "ttlt_s": 120.0}
    created = [c for n, c in fake.calls if n == "create_session"][-1]
    assert created["max_context"] == 1024 and created["system"] == "You are terse."

    assert client.post(f"/v1/sessions/{sid}/turns", json={"messages": USER, "max_tokens": 5}).status_code == 200
    got = client.get(f"/v1/sessions/{sid}").json()
    assert got["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"}]
    assert [x["id"] for x in client.get("/v1/sessions").json()["data"]] == [sid]

    promoted = client.post(f"/v1/sessions/{sid}/promote").json()
    assert promoted["sla"]["class"] == "interactive" and promoted["placement"]["priority"] == 2
    demoted = client.post(f"/v1/sessions/{sid}/demote").json()
    assert demoted["sla"]["class"] == "background"

    assert client.delete(f"/v1/sessions/{sid}").json() == {"id": sid, "object": "session.deleted",
                                                           "deleted": True}
    assert client.get(f"/v1/sessions/{sid}").status_code == 404
    assert client.get("/v1/sessions").json()["data"] == []


def test_session_defaults_and_sla_headers(client, fake: FakeDaemon):
    s = client.post("/v1/sessions").json()  # no body at all: an interactive session
    assert s["sla"]["class"] == "interactive"
    s = client.post("/v1/sessions", json={}, headers={"X-Weave-SLA-Class": "batch"}).json()
    assert s["sla"]["class"] == "batch"


def test_a_turns_sla_tags_change_what_they_name_and_keep_the_rest(client, fake: FakeDaemon):
    sid = client.post("/v1/sessions", json={"sla": {"class": "background", "ttlt_s": 100}}).json()["id"]
    client.post(f"/v1/sessions/{sid}/turns", json={"messages": USER, "max_tokens": 2},
                headers={"X-Weave-TTFT-Ms": "800"})
    sla = [c for n, c in fake.calls if n == "start_turn"][-1]["sla"]
    assert sla.to_dict() == {"class": "background", "ttft_ms": 800.0, "ttlt_s": 100.0}
    # a fork's tags likewise over its parent's (the route passes the parent's SLA as the base)
    from starlette.datastructures import Headers

    from weaved.api.models import SLABody
    from weaved.api.params import sla_from
    from weaved.routing.types import SLA, SLAClass

    parent = SLA(SLAClass.BACKGROUND, None, 100.0)
    got = sla_from(SLABody.model_validate({"class": "batch"}), Headers({}), parent)
    assert got.to_dict() == {"class": "batch", "ttft_ms": None, "ttlt_s": 100.0}
    assert sla_from(None, Headers({}), parent) is None  # no tags: the session's own stay


def test_health_models_status(client):
    assert client.get("/health").json() == {"status": "ok", "model": "fake-model"}
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "fake-model"
    model = client.get("/v1/models/fake-model").json()
    assert model["context_length"] == 4096 and model["default_context"] == 4096  # (the profile's, capped)
    assert client.get("/v1/models/default").json()["id"] == "fake-model"  # the alias requests may use
    other = client.get("/v1/models/other")  # the same 404 a request naming it gets
    assert other.status_code == 404
    assert other.json()["error"]["type"] == "invalid_request_error"
    assert other.json()["error"]["code"] == "model_not_found"
    assert client.get("/v1/status").json()["pools"][0]["name"] == "cpu"


def test_metrics_after_turns(client):
    client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3, "sla": {"class": "batch"}})
    client.post("/v1/sessions", json={})
    client.get("/v1/sessions/nope")
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert 'weave_requests_total{route="/v1/chat/completions",status="200"} 1.0' in text
    assert 'weave_requests_total{route="/v1/sessions/{session_id}",status="404"} 1.0' in text
    assert 'weave_tokens_total{kind="completion",sla_class="batch"} 3.0' in text
    assert 'weave_time_to_first_token_seconds_count{sla_class="batch"} 1.0' in text
    assert 'weave_inter_token_seconds_count{sla_class="batch"} 2.0' in text
    assert 'weave_turns_total{finish_reason="length",sla_class="batch"} 1.0' in text
    assert 'weave_pool_queue_depth{pool="cpu"} 0.0' in text
    assert 'weave_kv_bytes{tier="file"} 8192.0' in text and 'weave_kv_bytes{tier="ram"} 4096.0' in text
    assert "weave_sessions 1.0" in text


def test_detached_turn_runs_to_its_end(client, fake: FakeDaemon):
    sid = client.post("/v1/sessions", json={"sla": {"class": "batch"}}).json()["id"]
    r = client.post(f"/v1/sessions/{sid}/turns", json={"messages": USER, "max_tokens": 5, "detach": True})
    assert r.status_code == 202
    assert r.json()["id"] == sid and r.json()["status"] == "running" and r.json()["placement"]["priority"] == 0
    for t in fake._threads:
        t.join(10)
    assert client.get(f"/v1/sessions/{sid}").json()["messages"][-1] == {"role": "assistant", "content": "Hello"}
    assert sid not in fake.cancelled
    for body in ({"messages": USER, "detach": True},  # no session: nobody would ever see the answer
                 {"messages": USER, "detach": True, "stream": True, "session": sid}):
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "detach"


def test_a_full_disk_is_a_507_the_connection_survives(client, fake: FakeDaemon, monkeypatch, caplog):
    """The operator's to fix, not a bug: OpenAI's error shape with its own code, one log line, and the
    connection stays usable (a 500 would close it)."""
    from weaved.kv.errors import DiskFull

    def full(*a, **k):
        raise DiskFull("session s-9: creating its KV file: No space left on device")

    monkeypatch.setattr(fake, "create_session", full)
    with caplog.at_level("WARNING", logger="weave.http"):
        r = client.post("/v1/sessions", json={})
    assert r.status_code == 507 and "Connection" not in r.headers
    assert r.json()["error"] == {"message": "session s-9: creating its KV file: No space left on device",
                                 "type": "server_error", "param": None, "code": "insufficient_storage"}
    assert [rec.getMessage() for rec in caplog.records] == [  # one line, naming the request
        f"POST /v1/sessions ({r.headers['x-request-id']}): session s-9: creating its KV file: No space left on device"]


def test_the_session_list_pages_as_openai_lists_do(client, fake: FakeDaemon):
    ids = [client.post("/v1/sessions", json={}).json()["id"] for _ in range(4)]
    whole = client.get("/v1/sessions").json()
    assert [s["id"] for s in whole["data"]] == ids and whole["has_more"] is False
    page = client.get("/v1/sessions", params={"limit": 2}).json()
    assert [s["id"] for s in page["data"]] == ids[:2] and page["has_more"] is True
    assert (page["first_id"], page["last_id"]) == (ids[0], ids[1])
    rest = client.get("/v1/sessions", params={"limit": 2, "after": page["last_id"]}).json()
    assert [s["id"] for s in rest["data"]] == ids[2:] and rest["has_more"] is False
    newest = client.get("/v1/sessions", params={"order": "desc", "limit": 1}).json()
    assert [s["id"] for s in newest["data"]] == ids[-1:]
    for bad, param in (({"limit": 0}, "limit"), ({"after": "s-nope"}, "after"), ({"order": "up"}, "order")):
        r = client.get("/v1/sessions", params=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param
    # the page's last session deleted before the next page is asked for: the walk goes on from its place
    client.delete(f"/v1/sessions/{ids[1]}")
    rest = client.get("/v1/sessions", params={"limit": 2, "after": ids[1]}).json()
    assert [s["id"] for s in rest["data"]] == ids[2:]
    back = client.get("/v1/sessions", params={"order": "desc", "after": ids[1]}).json()
    assert [s["id"] for s in back["data"]] == ids[:1]
    # and the transcripts can be left out of a list of long sessions
    bare = client.get("/v1/sessions", params={"messages": "false"}).json()["data"]
    assert [s["messages"] for s in bare] == [None] * 3 and bare[0]["id"] == ids[0]


def test_a_full_kv_cap_is_a_503_with_retry_after(client, fake: FakeDaemon, monkeypatch):
    """A fork or a session the KV cap cannot hold: the node is full (retry later, or free sessions), not a
    bug - OpenAI's overloaded shape, and no 500."""
    from weaved.kv.errors import KVCapExceeded

    def full(*a, **k):
        raise KVCapExceeded("session s-9: KV cap of 1048576 bytes exceeded")

    monkeypatch.setattr(fake, "create_session", full)
    r = client.post("/v1/sessions", json={})
    assert r.status_code == 503 and r.headers["Retry-After"] == "5" and "x-should-retry" not in r.headers
    assert r.json()["error"]["type"] == "overloaded_error" and "KV cap" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "kv_cap_exceeded"

    def held(*a, **k):  # held by kept sessions: no waiting frees it, so the SDKs are told not to retry
        raise KVCapExceeded("session s-9: the KV cap is full", retryable=False)

    monkeypatch.setattr(fake, "create_session", held)
    r = client.post("/v1/sessions", json={})
    assert r.status_code == 503 and r.headers["x-should-retry"] == "false" and "Retry-After" not in r.headers


def test_a_conflict_says_whether_waiting_ends_it(client, fake: FakeDaemon, monkeypatch):
    """The OpenAI SDKs retry a 409 or a 507 twice unless told not to: a turn still running on the session
    ends by itself (retry after a second); a lost KV file or a full disk does not (``x-should-retry:
    false``, so the user hears of it at once)."""
    from weaved.errors import Conflict, InsufficientStorage

    for exc, advice in ((Conflict("session s-1 is already generating a turn", retryable=True), ("Retry-After", "1")),
                        (Conflict("session s-1's KV file is gone"), ("x-should-retry", "false")),
                        (InsufficientStorage("no room left on the disk"), ("x-should-retry", "false"))):
        def refuse(*a, exc=exc, **k):
            raise exc

        monkeypatch.setattr(fake, "create_session", refuse)
        r = client.post("/v1/sessions", json={})
        assert r.status_code == exc.status and r.headers.get(advice[0]) == advice[1], (exc, dict(r.headers))
        other = "x-should-retry" if advice[0] == "Retry-After" else "Retry-After"
        assert other not in r.headers


def test_what_the_session_routes_would_ignore_is_refused(client, fake: FakeDaemon):
    """An SLA given to promote/demote, a session header naming another session than the path, a list
    parameter the list does not page by: each would be ignored, so each is a 400 naming it."""
    sid = client.post("/v1/sessions", json={}).json()["id"]
    other = client.post("/v1/sessions", json={}).json()["id"]
    for body, headers in (({"sla": {"class": "batch"}}, {}), (None, {"X-Weave-TTFT-Ms": "200"})):
        r = client.post(f"/v1/sessions/{sid}/promote", json=body, headers=headers)
        assert r.status_code == 400 and "takes no body and no SLA header" in r.json()["error"]["message"], r.text
    assert client.post(f"/v1/sessions/{sid}/demote", json={}).status_code == 200  # ({} is no body)
    r = client.post(f"/v1/sessions/{sid}/turns", json={"messages": [{"role": "user", "content": "hi"}]},
                    headers={"X-Weave-Session": other})
    assert r.status_code == 400 and r.json()["error"]["param"] == "session"
    r = client.get("/v1/sessions", params={"before": other})
    assert r.status_code == 400 and r.json()["error"]["param"] == "before"
