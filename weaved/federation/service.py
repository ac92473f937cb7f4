"""Glue between the daemon and its control plane: the peer registry a daemon builds at load, and
whether (and where) ``weave serve`` listens for its peers.

The listener runs only when the profile names peers or a federation port is given (``--federation-port``
or ``[federation] port``): a daemon nobody federates with opens no TCP port.  It binds 127.0.0.1
unless ``[federation] bind`` says otherwise, and it needs the shared token (``[federation] token``
or ``token_env``): without one it would have to accept anybody, so ``weave serve`` refuses to start.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from weaved.config.profile import DEFAULT_FEDERATION_PORT, Profile

PEERS_FILE = "peers.json"


class FederationError(Exception):
    """The control plane cannot be served as configured (the message says what to set)."""


@dataclass(frozen=True)
class FederationListen:
    host: str
    port: int  # 0: any free port (the server reports the one it got)
    token: str = field(repr=False)


def federation_listen(profile: Profile, port: int | None = None) -> FederationListen | None:
    """Where this daemon serves its control plane, or None when it has no reason to."""
    fed = profile.federation
    port = fed.port if port is None else port
    if port is None and not profile.peers:
        return None
    if port is not None and not 0 <= port <= 65535:
        raise FederationError(f"the federation port must be in 0..65535, got {port}")
    if not fed.token:
        why = "peers are configured" if port is None else f"a federation port ({port}) is set"
        raise FederationError(f"{why} but no federation token: set token or token_env in the profile's "
                              "[federation] table (every peer must send it)")
    return FederationListen(fed.bind, DEFAULT_FEDERATION_PORT if port is None else port, fed.token)


def peer_registry(daemon: Any):
    """The registry of a daemon being loaded (its model known): profile peers plus the run-time
    peers saved in its data directory, checked at the profile's interval."""
    from weaved.federation.node_report import weights_fingerprint
    from weaved.federation.peers import LocalModel, PeerRegistry

    fed, cfg = daemon.profile.federation, daemon.config
    local = LocalModel(daemon.model_name, weights_fingerprint(daemon), cfg.n_layers, getattr(daemon, "instance", None))
    return PeerRegistry(daemon.profile.peers, store_path=daemon.data_dir / PEERS_FILE, local=local,
                        interval_s=fed.health_interval_s, timeout_s=fed.health_timeout_s, log=daemon.log)


def federation_app(daemon: Any, listen: FederationListen):
    """The control-plane app serving ``daemon``'s report, behind the token guard."""
    from weaved.federation.control import create_federation_app
    from weaved.federation.node_report import node_report

    members = getattr(daemon, "member_groups", None)
    return create_federation_app(lambda: node_report(daemon), listen.token, daemon.profile.host.name,
                                 join=members.join if members is not None else None)


def advertise_host(bind: str) -> str:
    """The address peers reach this node's rendezvous store and data plane at."""
    return socket.gethostname() if bind in ("0.0.0.0", "::", "") else bind


def ring_factory(daemon: Any, listen: FederationListen):
    """What ``build_pools`` calls for a ``qring`` pool: a ``RingBackend`` homing this daemon's ring
    sessions on the daemon's peers (its registry, KV store and events)."""
    from weaved.federation.node_report import weights_fingerprint
    from weaved.federation.qring import check_heads_per_group
    from weaved.federation.ring_backend import RingBackend
    from weaved.federation.ring_form import FormSpec

    def make(cfg, cpu):
        prof, fed = daemon.profile, daemon.profile.federation
        check_heads_per_group(daemon.config.n_kv_heads, fed.ring_heads_per_group)  # at start, not a first ring turn
        spec = FormSpec(prof.host.name, advertise_host(listen.host), weights_fingerprint(daemon),
                        fed.ring_timeout_s, fed.ring_idle_timeout_s)
        return RingBackend(cpu, daemon.peers, daemon.store, spec, heads_per_group=fed.ring_heads_per_group,
                           pipeline_min_tokens=prof.routing.pipeline_min_prompt_tokens,
                           # set from the calibrated rates once the pools are built (daemon.rates)
                           default_speed=prof.routing.cpu_prefill_tokens_per_s or 1.0, publish=daemon.publish,
                           node_tokens=prof.routing.node_kv_tokens)

    return make


def member_groups(daemon: Any, listen: FederationListen):
    """The groups this daemon joins for its peers (needs a CPU pool: members compute with its
    backend), or None."""
    from weaved.federation.member_groups import MemberGroups
    from weaved.federation.node_report import weights_fingerprint

    cpu = next((p.backend for p in daemon.pools.values() if p.backend.name == "cpu"), None)
    if cpu is None:
        return None
    return MemberGroups(cpu, daemon.store, weights_fingerprint(daemon), advertise_host(listen.host),
                        publish=daemon.publish)
