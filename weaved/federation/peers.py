"""The daemon's peers: those named in the profile and those added at run time, and what each last reported.

``PeerRegistry`` is the control plane's memory.  A background thread checks every peer each
``interval_s`` (``probe``: health, then the peer's report) and records its state - ``alive``,
``dead`` or ``unauthorized`` - with the latency, the last error and the report: hardware, free KV,
load, and the layers it can hold for this node.  Readers (``/v1/status``, ``/v1/peers``, the
router's ``peers_alive``) only copy the recorded state under a lock, so they never wait on the
network; the checker takes the lock only to store a result.

Profile peers are fixed for the daemon's life (the profile is their source: edit it and restart);
run-time peers (``add``/``remove``) are saved in ``<data_dir>/peers.json`` and restored on start.

Layers a peer can hold: Q-Ring shards and pipeline stages are only meaningful between daemons that
serve the same model, so a peer whose model fingerprint (``weaved.federation.node_report.weights_fingerprint``)
matches ours can hold all of its layers, and any other peer none, with the reason.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from weaved.config.profile import PEER_NAME_RE, PEER_NAME_RULE, PeerConfig
from weaved.config.tables import Invalid
from weaved.errors import Conflict, InvalidRequest, NotFound
from weaved.federation.peer_store import load_peers, save_peers
from weaved.federation.probe import ALIVE, DEAD, UNKNOWN, Probe, probe

SELF, DUPLICATE = "self", "duplicate"  # states of a peer that is no other daemon

MAX_TOKEN_CHARS = 4096
MAX_CHECK_THREADS = 8


@dataclass(frozen=True)
class LocalModel:
    """What this node serves, to judge what a peer can hold for it."""

    name: str
    fingerprint: str
    n_layers: int
    instance: str | None = None  # this daemon's own id (``Daemon.instance``): a peer reporting it is us


@dataclass
class _Peer:
    config: PeerConfig
    source: str  # "profile" | "runtime"
    state: str = UNKNOWN
    latency_ms: float | None = None
    last_error: str | None = None
    checked_at: float | None = None  # wall clock of the last finished check
    last_alive_at: float | None = None
    failures: int = 0  # checks failed in a row
    report: dict | None = None  # the last report received (kept when the peer dies, with its time)
    reported_at: float | None = None
    added_at: float = field(default_factory=time.time)


def layers_for(report: dict | None, local: LocalModel | None) -> dict:
    """``{"count", "of", "reason"}``: how many of our layers the peer can hold."""
    of = local.n_layers if local else 0
    if report is None:
        return {"count": 0, "of": of, "reason": "no report from the peer yet"}
    model = report.get("model") or {}
    if local is None:
        return {"count": 0, "of": of, "reason": "this node has no model loaded"}
    if model.get("fingerprint") != local.fingerprint:
        return {"count": 0, "of": of, "reason": f"it serves another model ({model.get('name', '?')}, fingerprint "
                                                f"{model.get('fingerprint', '?')}; ours is {local.fingerprint})"}
    return {"count": local.n_layers, "of": of, "reason": f"same model ({local.name}): every layer"}


class PeerRegistry:
    def __init__(self, profile_peers: tuple[PeerConfig, ...] | list[PeerConfig] = (), *,
                 store_path: Path | None = None, local: LocalModel | None = None, interval_s: float = 5.0,
                 timeout_s: float = 2.0, log: Callable[[str], None] = print,
                 transport: httpx.BaseTransport | None = None):
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError("interval_s and timeout_s must be positive")
        self.local = local
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._store_path = store_path
        self._log = log
        self._transport = transport  # tests: an in-process transport
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {p.name: _Peer(p, "profile") for p in profile_peers}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        if store_path is not None:
            for p in load_peers(store_path, log):
                if p.name in self._peers:
                    log(f"run-time peer {p.name!r} ignored: the profile names a peer of that name")
                else:
                    self._peers[p.name] = _Peer(p, "runtime")

    # ---- reading ---------------------------------------------------------------------------------
    def _view(self, p: _Peer) -> dict:
        rep = p.report or {}
        return {
            "name": p.config.name, "url": p.config.url, "source": p.source, "state": p.state,
            # (a peer that does not answer has no latency: its last one would read as current)
            "alive": p.state == ALIVE,
            "latency_ms": None if p.latency_ms is None or p.state != ALIVE else round(p.latency_ms, 3),
            "last_error": p.last_error, "checked_at": p.checked_at, "last_alive_at": p.last_alive_at,
            "failures": p.failures, "node": rep.get("node"), "model": rep.get("model"),
            "hardware": rep.get("hardware"), "kv": rep.get("kv"), "load": rep.get("load"),
            "layers": layers_for(p.report, self.local), "reported_at": p.reported_at,
        }

    def list(self) -> list[dict]:
        """Every peer with its state (no tokens), profile peers first, then in the order added."""
        with self._lock:
            return [self._view(p) for p in self._peers.values()]

    def get(self, name: str) -> dict:
        with self._lock:
            p = self._peers.get(name)
            if p is None:
                raise NotFound(f"no peer {name!r}", param="name")
            return self._view(p)

    def peers_alive(self) -> int:
        """Peers answering health checks that serve our model: what the router may count on for a
        Q-Ring or a pipeline (a live peer with another model can hold none of our layers)."""
        with self._lock:
            return sum(1 for p in self._peers.values()
                       if p.state == ALIVE and layers_for(p.report, self.local)["count"] > 0)

    def usable(self) -> list[PeerConfig]:
        """The live peers that serve our model (what ``peers_alive`` counts), with their tokens: the
        peers a ring or a pipeline may be formed with."""
        with self._lock:
            return [p.config for p in self._peers.values()
                    if p.state == ALIVE and layers_for(p.report, self.local)["count"] > 0]

    def mark_dead(self, name: str, why: str) -> None:
        """Record at once what the data plane learned (a peer lost mid-step, a refused join), rather
        than waiting for the next health check; a later check that succeeds makes it alive again."""
        with self._lock:
            p = self._peers.get(name)
            peer = p if p is not None and p.state == ALIVE else None
        if peer is not None:
            self._record(peer, Probe(DEAD, error=why))

    # ---- changing --------------------------------------------------------------------------------
    def add(self, name: str, url: str, token: str) -> dict:
        """A run-time peer: validated, saved, and checked at once (in the background)."""
        if not PEER_NAME_RE.fullmatch(name or ""):
            raise InvalidRequest(f"peer name {name!r}: {PEER_NAME_RULE}", param="name")
        if len(token) > MAX_TOKEN_CHARS:
            raise InvalidRequest(f"the token is longer than {MAX_TOKEN_CHARS} characters", param="token")
        try:
            cfg = PeerConfig(name, url, token)
        except Invalid as e:
            raise InvalidRequest(f"{e.field}: {e.reason}", param=e.field) from None
        with self._lock:
            if name in self._peers:
                src = self._peers[name].source
                raise Conflict(f"a peer named {name!r} already exists (from the {src}); remove it first or "
                               "pick another name", param="name")
            same = [p.config.name for p in self._peers.values() if _same_url(p.config.url, url)]
            if same:
                raise Conflict(f"peer {same[0]!r} already has the url {url}", param="url")
            peer = _Peer(cfg, "runtime")
            self._peers[name] = peer
            try:
                self._save()
            except OSError as e:
                del self._peers[name]
                raise InvalidRequest(f"cannot save the peer list: {e.strerror or e}") from None
            view = self._view(peer)
        self._log(f"peer {name!r} added at {url}")
        self._wake.set()
        return view

    def remove(self, name: str) -> dict:
        with self._lock:
            p = self._peers.get(name)
            if p is None:
                raise NotFound(f"no peer {name!r}", param="name")
            if p.source == "profile":
                raise Conflict(f"peer {name!r} is named in the profile and cannot be removed at run time; "
                               "remove it from the profile and restart the daemon", param="name")
            del self._peers[name]
            try:
                self._save()
            except OSError as e:
                self._peers[name] = p
                raise InvalidRequest(f"cannot save the peer list: {e.strerror or e}") from None
            view = self._view(p)
        self._log(f"peer {name!r} removed")
        return view

    def _save(self) -> None:  # the lock held
        if self._store_path is not None:
            save_peers(self._store_path, [p.config for p in self._peers.values() if p.source == "runtime"])

    # ---- checking --------------------------------------------------------------------------------
    def _record(self, peer: _Peer, result: Probe) -> None:
        now = time.time()
        with self._lock:
            if self._peers.get(peer.config.name) is not peer:
                return  # removed (or replaced) while it was being checked
            was = peer.state
            if result.state == ALIVE:
                result = self._same_daemon(peer, result)
            peer.state, peer.checked_at = result.state, now
            if result.latency_ms is not None:
                peer.latency_ms = result.latency_ms
            if result.state == ALIVE:
                peer.last_error, peer.failures, peer.last_alive_at = None, 0, now
                peer.report, peer.reported_at = result.report, now
            else:
                peer.last_error, peer.failures = result.error, peer.failures + 1
        if was != result.state:
            self._log(f"peer {peer.config.name!r}: {was} -> {result.state}"
                      + (f" ({result.error})" if result.error else ""))

    def _same_daemon(self, peer: _Peer, result: Probe) -> Probe:
        """A live answer from this daemon itself, or from a daemon another peer already is (one node named
        twice, e.g. under ``localhost`` and ``127.0.0.1``), is not another peer: it would count twice and
        join its own ring.  The lock held."""
        instance = (result.report or {}).get("instance")
        if instance is None:
            return result
        if self.local is not None and instance == self.local.instance:
            return Probe(SELF, latency_ms=result.latency_ms,
                         error="this is this daemon itself: remove it from the peers (a shared peers list "
                               "may name every node; each must leave itself out)")
        twin = next((o.config.name for o in self._peers.values() if o is not peer and o.state == ALIVE
                     and (o.report or {}).get("instance") == instance), None)
        if twin is not None:
            return Probe(DUPLICATE, latency_ms=result.latency_ms,
                         error=f"the same daemon as peer {twin!r} (another url for it): remove one of them")
        return result

    def check_now(self) -> None:
        """Check every peer once, concurrently; returns when all are recorded: each within about two
        timeouts, the round within a deadline whatever a peer does."""
        with self._lock:
            peers = list(self._peers.values())
        if not peers:
            return
        pool = self._pool or ThreadPoolExecutor(MAX_CHECK_THREADS, thread_name_prefix="peer-check")
        try:
            futures = [(p, pool.submit(probe, p.config, self.timeout_s, self._transport)) for p in peers]
            # one deadline for the round: a check that overruns it (a peer that holds a connection
            # open) is a dead peer, and the round - and whoever waits on it - goes on
            waves = -(-len(peers) // MAX_CHECK_THREADS)  # checks wait for a thread beyond that many peers
            limit = (2 * waves + 1) * self.timeout_s  # each check's two requests, and a margin
            deadline = time.monotonic() + limit
            for p, fut in futures:
                try:
                    result = fut.result(timeout=max(0.0, deadline - time.monotonic()))
                except FutureTimeout:
                    result = Probe(DEAD, error=f"no whole answer within {limit:g} s")
                except Exception as e:  # noqa: BLE001 - a bug in one check must not stop the others
                    result = Probe(DEAD, error=f"check failed: {type(e).__name__}: {e}")
                self._record(p, result)
        finally:
            if pool is not self._pool:
                pool.shutdown(wait=False)

    def start(self) -> None:
        """Check every peer now and then every ``interval_s``, in a daemon thread, until ``stop``."""
        if self._thread is not None:
            return
        self._pool = ThreadPoolExecutor(MAX_CHECK_THREADS, thread_name_prefix="peer-check")

        def run() -> None:
            while not self._stop.is_set():
                self._wake.clear()
                self.check_now()
                self._wake.wait(self.interval_s)

        self._thread = threading.Thread(target=run, name="peer-health", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Start the next round of checks now."""
        self._wake.set()

    def stop(self) -> None:
        """Stop checking; returns once a round in flight has ended (bounded by the check timeouts)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(2 * self.timeout_s + 5.0)
            self._thread = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def _same_url(a: str, b: str) -> bool:
    return a.rstrip("/").lower() == b.rstrip("/").lower()
