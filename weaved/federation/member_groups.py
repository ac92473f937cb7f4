"""The groups a daemon serves for other daemons: joined when a home asks over the control plane.

A home that forms a ring (or a pipeline) asks each peer to join with ``POST /federation/v1/groups``:
the group's name, the peer's rank, the size, and where the home's rendezvous store listens.  The
peer checks that it serves the same model, answers at once, and joins in a thread of its own: it
forms the group (the rendezvous completes when every rank has joined, or fails at the timeout) and
serves the home's commands until the home stops the group or a peer is lost.

The shards it holds are files in the daemon's own KV store (``shard_files``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from weaved.backends.cpu import CPUBackend
from weaved.federation.comm import GroupSpec, PeerGroup, PeerLost
from weaved.federation.protocol import ProtocolError
from weaved.federation.shard_files import delete_group_files, group_prefix, shard_files
from weaved.kv.store import KVStore

log = logging.getLogger("weave.federation")


class JoinRefused(ValueError):
    """A join request this node will not follow (the message says why)."""


@dataclass(frozen=True)
class JoinRequest:
    group: str  # unique per formation
    rank: int
    world: int
    host: str  # the home's rendezvous store
    port: int
    home: str  # the home node's name, for status and logs
    fingerprint: str  # the home's model: shards only mean something for the same model
    timeout_s: float
    idle_timeout_s: float


class MemberGroups:
    """Every group this daemon is a member of (rank > 0)."""

    def __init__(self, backend: CPUBackend, store: KVStore, fingerprint: str, bind_host: str,
                 publish: Callable[[str, dict], None] = lambda kind, data: None):
        self.backend, self.store, self.fingerprint, self.bind_host = backend, store, fingerprint, bind_host
        self._publish = publish
        self._lock = threading.Lock()
        self._groups: dict[str, dict] = {}  # name -> status entry
        self._members: dict[str, PeerGroup] = {}
        self._threads: dict[str, threading.Thread] = {}  # name -> the thread that joins and serves it
        self._stopping = False

    def join(self, req: JoinRequest) -> dict:
        """Accept a home's request and join in the background; raises ``JoinRefused``."""
        if req.fingerprint != self.fingerprint:
            raise JoinRefused(f"this node serves another model (fingerprint {self.fingerprint}, the home's is "
                              f"{req.fingerprint})")
        try:
            spec = GroupSpec(req.group, req.rank, req.world, host=req.host, port=req.port, bind_host=self.bind_host,
                             timeout_s=req.timeout_s, idle_timeout_s=req.idle_timeout_s)
        except ValueError as e:
            raise JoinRefused(str(e)) from None
        if req.rank == 0:
            raise JoinRefused("rank 0 is the home's own")
        with self._lock:
            if self._stopping:
                raise JoinRefused("this node is stopping")
            if req.group in self._groups:
                raise JoinRefused(f"already in group {req.group!r}")
            self._groups[req.group] = {"group": req.group, "home": req.home, "rank": req.rank, "world": req.world,
                                       "state": "joining", "since": time.time()}
            thread = self._threads[req.group] = threading.Thread(target=self._run, args=(spec, req),
                                                                 name=f"group-{req.group}", daemon=True)
        thread.start()
        return {"group": req.group, "rank": req.rank, "state": "joining"}

    def _set(self, name: str, **kw) -> None:
        with self._lock:
            if name in self._groups:
                self._groups[name].update(kw)

    def _run(self, spec: GroupSpec, req: JoinRequest) -> None:
        from weaved.federation.node_group import serve_member

        make, close = shard_files(self.store, group_prefix(spec.name))
        try:
            group = PeerGroup.form(spec)
            with self._lock:
                self._members[spec.name] = group
                if self._stopping:  # formed while the daemon stopped: leave at once
                    group.close()
            self._set(spec.name, state="serving")
            log.info("joined group %s of home %s as rank %d of %d", spec.name, req.home, spec.rank, spec.world_size)
            serve_member(group, self.backend, make, close)
            why = "stopped by the home"
        except (PeerLost, ProtocolError) as e:
            why = str(e)
        except Exception as e:  # never let a group take the daemon down
            log.exception("group %s failed", spec.name)
            why = f"{type(e).__name__}: {e}"
        delete_group_files(self.store, group_prefix(spec.name))  # a hand-off cut short leaves files unadopted
        log.info("left group %s: %s", spec.name, why)
        self._publish("group_left", {"group": spec.name, "home": req.home, "reason": why})
        with self._lock:
            self._groups.pop(spec.name, None)
            self._members.pop(spec.name, None)
            self._threads.pop(spec.name, None)

    def status(self) -> list[dict]:
        with self._lock:
            return [dict(g) for g in self._groups.values()]

    def stop(self, timeout_s: float = 5.0) -> list[str]:
        """Leave every group (the homes see the loss and rebuild elsewhere) and wait up to ``timeout_s``
        for their threads to end; returns the groups whose thread is still inside a network wait.

        Closing a group does not wake a wait already under way in this process: the thread ends when the
        home, seeing its connection closed, closes its own (at once while the home lives) or at the
        wait's timeout.  A thread that wakes while the interpreter exits aborts the process (its C++
        frames are unwound by the thread's forced exit), so the daemon waits here first, and a caller
        that is about to exit with threads still waiting ends the process without the interpreter's
        teardown."""
        with self._lock:
            self._stopping = True
            members = list(self._members.values())
            threads = list(self._threads.values())
        for g in members:
            g.close()
        deadline = time.monotonic() + timeout_s
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return sorted(t.name.removeprefix("group-") for t in threads if t.is_alive())
