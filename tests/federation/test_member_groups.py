"""A daemon's member groups at shutdown: leaving waits for the serve threads, and says which are still
inside a network wait (a thread woken during the interpreter's teardown aborts the process)."""

from __future__ import annotations

import threading
import time

import pytest

from weaved.backends.cpu import CPUBackend
from weaved.federation.comm import GroupSpec, PeerGroup, host_store
from weaved.federation.member_groups import JoinRefused, JoinRequest, MemberGroups
from weaved.kv.store import KVStore

pytestmark = pytest.mark.federation


def _joined(tmp_path, tiny_llama, name: str):
    """A member (rank 1) serving a group whose home (rank 0) is this thread's; returns both."""
    be = CPUBackend.from_file(tiny_llama, threads=1)
    members = MemberGroups(be, KVStore(tmp_path, be.config), "fp", "127.0.0.1")
    store = host_store(timeout_s=10.0)
    members.join(JoinRequest(name, 1, 2, "127.0.0.1", store.port, "home", "fp", timeout_s=10.0,
                             idle_timeout_s=30.0))
    home = PeerGroup.form(GroupSpec(name, 0, 2, port=store.port, timeout_s=10.0), store)
    for _ in range(200):  # the member reports "serving" once formed (bounded: 10 s)
        if [g["state"] for g in members.status()] == ["serving"]:
            break
        time.sleep(0.05)
    assert [g["state"] for g in members.status()] == ["serving"]
    return members, home


def _serve_threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == f"group-{name}"]


def test_stop_waits_for_the_serve_thread_to_end(tmp_path, tiny_llama):
    members, home = _joined(tmp_path, tiny_llama, "g-wait")
    # the home sees the member leave at its next operation and closes its side: the member's wait ends
    threading.Timer(0.3, home.close).start()
    assert members.stop(timeout_s=10.0) == []
    assert _serve_threads("g-wait") == [] and members.status() == []


def test_stop_names_a_group_whose_thread_still_waits_and_refuses_new_joins(tmp_path, tiny_llama):
    members, home = _joined(tmp_path, tiny_llama, "g-left")
    try:
        # the home stays silent: closing the member's group does not wake its wait for the next command
        assert members.stop(timeout_s=0.3) == ["g-left"]
        with pytest.raises(JoinRefused, match="stopping"):
            members.join(JoinRequest("g-new", 1, 2, "127.0.0.1", 1, "home", "fp", timeout_s=1.0, idle_timeout_s=1.0))
    finally:
        home.close()
    for t in _serve_threads("g-left"):  # (the home's close ends it; bounded)
        t.join(10.0)
    assert _serve_threads("g-left") == []
