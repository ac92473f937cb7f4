"""The daemon fixture: a cpu-only daemon on the tiny llama model, in a fresh data directory."""

from __future__ import annotations

import pytest

from tests.daemon.support import make_daemon


@pytest.fixture
def daemon(tiny_llama, tmp_path):
    d = make_daemon(tiny_llama, tmp_path / "data")
    yield d
    d.shutdown()
