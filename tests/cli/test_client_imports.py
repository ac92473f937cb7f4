"""Client commands start instantly: importing the CLI and running ``weave ps`` loads no engine, no torch,
numba or numpy, no server framework and no TUI (checked in a fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.cli.fake_server import FakeDaemon, seed_sessions, short_socket_dir

FORBIDDEN = ("torch", "numba", "numpy", "llama_cpp", "gguf", "fastapi", "starlette", "uvicorn", "textual",
             "httpx", "httpcore", "psutil", "pynvml", "weaved.engine", "weaved.daemon", "weaved.backends",
             "weaved.kernels", "weaved.model", "weaved.api", "weaved.kv", "weaved.tui")

PROBE = """
import json, sys
from weaved.cli.app import app
try:
    app({args!r}, standalone_mode=False)
finally:
    sys.stdout.flush()
    print("\\nMODULES=" + json.dumps(sorted(sys.modules)))
"""


def loaded_modules(socket: str, args: list[str]) -> tuple[str, list[str]]:
    code = PROBE.format(args=args)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={"WEAVE_SOCKET": socket, "PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    assert res.returncode == 0, res.stderr
    out, _, mods = res.stdout.rpartition("\nMODULES=")
    return out, json.loads(mods)


@pytest.mark.parametrize("args", [["ps"], ["status", "--json"]])
def test_client_commands_import_nothing_heavy(args):
    with short_socket_dir() as d, FakeDaemon(d / "w.sock") as fake:
        seed_sessions(fake)
        out, modules = loaded_modules(str(fake.socket_path), args)
    assert "s-3f9c2a1b7d4e8f60" in out  # the command did run against the daemon
    heavy = sorted(m for m in modules if any(m == f or m.startswith(f + ".") for f in FORBIDDEN))
    assert heavy == []
