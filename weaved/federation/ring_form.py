"""Forming a group from the home's side: ask each peer to join over its control plane, then join.

The home hosts the rendezvous store (one per daemon, every group it forms uses it under its own
prefix), posts ``POST /federation/v1/groups`` to every peer with its rank, and then joins as rank 0:
``PeerGroup.form`` returns once every rank has joined, or raises ``PeerLost`` at the timeout.  A peer
that refuses or cannot be reached is named in ``JoinFailed`` before anything is formed; the peers
that did accept give up on their own when their rendezvous times out.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import httpx
from torch.distributed import TCPStore

from weaved.config.profile import PeerConfig
from weaved.federation.comm import GroupSpec, PeerGroup
from weaved.federation.member_groups import JoinRequest

GROUPS_PATH = "/federation/v1/groups"


class JoinFailed(RuntimeError):
    def __init__(self, failures: list[tuple[PeerConfig, str]]):
        super().__init__("; ".join(f"peer {p.name!r} did not join: {why}" for p, why in failures))
        self.failures = failures


@dataclass(frozen=True)
class FormSpec:
    home: str  # this node's name
    host: str  # the address peers reach this node's store and gloo device at
    fingerprint: str
    timeout_s: float
    idle_timeout_s: float
    http_timeout_s: float = 5.0


def _ask(peer: PeerConfig, req: JoinRequest, timeout_s: float, transport) -> str | None:
    """None when the peer accepted, else why not."""
    try:
        with httpx.Client(timeout=timeout_s, transport=transport, trust_env=False) as c:
            r = c.post(peer.url.rstrip("/") + GROUPS_PATH, json=asdict(req),
                       headers={"Authorization": f"Bearer {peer.token}"})
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    if r.status_code == 202:
        return None
    try:
        msg = r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = r.text[:200]
    return f"HTTP {r.status_code}: {msg}"


def form_group(name: str, peers: list[PeerConfig], store: TCPStore, spec: FormSpec,
               transport: httpx.BaseTransport | None = None) -> PeerGroup:
    """The group ``name`` of this node (rank 0) and ``peers`` (ranks 1 .. N, in order)."""
    world = len(peers) + 1
    reqs = [JoinRequest(name, r, world, spec.host, store.port, spec.home, spec.fingerprint, spec.timeout_s,
                        spec.idle_timeout_s) for r in range(1, world)]
    if peers:
        with ThreadPoolExecutor(len(peers), thread_name_prefix="group-join") as ex:
            answers = list(ex.map(lambda p, q: _ask(p, q, spec.http_timeout_s, transport), peers, reqs))
        failures = [(p, why) for p, why in zip(peers, answers, strict=True) if why is not None]
        if failures:
            raise JoinFailed(failures)
    return PeerGroup.form(GroupSpec(name, 0, world, host=spec.host, port=store.port, bind_host=spec.host,
                                    timeout_s=spec.timeout_s, idle_timeout_s=spec.idle_timeout_s), store)
