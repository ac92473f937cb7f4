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
