"""``weave serve``'s arguments are refused (exit 2) before anything loads, the most basic problem first."""

from __future__ import annotations

from typer.testing import CliRunner
from weaved.cli.app import app

runner = CliRunner()


def test_a_bad_listen_address_is_named_before_the_missing_key(tmp_path):
    env = {"WEAVE_API_KEY": None, "WEAVE_DEBUG": None}
    bad = runner.invoke(app, ["serve", "--socket", str(tmp_path / "w.sock"), "--listen", "garbage"], env=env)
    assert bad.exit_code == 2 and "HOST:PORT" in bad.stderr and "API key" not in bad.stderr, bad.stderr
    keyless = runner.invoke(app, ["serve", "--socket", str(tmp_path / "w.sock"), "--listen", "127.0.0.1:0"], env=env)
    assert keyless.exit_code == 2 and "--listen needs an API key" in keyless.stderr, keyless.stderr


def test_a_listen_address_in_use_a_url_socket_and_an_empty_template_are_refused_before_the_load(tmp_path):
    import socket

    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    try:
        port = held.getsockname()[1]
        env = {"WEAVE_API_KEY": "k", "WEAVE_DEBUG": None, "WEAVE_SOCKET": None}
        busy = runner.invoke(app, ["serve", "--socket", str(tmp_path / "w.sock"), "--listen", f"127.0.0.1:{port}"],
                             env=env)
        assert busy.exit_code == 1 and f"cannot listen on 127.0.0.1:{port}" in busy.stderr, busy.stderr
    finally:
        held.close()
    url = runner.invoke(app, ["serve"], env={"WEAVE_SOCKET": "http://127.0.0.1:8080", "WEAVE_DEBUG": None})
    assert url.exit_code == 2 and "a URL" in url.stderr and not (tmp_path / "http:").exists(), url.stderr
    empty = tmp_path / "empty.jinja"
    empty.write_text("\n")
    refused = runner.invoke(app, ["serve", "--socket", str(tmp_path / "w.sock"), "--chat-template", str(empty)],
                            env={"WEAVE_DEBUG": None})
    assert refused.exit_code == 2 and "the file is empty" in refused.stderr, refused.stderr


def test_sigterm_during_the_load_stops_it_as_ctrl_c_does(monkeypatch):
    """What is under way (a conversion) runs its cleanups; the handler is the load's only."""
    import os
    import signal

    from weaved.cli import serve

    previous = signal.getsignal(signal.SIGTERM)
    cleaned = []
    try:
        serve.stop_on_sigterm()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # (the handler runs at the next bytecode boundary)
                pass
        except serve.Terminated:
            cleaned.append("raised")
        finally:
            cleaned.append("cleaned up")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert cleaned == ["raised", "cleaned up"]


def test_a_setting_this_host_cannot_honour_is_bad_usage(tmp_path):
    """Found once the daemon starts loading, but the fix is in the arguments: exit 2, as for a bad option."""
    (tmp_path / "plain").write_text("")
    r = runner.invoke(app, ["serve", "--socket", str(tmp_path / "w.sock"), "--data-dir", str(tmp_path / "plain")],
                      env={"WEAVE_DEBUG": None, "WEAVE_SOCKET": None})
    assert r.exit_code == 2 and "is a file, not a directory" in r.stderr, (r.exit_code, r.stderr)
    assert not (tmp_path / "w.sock").exists()


def test_a_bad_profile_or_template_leaves_no_socket_directory_made(tmp_path):
    sock = tmp_path / "run" / "weave" / "w.sock"
    env = {"WEAVE_DEBUG": None, "WEAVE_SOCKET": None}
    bad = runner.invoke(app, ["serve", "--socket", str(sock), "--profile", str(tmp_path / "missing.toml")], env=env)
    assert bad.exit_code == 2 and "missing.toml" in bad.stderr, bad.stderr
    empty = tmp_path / "empty.jinja"
    empty.write_text("\n")
    refused = runner.invoke(app, ["serve", "--socket", str(sock), "--chat-template", str(empty)], env=env)
    assert refused.exit_code == 2, refused.stderr
    assert not (tmp_path / "run").exists()
