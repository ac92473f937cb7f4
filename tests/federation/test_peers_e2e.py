"""Two real daemons (``weave serve`` on a tiny model, each with its own socket, data directory and
federation port on loopback) finding each other: health checks, reports, a peer without the right
token refused and shown as unauthorized, a stopped peer marked dead, run-time peers kept across a
restart."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner
from weaved.cli.app import app

from tests.api.conftest import uds_client
from tests.api.serve_proc import weave_serve

pytestmark = [pytest.mark.federation, pytest.mark.slow]

BOUND_S = 60.0  # a bound on waiting for the daemons' checkers, never a timing assertion
runner = CliRunner()


def profile(tmp: Path, name: str, token: str, peers: str = "") -> Path:
    from importlib.resources import files

    text = files("weaved.profiles").joinpath("cpu-only.toml").read_text()
    text += f'\n[federation]\nport = 0\ntoken = "{token}"\nhealth_interval_s = 0.3\nhealth_timeout_s = 0.3\n'
    path = tmp / f"{name}.toml"
    path.write_text(text.replace('name = "auto"            # the hostname', f'name = "{name}"') + peers)
    return path


def federation_url(proc) -> str:
    m = re.search(r"federation on (http://\S+)", proc.output)
    assert m, proc.output
    return m.group(1)


def peers_of(proc) -> dict[str, dict]:
    with uds_client(proc.socket) as c:
        return {p["name"]: p for p in c.get("/v1/status").json()["peers"]}


def wait_for(proc, pred, what: str) -> dict[str, dict]:
    end = time.monotonic() + BOUND_S
    while True:
        peers = peers_of(proc)
        if pred(peers):
            return peers
        assert time.monotonic() < end, f"not {what} within {BOUND_S} s: {peers}\n{proc.output}"
        time.sleep(0.1)


def weave(proc, *args: str, **env: str):
    return runner.invoke(app, list(args), env={"WEAVE_SOCKET": str(proc.socket), "WEAVE_API_KEY": None,
                                               "WEAVE_DEBUG": None, **env})


def test_two_daemons_federate(tmp_path_factory, tiny_llama):
    tmp = tmp_path_factory.mktemp("fed")
    (tmp / "a").mkdir()
    (tmp / "b").mkdir()
    b_profile = profile(tmp, "node-b", "tok-b")
    with weave_serve(tmp / "b", "--model", str(tiny_llama), "--profile", str(b_profile)) as b:
        b_url = federation_url(b)
        a_peers = f'\n[[peers]]\nname = "b"\nurl = "{b_url}"\ntoken = "tok-b"\n'
        with weave_serve(tmp / "a", "--model", str(tiny_llama), "--profile", str(profile(tmp, "node-a", "tok-a",
                                                                                           a_peers))) as a:
            a_url = federation_url(a)
            # a checks b with the token b expects: alive, same model, every layer
            peers = wait_for(a, lambda p: p["b"]["state"] == "alive", "b alive in a's registry")
            pb = peers["b"]
            assert pb["source"] == "profile" and pb["node"] == "node-b" and pb["latency_ms"] > 0
            assert pb["layers"]["count"] == pb["layers"]["of"] == 2 and pb["kv"]["free_tokens"] > 0
            assert pb["load"]["pools"][0]["name"] == "cpu" and pb["hardware"]["physical_cores"] >= 1
            # b learns of a at run time with a wrong token: a refuses it, b shows it unauthorized
            added = weave(b, "peers", "add", "a", a_url, "--token-env", "A_TOKEN", A_TOKEN="not-a")
            assert added.exit_code == 0, added.stderr
            peers = wait_for(b, lambda p: p["a"]["state"] == "unauthorized", "a unauthorized in b's registry")
            assert "refused this node's token (HTTP 401)" in peers["a"]["last_error"]
            assert httpx.get(f"{a_url}/federation/v1/info", timeout=10).status_code == 401
            assert "unauthorized" in weave(b, "peers", "ls").stdout
            # `weave status` shows both sides
            assert f"b {b_url} (alive, " in weave(a, "status").stdout
        # a stopped: b's check of it fails
        wait_for(b, lambda p: p["a"]["state"] == "dead", "a dead once it stopped")
    b_data = tmp / "b" / "data"
    assert json.loads((b_data / "peers.json").read_text())["peers"][0]["name"] == "a"
    with weave_serve(tmp / "b", "--model", str(tiny_llama), "--profile", str(b_profile)) as b2:
        # a restart keeps the run-time peer
        listed = json.loads(weave(b2, "peers", "ls", "--json").stdout)
        assert [(p["name"], p["source"], p["url"]) for p in listed] == [("a", "runtime", a_url)]
        assert weave(b2, "peers", "rm", "a").exit_code == 0
        assert peers_of(b2) == {}
