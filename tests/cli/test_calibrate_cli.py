"""``weave calibrate``: measures the CPU pool's step-time model for a model, prints its rates and fit, and
stores it where ``weave serve`` reads it."""

from __future__ import annotations

import json
import math

from typer.testing import CliRunner
from weaved.cli.app import app

from weaved.daemon import rates


def test_calibrate_measures_prints_and_stores(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("WEAVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(rates, "FIT_LIMIT", math.inf)  # (how well it fits depends on what else runs here)
    out = CliRunner().invoke(app, ["calibrate", "--model", str(tiny_llama), "--profile", "cpu-only",
                                   "--data-dir", str(tmp_path / "data")])
    assert out.exit_code == 0, out.output
    assert "calibrating: 12/12 fitted" in out.output and "stored as" in out.output
    row = next(line for line in out.output.splitlines() if line.startswith("cpu "))
    prefill, decode = (float(x) for x in row.split()[1:3])
    assert prefill > 0 and decode > 0
    assert "is serving from" not in out.output
    stored = list((tmp_path / "data" / "calibration").glob("*.json"))
    assert len(stored) == 1 and json.loads(stored[0].read_text())["backend"] == "cpu"
    assert list((tmp_path / "cache" / "calibration").glob("*.json"))


def test_calibrate_json_is_the_result_alone_on_stdout(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("WEAVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(rates, "FIT_LIMIT", math.inf)
    out = CliRunner().invoke(app, ["calibrate", "--model", str(tiny_llama), "--profile", "cpu-only",
                                   "--data-dir", str(tmp_path / "data"), "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout)  # the progress went to stderr
    assert "calibrating" in out.stderr
    assert [p["name"] for p in result["pools"]] == ["cpu"] and result["pools"][0]["decode_tokens_per_s"] > 0
    assert result["step_model"]["decode"]["per_token_s"] > 0 and result["stored"].endswith(".json")


def test_calibrate_refuses_a_missing_model(tmp_path):
    out = CliRunner().invoke(app, ["calibrate", "--model", str(tmp_path / "none.gguf"), "--profile", "cpu-only"])
    assert out.exit_code == 2 and "model file not found" in out.output  # bad usage, as for serve


def test_calibrate_refuses_a_data_directory_it_cannot_make_before_measuring(tmp_path):
    (tmp_path / "plain").write_text("")
    out = CliRunner().invoke(app, ["calibrate", "--profile", "cpu-only", "--data-dir", str(tmp_path / "plain" / "d")])
    assert out.exit_code == 2 and "cannot make the data directory" in out.output and "Not a directory" in out.output
    assert "calibrating" not in out.output


def test_calibrate_refuses_an_unknown_profile_as_bad_usage(tmp_path):
    out = CliRunner().invoke(app, ["calibrate", "--profile", "nope"])
    assert out.exit_code == 2 and "no shipped profile" in out.output


def test_calibrate_says_when_a_daemon_serves_from_the_data_directory(tiny_llama, tmp_path, monkeypatch):
    import os

    from weaved.daemon.data_lock import data_dir_owner, lock_data_dir

    monkeypatch.setenv("WEAVE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "data").mkdir()
    assert data_dir_owner(tmp_path / "data") is None
    fd = lock_data_dir(tmp_path / "data")  # as a serving daemon holds it
    try:
        assert data_dir_owner(tmp_path / "data") == str(os.getpid())
        out = CliRunner().invoke(app, ["calibrate", "--model", str(tiny_llama), "--profile", "cpu-only",
                                       "--data-dir", str(tmp_path / "data")])
        assert out.exit_code == 0, out.output
        assert f"a daemon (pid {os.getpid()}) is serving from {tmp_path / 'data'}" in out.output
        assert "uses the new rates from its next start" in out.output
    finally:
        os.close(fd)
    assert data_dir_owner(tmp_path / "data") is None


def test_calibrate_refuses_an_empty_data_directory_as_serve_does():
    """An empty ``--data-dir "$UNSET"`` is not the current directory."""
    out = CliRunner().invoke(app, ["calibrate", "--profile", "cpu-only", "--data-dir", " "])
    assert out.exit_code == 2 and "--data-dir is empty" in out.output
