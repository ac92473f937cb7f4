"""The control plane: the token guard, the peer registry's health checks over loopback, and run-time
peers kept across restarts.  Peers are stand-in daemons' control-plane apps (``control_servers``)."""

from __future__ import annotations

import os
import socket
import stat
import time

import httpx
import pytest

from tests.federation.control_servers import FINGERPRINT, N_LAYERS, peer_node, serve_app
from weaved.config.profile import PeerConfig
from weaved.errors import Conflict, InvalidRequest, NotFound
from weaved.federation.control import create_federation_app
from weaved.federation.peer_store import load_peers
from weaved.federation.peers import LocalModel, PeerRegistry

pytestmark = pytest.mark.federation

LOCAL = LocalModel("SmolLM2-135M-Instruct-Q4_0", FINGERPRINT, N_LAYERS)
BOUND_S = 30.0  # a bound on waiting for the background checker, never a timing assertion


def registry(peers=(), **kw) -> PeerRegistry:
    kw.setdefault("interval_s", 0.2)
    kw.setdefault("timeout_s", 0.2)
    return PeerRegistry(peers, local=LOCAL, log=lambda m: None, **kw)


def wait_for(pred, what: str) -> None:
    end = time.monotonic() + BOUND_S
    while not pred():
        assert time.monotonic() < end, f"not {what} within {BOUND_S} s"
        time.sleep(0.02)


# ---- the token guard ----------------------------------------------------------------------------

def test_a_peer_without_the_token_is_refused():
    with peer_node("b", "tok-b") as b, httpx.Client(base_url=b.url, timeout=10) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "tok-b"},
                        {"Authorization": "Basic tok-b"}, {"Authorization": "Bearer tok-b-and-more"}):
            for path in ("/federation/v1/info", "/federation/v1/health", "/nothing/here"):
                r = http.get(path, headers=headers)
                assert r.status_code == 401, (headers, path)
                err = r.json()["error"]  # the standard shape, the same for every path: nothing revealed
                assert err["type"] == "authentication_error" and err["code"] == "invalid_federation_token"
                assert "federation token" in err["message"] and "node" not in r.text
                assert r.headers["www-authenticate"] == "Bearer"
        good = {"Authorization": "Bearer tok-b"}
        assert http.get("/federation/v1/health", headers=good).json() == {"status": "ok", "node": "b"}
        info = http.get("/federation/v1/info", headers=good).json()
        assert info["model"]["fingerprint"] == FINGERPRINT and info["kv"]["free_tokens"] == 1000
        assert http.get("/nothing/here", headers=good).status_code == 404  # only now does routing speak
        two = [("Authorization", "Bearer tok-b"), ("Authorization", "Bearer tok-b")]
        assert http.get("/federation/v1/health", headers=two).status_code == 401


def test_the_control_plane_needs_a_token():
    with pytest.raises(ValueError, match="token"):
        create_federation_app(lambda: {}, "", "a")


# ---- health checks ------------------------------------------------------------------------------

def test_checks_mark_peers_alive_unauthorized_dead_and_judge_their_layers():
    with peer_node("b", "tok-b") as b, peer_node("c", "tok-c", fingerprint="0123456789abcdef") as c:
        reg = registry([PeerConfig("b", b.url, "tok-b"), PeerConfig("b-wrong", b.url + "/", "not-b"),
                        PeerConfig("c", c.url, "tok-c")])
        states = {p["name"]: p for p in reg.list()}
        assert {p["state"] for p in states.values()} == {"unknown"} and reg.peers_alive() == 0
        reg.check_now()
        p = {p["name"]: p for p in reg.list()}
        assert p["b"]["state"] == "alive" and p["b"]["alive"] and p["b"]["latency_ms"] > 0
        assert p["b"]["layers"] == {"count": N_LAYERS, "of": N_LAYERS, "reason": f"same model ({LOCAL.name}): "
                                                                                  "every layer"}
        assert p["b"]["kv"]["free_tokens"] == 1000 and p["b"]["hardware"]["physical_cores"] == 2
        assert p["b"]["load"]["pools"][0]["queue_depth"] == 2 and p["b"]["node"] == "b"
        assert p["b"]["last_error"] is None and p["b"]["failures"] == 0
        bad = p["b-wrong"]
        assert bad["state"] == "unauthorized" and not bad["alive"] and bad["failures"] == 1
        assert "refused this node's token (HTTP 401)" in bad["last_error"]
        assert p["c"]["state"] == "alive" and p["c"]["layers"]["count"] == 0
        assert "another model" in p["c"]["layers"]["reason"] and "0123456789abcdef" in p["c"]["layers"]["reason"]
        assert reg.peers_alive() == 1  # a live peer of another model cannot hold our layers
        assert "tok-" not in repr(reg.list())
        b.kill()
        reg.check_now()
        dead = reg.get("b")
        assert dead["state"] == "dead" and "cannot connect" in dead["last_error"] and reg.peers_alive() == 0
        assert dead["kv"]["free_tokens"] == 1000 and dead["reported_at"] is not None  # the last report, dated


def test_a_peer_that_is_this_daemon_or_another_peer_again_is_not_counted():
    me = LocalModel(LOCAL.name, FINGERPRINT, N_LAYERS, instance="instance-of-me")
    with peer_node("me", "tok", instance="instance-of-me") as own, peer_node("b", "tok-b") as b:
        reg = PeerRegistry([PeerConfig("me", own.url, "tok"), PeerConfig("b", b.url, "tok-b"),
                            PeerConfig("b-again", b.url.replace("127.0.0.1", "localhost"), "tok-b")],
                           local=me, interval_s=0.2, timeout_s=2.0, log=lambda m: None)
        reg.check_now()
        p = {p["name"]: p for p in reg.list()}
        assert p["me"]["state"] == "self" and not p["me"]["alive"]
        assert "this daemon itself: remove it from the peers" in p["me"]["last_error"]
        states = sorted((p["b"]["state"], p["b-again"]["state"]))
        assert states == ["alive", "duplicate"]  # whichever answered first is the peer, the other its twin
        twin = p["b"] if p["b"]["state"] == "duplicate" else p["b-again"]
        assert "the same daemon as peer" in twin["last_error"]
        assert reg.peers_alive() == 1 and [c.name for c in reg.usable()] in (["b"], ["b-again"])


def test_an_endpoint_that_is_not_a_weave_peer_is_dead_with_the_reason():
    async def app(scope, receive, send):  # answers 200 with something else
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/html")]})
        await send({"type": "http.response.body", "body": b"<html>hello</html>"})

    with serve_app(app) as other:
        reg = registry([PeerConfig("web", other.url, "t")])
        reg.check_now()
        p = reg.get("web")
        assert p["state"] == "dead" and "did not answer with a Weave node report" in p["last_error"]


def test_the_background_checker_marks_a_killed_peer_dead_and_stops_cleanly():
    with peer_node("b", "tok-b") as b:
        reg = registry([PeerConfig("b", b.url, "tok-b")])
        reg.start()
        try:
            wait_for(lambda: reg.get("b")["state"] == "alive", "alive")
            b.kill()
            wait_for(lambda: reg.get("b")["state"] == "dead", "marked dead after its process ended")
            assert reg.get("b")["failures"] >= 1
        finally:
            reg.stop()
        assert reg._thread is None


def test_a_silent_peer_is_dead_after_the_timeout():
    silent = socket.socket()  # accepts connections (the backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        reg = registry([PeerConfig("mute", url, "t")])
        reg.check_now()
        p = reg.get("mute")
        assert p["state"] == "dead" and "no answer within 0.2 s" in p["last_error"]
    finally:
        silent.close()


def test_a_peer_trickling_its_answer_is_dead_within_the_checks_deadline():
    """Each read arrives within the timeout, the whole answer never does: the check ends anyway."""
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)

    def trickle():
        for _ in range(2):  # the health request, and one retry at most
            try:
                conn, _addr = srv.accept()
            except OSError:
                return
            with conn:
                conn.recv(4096)
                try:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
                    for _ in range(100):  # a byte every 0.05 s, 5 s at most: stops by itself
                        conn.sendall(b"x")
                        time.sleep(0.05)
                except OSError:  # the checker hung up
                    pass

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        reg = registry([PeerConfig("slow", f"http://127.0.0.1:{srv.getsockname()[1]}", "t")])
        reg.check_now()
        p = reg.get("slow")
        assert p["state"] == "dead" and "too slowly" in p["last_error"]
    finally:
        srv.close()
        t.join(10)


def test_a_peer_added_at_run_time_is_checked_at_once(tmp_path):
    with peer_node("b", "tok-b") as b:
        reg = registry(interval_s=600.0, timeout_s=1.0, store_path=tmp_path / "peers.json")
        reg.start()
        try:
            assert reg.list() == []
            reg.add("b", b.url, "tok-b")  # the next round starts now, not in ten minutes
            wait_for(lambda: reg.get("b")["state"] == "alive", "checked after it was added")
        finally:
            reg.stop()


# ---- adding, removing, keeping ------------------------------------------------------------------

def test_run_time_peers_are_validated_saved_and_restored(tmp_path):
    path = tmp_path / "data" / "peers.json"
    profile_peer = PeerConfig("p", "http://10.0.0.1:7411", "tok-p")
    reg = registry([profile_peer], store_path=path)
    added = reg.add("b", "http://127.0.0.1:7412", "tok-b")
    assert added["source"] == "runtime" and added["state"] == "unknown" and "token" not in added
    reg.add("c", "https://c.example:7411/", "tok-c")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # it holds the tokens
    with pytest.raises(Conflict, match="already exists"):
        reg.add("b", "http://127.0.0.1:9999", "x")
    with pytest.raises(Conflict, match="from the profile"):
        reg.add("p", "http://127.0.0.1:9999", "x")
    with pytest.raises(Conflict, match="already has the url"):
        reg.add("d", "http://127.0.0.1:7412/", "x")
    for name, url, token, param in (("", "http://h:1", "t", "name"), ("a b", "http://h:1", "t", "name"),
                                    ("x/y", "http://h:1", "t", "name"), ("d", "ftp://h", "t", "url"),
                                    ("d", "http://h:1/path", "t", "url"), ("d", "http://h:1", "two words", "token"),
                                    ("d", "http://h:1", "x" * 5000, "token")):
        with pytest.raises(InvalidRequest) as e:
            reg.add(name, url, token)
        assert e.value.param == param, (name, url, token)
    with pytest.raises(Conflict, match="named in the profile.*restart"):
        reg.remove("p")
    with pytest.raises(NotFound):
        reg.remove("zz")
    assert [p["name"] for p in reg.list()] == ["p", "b", "c"]

    again = registry([profile_peer], store_path=path)  # a restart
    assert [(p["name"], p["source"]) for p in again.list()] == [("p", "profile"), ("b", "runtime"),
                                                                 ("c", "runtime")]
    assert [p.token for p in load_peers(path)] == ["tok-b", "tok-c"]  # profile peers are never saved
    again.remove("b")
    assert [p["name"] for p in registry([profile_peer], store_path=path).list()] == ["p", "c"]


def test_a_damaged_peer_file_does_not_stop_the_daemon(tmp_path):
    path = tmp_path / "peers.json"
    said: list[str] = []
    path.write_text("{not json")
    assert PeerRegistry((), store_path=path, log=said.append).list() == []
    assert "cannot read" in said[-1]
    path.write_text('{"version": 1, "peers": [{"name": "a", "url": "http://h:1", "token": "t"}, {"name": "b"}, 3]}')
    reg = PeerRegistry([PeerConfig("a", "http://h:2", "t2")], store_path=path, log=said.append)
    assert [(p["name"], p["url"]) for p in reg.list()] == [("a", "http://h:2")]  # the profile wins
    assert any("#1" in s for s in said) and any("#2" in s for s in said) and any("profile names" in s for s in said)


def test_peers_compare_weights_not_only_the_shape(tmp_path):
    """Two files of one shape and name but other weights (a fine-tune, another quantization) must not
    split a prompt's layers between them: their fingerprints differ; a copy of one file does not."""
    import shutil
    from types import SimpleNamespace

    from tests.tiny_models import write_tiny_gguf
    from weaved.federation.node_report import weights_fingerprint
    from weaved.model.architectures import read_config
    from weaved.model.gguf_file import GGUFFile

    a = write_tiny_gguf(tmp_path / "a.gguf", n_layers=1, seed=1)
    b = write_tiny_gguf(tmp_path / "b.gguf", n_layers=1, seed=2)
    copy = shutil.copy(a, tmp_path / "copy.gguf")

    def fp(path):
        return weights_fingerprint(SimpleNamespace(config=read_config(GGUFFile(path)), model_path=path))

    assert read_config(GGUFFile(a)) == read_config(GGUFFile(b))  # the same shape and name
    assert fp(a) != fp(b) and fp(a) == fp(copy)


def test_a_peer_answering_through_a_compressing_proxy_is_alive():
    """A check reads the body itself (against its deadline): a gzip-encoded answer is still read once."""
    import gzip
    import json

    from weaved.federation.probe import ALIVE, probe

    def handler(request: httpx.Request) -> httpx.Response:
        doc = {"status": "ok"} if request.url.path.endswith("/health") else {"model": {"name": "m"}, "node": "p"}
        return httpx.Response(200, headers={"content-encoding": "gzip", "content-type": "application/json"},
                              content=gzip.compress(json.dumps(doc).encode()))

    got = probe(PeerConfig("zipped", "http://zipped.invalid", "t"), 1.0, httpx.MockTransport(handler))
    assert got.state == ALIVE and got.report["model"] == {"name": "m"}
