"""``/v1/peers`` on the Weave API: list, add (validated, duplicates 409), remove (profile peers 409)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.api.fake_daemon import FakeDaemon
from tests.federation.control_servers import FINGERPRINT, N_LAYERS, peer_node
from weaved.api.app import create_app
from weaved.config.profile import PeerConfig
from weaved.federation.peers import LocalModel, PeerRegistry

pytestmark = pytest.mark.federation


@pytest.fixture
def fake(tmp_path) -> FakeDaemon:
    d = FakeDaemon()
    d.peers = PeerRegistry([PeerConfig("p", "http://10.0.0.1:7411", "tok-p")], store_path=tmp_path / "peers.json",
                           local=LocalModel("m", FINGERPRINT, N_LAYERS), timeout_s=1.0, log=lambda m: None)
    return d


@pytest.fixture
def client(fake):
    with TestClient(create_app(fake), raise_server_exceptions=False) as c:
        yield c


def test_add_list_get_and_remove(client, fake):
    with peer_node("b", "tok-b") as b:
        r = client.post("/v1/peers", json={"name": "b", "url": b.url, "token": "tok-b"})
        assert r.status_code == 200, r.text
        assert r.json()["name"] == "b" and r.json()["source"] == "runtime" and "tok-b" not in r.text
        fake.peers.check_now()
        peers = client.get("/v1/peers").json()
        assert peers["object"] == "list" and [p["name"] for p in peers["data"]] == ["p", "b"]
        got = client.get("/v1/peers/b").json()
        assert got["state"] == "alive" and got["layers"]["count"] == N_LAYERS and "tok-b" not in str(peers)
    r = client.delete("/v1/peers/b")
    assert r.json() == {"name": "b", "object": "peer.deleted", "deleted": True}
    assert [p["name"] for p in client.get("/v1/peers").json()["data"]] == ["p"]


@pytest.mark.parametrize("body, status, param, words", [
    ({"name": "p", "url": "http://h:1", "token": "t"}, 409, "name", "already exists (from the profile)"),
    ({"name": "q", "url": "http://10.0.0.1:7411/", "token": "t"}, 409, "url", "already has the url"),
    ({"name": "q", "url": "tcp://h:1", "token": "t"}, 400, "url", "http(s)://host[:port]"),
    ({"name": "q/r", "url": "http://h:1", "token": "t"}, 400, "name", "letters, digits"),
    ({"name": "q", "url": "http://h:1"}, 400, "token", "Field required"),
    ({"name": "q", "url": "http://h:1", "token": ""}, 400, "token", "at least 1"),
    ({"name": "q", "url": "http://h:1", "token": 5}, 400, "token", "string"),
    ({"name": "q", "url": "http://h:1", "token": "t", "extra": 1}, 400, "extra", "unknown or unsupported field"),
])
def test_bad_additions_are_refused_and_change_nothing(client, body, status, param, words):
    r = client.post("/v1/peers", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"], err
    assert [p["name"] for p in client.get("/v1/peers").json()["data"]] == ["p"]


def test_removing_a_profile_peer_or_an_unknown_one(client):
    r = client.delete("/v1/peers/p")
    assert r.status_code == 409 and "named in the profile" in r.json()["error"]["message"]
    r = client.delete("/v1/peers/nobody")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert client.get("/v1/peers/nobody").status_code == 404


def test_a_daemon_without_a_registry_says_so():
    with TestClient(create_app(FakeDaemon()), raise_server_exceptions=False) as c:
        r = c.get("/v1/peers")
        assert r.status_code == 404 and "no peer list" in r.json()["error"]["message"]
