"""The profile's ``[federation]`` table and whether ``weave serve`` listens for peers."""

from __future__ import annotations

import pytest

from tests.config.test_profile import CPU_BOX, MINIMAL, rejects, write
from weaved.config.load import load_profile
from weaved.config.profile import DEFAULT_FEDERATION_PORT, FederationConfig
from weaved.federation.service import FederationError, FederationListen, federation_listen

PEER = '[[peers]]\nname = "b"\nurl = "http://10.0.0.2:7411"\ntoken = "tok-b"\n'


def load(tmp_path, text: str):
    return load_profile(write(tmp_path, MINIMAL + text), hardware=CPU_BOX)


def test_defaults_no_listener(tmp_path):
    prof = load(tmp_path, "")
    assert prof.federation == FederationConfig() and prof.federation.port is None
    assert federation_listen(prof) is None


def test_token_and_token_env(tmp_path, monkeypatch):
    prof = load(tmp_path, '[federation]\nport = 7500\nbind = "0.0.0.0"\ntoken = "s3cret"\nhealth_interval_s = 2\n')
    fed = prof.federation
    assert (fed.port, fed.bind, fed.token, fed.health_interval_s, fed.health_timeout_s) == (7500, "0.0.0.0",
                                                                                           "s3cret", 2.0, 2.0)
    assert "s3cret" not in repr(prof)
    assert federation_listen(prof) == FederationListen("0.0.0.0", 7500, "s3cret")
    assert federation_listen(prof, 0).port == 0  # --federation-port overrides the profile
    monkeypatch.setenv("WEAVE_TEST_FED_TOKEN", "from-env")
    assert load(tmp_path, '[federation]\ntoken_env = "WEAVE_TEST_FED_TOKEN"\n').federation.token == "from-env"


def test_peers_alone_listen_on_the_default_port(tmp_path):
    prof = load(tmp_path, PEER + '[federation]\ntoken = "tok-a"\n')
    assert federation_listen(prof) == FederationListen("127.0.0.1", DEFAULT_FEDERATION_PORT, "tok-a")


@pytest.mark.parametrize("text, port, words", [
    (PEER, None, "peers are configured but no federation token"),
    ("[federation]\nport = 7500\n", None, "a federation port (7500) is set but no federation token"),
    ("", 0, "a federation port (0) is set"),
])
def test_a_listener_without_a_token_is_refused(tmp_path, text, port, words):
    with pytest.raises(FederationError, match=r"token_env in the profile's \[federation\] table") as e:
        federation_listen(load(tmp_path, text), port)
    assert words in str(e.value)


@pytest.mark.parametrize("text, key, words", [
    ("[federation]\nport = 70000\n", "federation.port", ["0..65535"]),
    ('[federation]\nport = "7411"\n', "federation.port", ["integer"]),
    ('[federation]\ntoken = "a"\ntoken_env = "B"\n', "federation.token", ["exactly one"]),
    ('[federation]\ntoken = ""\n', "federation.token", ["empty"]),
    ('[federation]\ntoken = "two words"\n', "federation.token", ["without spaces"]),
    ('[federation]\ntoken_env = "WEAVE_SURELY_UNSET_VAR"\n', "federation.token_env", ["not set"]),
    ('[federation]\nbind = ""\n', "federation.bind", ["host address"]),
    ("[federation]\nhealth_interval_s = 0\n", "federation.health_interval_s", ["> 0"]),
    ("[federation]\nhealth_interval_s = 1\nhealth_timeout_s = 3\n", "federation.health_timeout_s",
     ["must not exceed health_interval_s"]),
    ("[federation]\nprot = 1\n", "federation.prot", ["unknown key", "port"]),
    ('[[peers]]\nname = "a"\nurl = "http://h:1"\ntoken = "a b"\n', "peers[0].token", ["without spaces"]),
])
def test_rejected(tmp_path, text, key, words):
    rejects(tmp_path, MINIMAL + text, key, *words)


def test_weave_serve_refuses_a_control_plane_without_a_token(tmp_path):
    from typer.testing import CliRunner
    from weaved.cli.app import app

    path = write(tmp_path, MINIMAL)
    r = CliRunner().invoke(app, ["serve", "--socket", str(tmp_path / "w.sock"), "--profile", str(path),
                                 "--federation-port", "0"], env={"WEAVE_API_KEY": None})
    assert r.exit_code == 1 and "no federation token" in r.output  # before any model loads


def test_weave_serve_notes_a_token_that_serves_nothing(tmp_path):
    from typer.testing import CliRunner
    from weaved.cli.app import app

    path = write(tmp_path, MINIMAL + '[federation]\ntoken = "tok"\n')
    r = CliRunner().invoke(app, ["serve", "--socket", str(tmp_path / "w.sock"), "--profile", str(path),
                                 "--model", str(tmp_path / "missing.gguf")], env={"WEAVE_API_KEY": None})
    assert "sets a token, but neither a port nor peers" in r.output  # said before the model is looked at
    assert r.exit_code == 2 and "model file not found" in r.output


def test_ring_heads_that_do_not_divide_the_models_are_refused_at_start(tmp_path):
    """The profile cannot know the model: the ring's pool, built at start, checks the value against it."""
    from types import SimpleNamespace

    from weaved.federation.service import ring_factory

    prof = load(tmp_path, '[federation]\ntoken = "t"\nring_heads_per_group = 7\n')
    daemon = SimpleNamespace(profile=prof, config=SimpleNamespace(n_kv_heads=3))
    make = ring_factory(daemon, FederationListen("127.0.0.1", 0, "t"))
    with pytest.raises(ValueError, match=r"ring_heads_per_group = 7 must divide the model's 3 kv heads "
                                         r"\(e\.g\. 1, 3\)"):
        make(None, None)
