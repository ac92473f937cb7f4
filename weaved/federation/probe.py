"""One health check of one peer: ``GET /federation/v1/health`` (liveness and latency), then
``GET /federation/v1/info`` (what it reports), each bounded by a timeout.

Every way a check can fail becomes a state and one line a person can act on: a peer that refuses
our token is ``unauthorized`` (its process is up, our token for it is wrong), anything else that
keeps us from a valid answer - refused connection, timeout, an HTTP error, a body that is not a
Weave report - is ``dead``.  Nothing here raises: the checker thread must survive every peer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import httpx

from weaved.config.profile import PeerConfig

HEALTH_PATH = "/federation/v1/health"
INFO_PATH = "/federation/v1/info"

ALIVE, DEAD, UNAUTHORIZED, UNKNOWN = "alive", "dead", "unauthorized", "unknown"


@dataclass(frozen=True)
class Probe:
    state: str  # ALIVE | DEAD | UNAUTHORIZED
    latency_ms: float | None = None  # the health request's round trip
    error: str | None = None
    report: dict | None = None  # the peer's /info answer (alive only)


def _message(r: httpx.Response) -> str:
    try:
        err = r.json().get("error") or {}
        return str(err.get("message") or "")[:200]
    except (ValueError, AttributeError):
        return " ".join(r.text.split())[:200]


MAX_BODY = 1 << 20  # a node report is a few KiB: more is not a Weave peer
_ENCODING_HEADERS = {"content-encoding", "content-length", "transfer-encoding"}


def _get(client: httpx.Client, base: str, path: str, token: str, deadline: float
         ) -> tuple[httpx.Response | None, str | None]:
    """The answer, or the reason there is none.  The body is read against ``deadline`` (monotonic),
    not only the per-read timeout: a peer trickling bytes cannot hold a check for longer."""
    try:
        with client.stream("GET", base + path, headers={"Authorization": f"Bearer {token}"}) as r:
            body = bytearray()
            for part in r.iter_bytes():
                body += part
                if len(body) > MAX_BODY:
                    return None, f"{path} answered more than {MAX_BODY >> 20} MiB"
                if time.monotonic() > deadline:
                    return None, "no whole answer in time (the peer sends too slowly)"
            # the body is decoded already: it keeps the headers that do not describe its encoding
            headers = [(k, v) for k, v in r.headers.multi_items() if k.lower() not in _ENCODING_HEADERS]
            return httpx.Response(r.status_code, headers=headers, content=bytes(body), request=r.request), None
    except httpx.TimeoutException:
        return None, f"no answer within {client.timeout.read:g} s"
    except httpx.ConnectError as e:
        return None, f"cannot connect: {str(e) or type(e).__name__}"
    except httpx.HTTPError as e:
        return None, f"{type(e).__name__}: {str(e) or 'transport error'}"


def _refused(r: httpx.Response, path: str) -> Probe | None:
    """The probe for an error status, or None for 200."""
    if r.status_code == 200:
        return None
    if r.status_code in (401, 403):
        return Probe(UNAUTHORIZED, error=f"the peer refused this node's token (HTTP {r.status_code}): the token "
                                          "configured for it here is not the one it expects")
    detail = _message(r)
    return Probe(DEAD, error=f"{path} answered HTTP {r.status_code}" + (f": {detail}" if detail else ""))


def probe(peer: PeerConfig, timeout_s: float, transport: httpx.BaseTransport | None = None) -> Probe:
    """Check ``peer`` now; returns within about two timeouts (two requests, their bodies read against
    that deadline)."""
    base = peer.url.rstrip("/")
    deadline = time.monotonic() + 2 * timeout_s
    timeout = httpx.Timeout(timeout_s)
    # a fresh client per check: no pooled connection to a peer that died between rounds
    with httpx.Client(timeout=timeout, transport=transport, follow_redirects=False, trust_env=False) as client:
        t0 = time.perf_counter()
        r, why = _get(client, base, HEALTH_PATH, peer.token, deadline)
        latency = (time.perf_counter() - t0) * 1000.0
        if r is None:
            return Probe(DEAD, error=why)
        if (bad := _refused(r, HEALTH_PATH)) is not None:
            return bad
        r, why = _get(client, base, INFO_PATH, peer.token, deadline)
        if r is None:
            return Probe(DEAD, latency, error=f"{INFO_PATH}: {why}")
        if (bad := _refused(r, INFO_PATH)) is not None:
            return bad
        try:
            report = r.json()
        except ValueError:
            report = None
        if not isinstance(report, dict) or not isinstance(report.get("model"), dict):
            return Probe(DEAD, latency, error=f"{INFO_PATH} did not answer with a Weave node report")
        return Probe(ALIVE, latency, report=report)
