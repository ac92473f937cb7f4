"""Sessions that share a prompt prefix, promoted to a GPU pool (the torch backend, on torch's CPU device
here): the prefix's rows cross to the device once, each later promotion copies only the session's own
rows, and the device pool's free room is what status and the router see."""

from __future__ import annotations

import time

import pytest

from tests.daemon.test_coexec import (  # noqa: F401 (daemon_factory: a fixture)
    BG,
    backends,
    daemon_factory,
    prompt_ids,
    record_migrations,
    start,
)
from weaved.engine.sampling import SamplingParams
from weaved.kv.prefixes import BLOCK as PBLOCK

pytest.importorskip("torch")

GREEDY4 = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _wait(cond, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_promotions_copy_a_shared_prefix_once_per_device(daemon_factory):  # noqa: F811
    d = daemon_factory()
    moves = record_migrations(d)
    base = prompt_ids(2 * PBLOCK + 30, 7)
    sids = []
    for i in range(3):  # background sessions on the CPU pool, the later ones mapping the first's prefix
        sid = d.create_session(BG)["id"]
        start(d, sid, base + [10 + i, 11 + i], GREEDY4).finish()
        sids.append(sid)
        if i == 0:
            _wait(lambda: d.store.prefixes.status()["files"] >= 1, "the first prompt was not published")
    sessions = [d.sessions[s] for s in sids]
    assert all(s.kv.shared is not None and s.kv.shared.positions == 2 * PBLOCK for s in sessions)

    gpu, _cpu = backends(d)
    bpt = d.config.kv_bytes_per_token
    for sid in sids:  # promoted one after the other: the copy happens when the next turn is admitted
        d.promote(sid)
        start(d, sid, [20, 21], GREEDY4).finish()
    promotions = [m for m in moves if m["reason"] == "promotion"]
    assert [m["session"] for m in promotions] == sids
    first, *later = promotions
    assert first["bytes"] == first["kv_tokens"] * bpt  # the prefix crosses with the first session
    for m in later:
        assert m["bytes"] == (m["kv_tokens"] - 2 * PBLOCK) * bpt  # then only each session's own rows
    status = d.status()["kv"]
    assert status["device_free_bytes"] == gpu.device_kv_capacity() - gpu.device_kv_bytes()
    with d._lock:  # the router's room on the device: what is free and what idle sessions would give back
        idle = d.idle_device_bytes(gpu)
        assert 0 < idle < gpu.device_kv_bytes()  # (the shared prefix is not any one session's to give)
        assert d._system_state().pools[0].free_kv_tokens == (status["device_free_bytes"] + idle) // bpt
