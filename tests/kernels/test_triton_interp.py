"""The Triton kernels, run by Triton's interpreter on CPU tensors (the cases are in
``triton_interp_cases`` - the products and the backend on them -, ``triton_rowwise_cases``,
``triton_attention_cases``, ``triton_router_cases``, ``triton_fused_cases`` and ``triton_graphs_cases``):
a fresh process, because TRITON_INTERPRET must be set before triton is first imported, and this one may
have imported it already."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
# two processes (about 3 minutes and 1 in the interpreter on a 2-core Intel VM), each within its own
# time limit
CASES = [("triton_interp_cases.py", "triton_router_cases.py"),
         ("triton_graphs_cases.py", "triton_rowwise_cases.py", "triton_attention_cases.py", "triton_fused_cases.py")]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
@pytest.mark.parametrize("files", CASES, ids=lambda f: f[0].removesuffix("_cases.py"))
def test_triton_kernels_in_the_interpreter(files):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("WEAVE_TORCH_KERNELS", None)
    env.pop("WEAVE_DECODE_GRAPHS", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(str(HERE / f) for f in files)]
    r = subprocess.run(cmd, cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout, r.stdout[-3000:]
