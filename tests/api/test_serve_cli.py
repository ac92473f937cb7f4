"""``weave serve``'s refusals (before any model loads) and the socket path's resolution."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q
from typer.testing import CliRunner
from weaved.cli.app import app
from weaved.cli.socket_path import default_socket_path

from tests.tiny_models import write_tiny_gguf


def test_socket_path_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("WEAVE_SOCKET", str(tmp_path / "a.sock"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert default_socket_path() == tmp_path / "a.sock"
    monkeypatch.delenv("WEAVE_SOCKET")
    assert default_socket_path() == Path("/run/user/1000/weave/weave.sock")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "relative/dir")  # not absolute: ignored, as the spec says
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_socket_path() == tmp_path / ".weave" / "weave.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_socket_path() == tmp_path / ".weave" / "weave.sock"


def _serve(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, ["serve", *args], env={"WEAVE_API_KEY": None, **(env or {})})


def test_listen_without_a_key_is_refused(tmp_path: Path):
    r = _serve("--socket", str(tmp_path / "w.sock"), "--listen", "127.0.0.1:0")
    assert r.exit_code == 2 and "API key" in r.output  # bad usage


def test_an_api_key_without_a_listener_is_refused_unless_it_comes_from_the_environment(tmp_path: Path):
    """``--api-key`` guards the TCP listener only (the socket's file mode guards the socket): given
    without ``--listen`` it would be ignored, so it is refused; exported for the clients, it is fine."""
    r = _serve("--socket", str(tmp_path / "w.sock"), "--api-key", "k")
    assert r.exit_code == 2 and "--listen" in r.output
    r = _serve("--socket", str(tmp_path / "w.sock"), "--profile", str(tmp_path / "none.toml"),
               env={"WEAVE_API_KEY": "k"})
    assert r.exit_code == 2 and "--listen" not in r.output  # (refused for its profile, past the key)


def test_bad_listen_address_is_refused(tmp_path: Path):
    r = _serve("--socket", str(tmp_path / "w.sock"), "--listen", "nowhere", "--api-key", "k")
    assert r.exit_code == 2 and "HOST:PORT" in r.output


def test_live_socket_is_refused(tmp_path: Path):
    path = tmp_path / "w.sock"
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(path))
    live.listen(1)
    try:
        r = _serve("--socket", str(path))
        assert r.exit_code == 1 and "already listening" in r.output
    finally:
        live.close()


def test_a_socket_path_that_cannot_be_bound_is_refused_before_the_model_loads(tmp_path: Path):
    long = tmp_path / ("d" * 120) / "w.sock"
    r = _serve("--socket", str(long), "--model", str(tmp_path / "no.gguf"))  # refused before the model is looked at
    assert r.exit_code == 1 and "holds at most 107" in r.output and not long.parent.exists()
    (tmp_path / "file").write_text("")
    r = _serve("--socket", str(tmp_path / "file" / "w.sock"), "--model", str(tmp_path / "no.gguf"))
    assert r.exit_code == 1 and "cannot make the socket's directory" in r.output and "[Errno" not in r.output


def test_bad_profile_is_refused(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[host]\nmax_sessions = 'many'\n")
    r = _serve("--socket", str(tmp_path / "w.sock"), "--profile", str(bad))
    assert r.exit_code == 2 and "bad.toml" in r.output  # the --profile given: bad usage
    r = _serve("--socket", str(tmp_path / "w.sock"), "--profile", "nope")
    assert r.exit_code == 2 and "no shipped profile" in r.output


def test_missing_model_is_refused(tmp_path: Path):
    r = _serve("--socket", str(tmp_path / "w.sock"), "--profile", "cpu-only", "--model", str(tmp_path / "no.gguf"))
    assert r.exit_code == 2 and "not found" in r.output  # bad usage, as a missing --chat-template
    r = _serve("--socket", str(tmp_path / "w.sock"), "--profile", "cpu-only", "--model", str(tmp_path))
    assert r.exit_code == 2 and "is a directory: --model takes a GGUF file" in r.output
    # a file that is not a GGUF Weave runs is the same bad --model, refused from its header before loading
    (tmp_path / "notes.gguf").write_text("not a model")
    r = _serve("--socket", str(tmp_path / "w.sock"), "--profile", "cpu-only", "--model", str(tmp_path / "notes.gguf"))
    assert r.exit_code == 2 and "is not a readable GGUF file: no GGUF magic" in r.output
    gpt2 = write_tiny_gguf(tmp_path / "gpt2.gguf", "gpt2", n_layers=1, wtype=Q.Q4_0)
    r = _serve("--socket", str(tmp_path / "w.sock"), "--profile", "cpu-only", "--model", str(gpt2))
    assert r.exit_code == 2 and "architecture 'gpt2' is not supported" in r.output


def test_a_chat_template_that_cannot_be_read_or_compiled_is_refused_at_start(tmp_path: Path):
    sock = str(tmp_path / "w.sock")
    r = _serve("--socket", sock, "--chat-template", str(tmp_path / "missing.jinja"))
    assert r.exit_code == 2 and "cannot read the chat template" in r.output
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m.content }")
    r = _serve("--socket", sock, "--chat-template", str(broken))
    assert r.exit_code == 2 and "does not compile" in r.output and "broken.jinja" in r.output


def test_an_empty_data_dir_is_refused_not_taken_for_the_current_directory(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = _serve("--socket", str(tmp_path / "w.sock"), "--profile", "cpu-only", "--data-dir", "")
    assert r.exit_code == 2 and "--data-dir is empty" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written here
