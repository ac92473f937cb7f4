"""The data plane: one gloo process group per ring or pipeline, point-to-point messages with tags,
a timeout on every operation.

Group formation.  ``torch.distributed.init_process_group`` makes *the* default group of a process,
and ``dist.new_group`` only carves subgroups out of it, so neither lets a daemon join several
independent groups formed at different times with different peers.  We therefore build each group
directly: ``ProcessGroupGloo(PrefixStore(f"weave/{name}/", store), rank, size, options)``.  That is a
standalone group object, registered nowhere (torch's global group map is untouched), and it owns its
own TCP pairs, so any number of them can live in one process and die independently.  Rank 0 of a
group (the ring's home, the pipeline's first stage) hosts the ``TCPStore`` the rendezvous runs
through; a daemon hosts one store for every group it forms (``host_store``), and the prefix keeps
their keys apart.  A group name is used once: a group formed again after a failure takes a new name
(an epoch suffix), so stale rendezvous keys are never read.

Timeouts and failure.  Every wait has a deadline (``GroupSpec.timeout_s``).  gloo reports a peer
whose process died as "Connection closed by peer" at once, and a silent peer when the deadline
passes (it then closes the pair itself); both become ``PeerLost``.  A group that lost a peer is
broken for good: every later operation raises ``PeerLost`` immediately, and ``close`` drops it,
which closes our connections so the peers' pending waits fail fast instead of timing out.  (gloo
closes them when the group object is freed; a wait still under way in this process keeps it alive
until that wait ends, and nothing wakes such a wait but its peer or its deadline.)

A gloo send completes once the receiver has posted the matching receive, so protocols post their
receives before anyone waits on the sends, and a send's timeout also bounds how late the peer is.

Messages are numpy arrays in and out.  Both ends know every message's dtype and shape from the
protocol (the command header), so an array travels as its raw bytes, without metadata.  Empty
arrays are not sent at all (both ends skip them).
"""

from __future__ import annotations

import datetime as dt
import threading
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore


def _cause(e: BaseException) -> str:
    """gloo's message, first line, without its boilerplate advice."""
    return str(e).splitlines()[0].split(" This is typically")[0][:200]


class PeerLost(RuntimeError):
    """A peer of a group died, closed the group or did not answer within the timeout."""

    def __init__(self, group: str, peer: int | None, op: str, cause: str = ""):
        who = f"rank {peer}" if peer is not None else "a peer"
        super().__init__(f"group {group!r}: lost {who} during {op}" + (f": {cause}" if cause else ""))
        self.group = group
        self.peer = peer
        self.op = op


@dataclass(frozen=True)
class GroupSpec:
    """How one member joins one group.  Rank 0 hosts the rendezvous store at ``host:port``."""

    name: str  # unique per formation (an epoch suffix when re-forming after a failure)
    rank: int
    world_size: int
    host: str = "127.0.0.1"  # the store's address (rank 0's host)
    port: int = 0  # the store's port; rank 0 may pass 0 with a store from host_store()
    bind_host: str = "127.0.0.1"  # the address this member's gloo device listens on
    timeout_s: float = 10.0  # every send, receive and the rendezvous
    idle_timeout_s: float = 60.0  # a serve loop waiting for its next command (the home pings sooner)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside a group of {self.world_size}")
        if self.timeout_s <= 0 or self.idle_timeout_s <= 0:
            raise ValueError("timeouts must be positive")


def host_store(host: str = "127.0.0.1", port: int = 0, timeout_s: float = 10.0) -> TCPStore:
    """The rendezvous store a home hosts for the groups it forms; ``port=0`` picks a free port
    (read it back from ``store.port`` and give it to the peers)."""
    return TCPStore(host, port, None, True, timeout=dt.timedelta(seconds=timeout_s), wait_for_workers=False)


class Pending:
    """One posted send or receive; ``wait`` completes it or raises ``PeerLost``."""

    def __init__(self, group: PeerGroup, work, peer: int, op: str, keep: object):
        self._group, self._work, self._peer, self._op = group, work, peer, op
        self._keep = keep  # the buffer gloo reads or writes must outlive the operation

    def wait(self, timeout_s: float | None = None) -> None:
        if self._work is None:
            return
        g = self._group
        t = g.spec.timeout_s if timeout_s is None else timeout_s
        try:
            self._work.wait(dt.timedelta(seconds=t))
        except RuntimeError as e:  # gloo: "Connection closed by peer", "Timed out waiting ...", closed pair
            raise PeerLost(g.name, self._peer, self._op, g.mark_broken(_cause(e))) from None
        finally:
            self._work = None


class PeerGroup:
    """A formed gloo group: tagged point-to-point messages between its ranks."""

    def __init__(self, spec: GroupSpec, pg: ProcessGroupGloo, store: TCPStore):
        self.spec = spec
        self._pg = pg
        self._store = store  # rank 0's store must live as long as the group (peers may still read it)
        self._broken: str | None = None
        self._lock = threading.Lock()

    def mark_broken(self, cause: str) -> str:
        """Record that an operation of the group failed (every later one raises ``PeerLost``); returns
        ``cause``."""
        self._broken = cause
        return cause

    @classmethod
    def form(cls, spec: GroupSpec, store: TCPStore | None = None) -> PeerGroup:
        """Join the group; returns once every rank has joined, or raises ``PeerLost`` after the timeout.
        Rank 0 passes the store it hosts (or none: then it hosts one at ``spec.host:spec.port``)."""
        timeout = dt.timedelta(seconds=spec.timeout_s)
        try:
            if store is None:
                is_master = spec.rank == 0
                store = TCPStore(spec.host, spec.port, None, is_master, timeout=timeout, wait_for_workers=False)
            opts = ProcessGroupGloo._Options()
            opts._timeout = timeout
            # an explicit address: gloo's default resolves the hostname, which may not be loopback
            opts._devices = [ProcessGroupGloo.create_device(hostname=spec.bind_host)]
            pg = ProcessGroupGloo(PrefixStore(f"weave/{spec.name}/", store), spec.rank, spec.world_size, opts)
        except RuntimeError as e:  # store connect or rendezvous timed out, or a peer vanished
            raise PeerLost(spec.name, None, "rendezvous", _cause(e)) from None
        return cls(spec, pg, store)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def rank(self) -> int:
        return self.spec.rank

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def _post(self, arr: np.ndarray, peer: int, tag: int, send: bool) -> Pending:
        op = f"{'send to' if send else 'recv from'} {peer} tag {tag}"
        if self._broken is not None:
            raise PeerLost(self.name, None, op, f"group already broken ({self._broken})")
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"bad peer {peer} for rank {self.rank} of {self.world_size}")
        if not arr.flags.c_contiguous:
            raise ValueError("message arrays must be C-contiguous")
        if arr.size == 0:
            return Pending(self, None, peer, op, None)
        t = torch.from_numpy(arr.reshape(-1).view(np.uint8))  # shares arr's memory: no copy
        with self._lock:  # gloo's python entry points are not documented thread-safe; keep posts serial
            try:
                work = self._pg.send([t], peer, tag) if send else self._pg.recv([t], peer, tag)
            except RuntimeError as e:
                self._broken = _cause(e)
                raise PeerLost(self.name, peer, op, self._broken) from None
        return Pending(self, work, peer, op, (arr, t))

    def isend(self, arr: np.ndarray, dst: int, tag: int) -> Pending:
        """Post a send of ``arr``'s bytes; ``arr`` must not change until the send is waited on."""
        return self._post(arr, dst, tag, True)

    def irecv(self, arr: np.ndarray, src: int, tag: int) -> Pending:
        """Post a receive into ``arr`` (its size must be the message's)."""
        return self._post(arr, src, tag, False)

    def send(self, arr: np.ndarray, dst: int, tag: int, timeout_s: float | None = None) -> None:
        self.isend(arr, dst, tag).wait(timeout_s)

    def recv(self, arr: np.ndarray, src: int, tag: int, timeout_s: float | None = None) -> np.ndarray:
        self.irecv(arr, src, tag).wait(timeout_s)
        return arr

    def close(self) -> None:
        """Leave the group: drop it (its connections close) so that peers blocked on us fail now
        rather than at their timeout.  Idempotent; later operations raise ``PeerLost``."""
        if self._pg is None:
            return
        if self._broken is None:
            self._broken = "closed"
        try:
            self._pg.abort()
        except RuntimeError:
            pass
        self._pg = None


def wait_all(pending: list[Pending]) -> None:
    """Wait for every operation; the first failure raises (the others are abandoned with the group)."""
    for p in pending:
        p.wait()
