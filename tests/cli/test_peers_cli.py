"""``weave peers ls|add|rm`` through the socket: the real API app over a stand-in daemon with a real
peer registry, and a stand-in peer's control plane on loopback."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner
from weaved.cli.app import app
from weaved.cli.status import status_text

from tests.api.conftest import serving
from tests.api.fake_daemon import FakeDaemon
from tests.cli.fake_server import short_socket_dir
from tests.federation.control_servers import FINGERPRINT, N_LAYERS, peer_node
from weaved.config.profile import PeerConfig
from weaved.federation.peers import LocalModel, PeerRegistry

pytestmark = pytest.mark.federation

runner = CliRunner()


@pytest.fixture
def daemon(tmp_path):
    d = FakeDaemon()
    d.peers = PeerRegistry([PeerConfig("p", "http://127.0.0.1:9", "tok-p")], store_path=tmp_path / "peers.json",
                           local=LocalModel("m", FINGERPRINT, N_LAYERS), timeout_s=1.0, log=lambda m: None)
    with short_socket_dir() as sd, serving(d, sd / "w.sock"):
        d.socket = sd / "w.sock"
        yield d


def weave(d, *args: str, **env: str):
    return runner.invoke(app, list(args), env={"WEAVE_SOCKET": str(d.socket), "WEAVE_API_KEY": None,
                                               "WEAVE_DEBUG": None, "WEAVE_PEER_TOKEN": None, **env})


def ok(res) -> str:
    assert res.exit_code == 0, (res.stdout, res.stderr)
    return res.stdout


def test_add_ls_rm(daemon):
    with peer_node("b", "tok-b") as b, peer_node("c", "tok-c") as c:
        out = ok(weave(daemon, "peers", "add", "b", b.url, WEAVE_PEER_TOKEN="tok-b"))
        assert out == f"added peer b at {b.url}; it is being checked (see `weave peers ls`)\n"
        added = json.loads(ok(weave(daemon, "peers", "add", "c", c.url, "--token-env", "MY_TOKEN", "--json",
                                    MY_TOKEN="wrong")))
        assert added["name"] == "c" and added["state"] == "unknown" and "token" not in added
        daemon.peers.check_now()
        lines = ok(weave(daemon, "peers", "ls")).splitlines()
        assert lines[0].split() == ["NAME", "URL", "SOURCE", "STATE", "LATENCY", "LAYERS", "FREE", "KV", "LOAD",
                                    "NOTE"]
        rows = {line.split()[0]: line for line in lines[1:]}
        assert rows["b"].split()[1:4] == [b.url, "runtime", "alive"]
        assert f"{N_LAYERS}/{N_LAYERS}" in rows["b"] and "1 running, 2 queued" in rows["b"]
        assert "(1000 tok)" in rows["b"] and "same model" in rows["b"]
        assert rows["c"].split()[3] == "unauthorized" and "refused this node's token" in rows["c"]
        assert rows["p"].split()[2:4] == ["profile", "dead"] and "cannot connect" in rows["p"]
        assert "never reported" in rows["p"]
        listed = json.loads(ok(weave(daemon, "peers", "ls", "--json")))
        assert [p["name"] for p in listed] == ["p", "b", "c"] and listed[1]["kv"]["free_tokens"] == 1000
        # `weave status` and `weave top` render /v1/status "peers", which the daemon fills from the registry
        line = next(ln for ln in status_text({"peers": listed}).splitlines() if ln.startswith("peers"))
        assert f"b {b.url} (alive, " in line and f"ms, {N_LAYERS}/{N_LAYERS} layers, 87.9 MiB KV free)" in line
        assert f"c {c.url} (unauthorized): the peer refused this node's token" in line
        assert ok(weave(daemon, "peers", "rm", "b", "c")) == "removed peer b\nremoved peer c\n"
    assert [p["name"] for p in json.loads(ok(weave(daemon, "peers", "ls", "--json")))] == ["p"]


def test_a_peer_that_stopped_answering_shows_no_figures_from_its_last_report(daemon):
    """A dead peer's latency, layers, free KV and load are its last report's: the table leaves them out and
    says when that report came (the JSON keeps the report, dated, and no latency)."""
    with peer_node("b", "tok-b") as b:
        ok(weave(daemon, "peers", "add", "b", b.url, "--token", "tok-b"))
        daemon.peers.check_now()
        assert "1 running, 2 queued" in ok(weave(daemon, "peers", "ls"))
    daemon.peers.check_now()  # b is gone now
    row = next(ln for ln in ok(weave(daemon, "peers", "ls")).splitlines() if ln.startswith("b "))
    assert row.split()[3] == "dead" and "last report at " in row
    assert "running" not in row and "tok)" not in row and f"{N_LAYERS}/{N_LAYERS}" not in row and "ms " not in row
    listed = {p["name"]: p for p in json.loads(ok(weave(daemon, "peers", "ls", "--json")))}
    assert listed["b"]["latency_ms"] is None and listed["b"]["kv"]["free_tokens"] == 1000 and listed["b"]["reported_at"]


def test_refusals_are_one_line_errors(daemon):
    res = weave(daemon, "peers", "add", "b", "http://127.0.0.1:1")
    assert res.exit_code == 2 and "no token for the peer: set WEAVE_PEER_TOKEN" in res.stderr
    res = weave(daemon, "peers", "add", "p", "http://127.0.0.1:1", "--token", "t")
    assert res.exit_code == 1 and res.stderr.startswith("weave: error: a peer named 'p' already exists")
    res = weave(daemon, "peers", "add", "b", "ftp://x", "--token", "t")  # bad usage: said before asking the daemon
    assert res.exit_code == 2 and "url: must be http(s)://host[:port]" in res.stderr
    res = weave(daemon, "peers", "add", "bad name", "http://127.0.0.1:1", "--token", "t")
    assert res.exit_code == 2 and "peer name 'bad name': use 1-64 letters" in res.stderr
    res = weave(daemon, "peers", "rm", "p")
    assert res.exit_code == 1 and "named in the profile" in res.stderr
    res = weave(daemon, "peers", "rm", "ghost")
    assert res.exit_code == 1 and "no peer 'ghost'" in res.stderr
    res = weave(daemon, "peers", "add", "b", "http://127.0.0.1:1", "--token", "t", "--token-env", "MY_TOKEN")
    assert res.exit_code == 2 and "not both" in res.stderr  # one of them would be ignored


def test_no_peers(tmp_path):
    d = FakeDaemon()
    d.peers = PeerRegistry((), log=lambda m: None)
    with short_socket_dir() as sd, serving(d, sd / "w.sock"):
        d.socket = sd / "w.sock"
        assert ok(weave(d, "peers", "ls")) == "no peers\n"
        assert json.loads(ok(weave(d, "peers", "ls", "--json"))) == []
