"""End to end: ``weave serve`` on a machine whose kernel cache is empty compiles its kernels at load -
not at the first request - then starts again in the same process and serves from the cache, with
less resident memory; the requests after it compile nothing, and a later start neither compiles nor
restarts."""

from __future__ import annotations

import os
import re
from pathlib import Path

import psutil
import pytest

from tests.api.conftest import uds_client
from tests.api.serve_proc import weave_serve

pytestmark = pytest.mark.slow

SAY_HI = [{"role": "user", "content": "Say hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}
# the request shapes a first turn may take: the API's default sampling, greedy, several choices,
# log-probabilities, penalties (the row edited before the uncompiled chain), a grammar, a stream
REQUESTS = [
    {"messages": SAY_HI, "max_tokens": 6},
    {"messages": SAY_HI, "max_tokens": 6, "temperature": 0},
    {"messages": SAY_HI, "max_tokens": 6, "n": 3},
    {"messages": SAY_HI, "max_tokens": 6, "logprobs": True, "top_logprobs": 3},
    {"messages": SAY_HI, "max_tokens": 6, "frequency_penalty": 0.5, "seed": 1},
    {"messages": SAY_HI, "max_tokens": 12, "response_format": {"type": "json_object"}},
    {"messages": SAY_HI, "max_tokens": 24, "tools": [TOOL], "tool_choice": "required"},
    {"messages": SAY_HI, "max_tokens": 6, "stream": True},
]


def _kernels(c) -> dict:
    return c.get("/v1/status").json()["kernels"]


def test_a_cold_kernel_cache_is_compiled_at_load_and_served_by_a_fresh_process(tmp_path: Path, smollm2_q4_0: Path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}  # empty: every kernel compiles
    with weave_serve(tmp_path / "first", "--model", str(smollm2_q4_0), env=env) as served:
        out = served.output
        assert "compiling the kernels for this machine" in out
        assert out.count("starting again to serve them from the cache") == 1, out
        assert out.index("starting again") < out.index("ready on")
        before = int(re.search(r"\((\d+) MB resident now\)", out).group(1))
        # exec: the process serving is the one started, holding less than it did with the compiler's modules
        assert psutil.Process(served.proc.pid).memory_info().rss / 1e6 < before
        with uds_client(served.socket, timeout=120.0) as c:
            assert _kernels(c) == {"compiled_at_load": 0, "compile_s_at_load": 0.0, "compiled_while_serving": 0}
            for body in REQUESTS:
                r = c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
            r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "echo": True, "logprobs": 2})
            assert r.status_code == 200, r.text
            sid = c.post("/v1/sessions", json={}).json()["id"]
            assert c.post(f"/v1/sessions/{sid}/turns", json={"messages": SAY_HI, "max_tokens": 4}).status_code == 200
            assert c.post(f"/v1/sessions/{sid}/fork", json={}).status_code == 200
            # the warm-up at load ran every path these took: none waited for a compilation
            assert _kernels(c)["compiled_while_serving"] == 0
            assert 'weave_kernel_compilations_total{phase="serving"} 0.0' in c.get("/metrics").text
    assert served.proc.returncode == 0, served.output
    with weave_serve(tmp_path / "second", "--model", str(smollm2_q4_0), env=env) as again:
        assert "compiling" not in again.output and "starting again" not in again.output, again.output
