"""The communication side, measured between processes over loopback with the federation's own data
plane (``PeerGroup``: gloo, tagged point-to-point messages): the link's rate and a message's
one-way time, and decode steps of a Q-Ring and of its broadcast alternative.

Loopback has no wire: its "rate" is memory copies through the kernel's TCP stack and gloo's
threads, on the same cores that compute.  It is measured so that the margins have a second,
same-machine reference beside the 10 Gbps figure, not as a model of a network.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from weaved.federation.comm import PeerGroup

TAG_PING, TAG_PONG, TAG_BULK, TAG_ACK = 11, 12, 13, 14


def pingpong_s(group: PeerGroup, nbytes: int, reps: int) -> float | None:
    """Median one-way time (half the round trip) of an ``nbytes`` message between ranks 0 and 1;
    rank 0 returns it, rank 1 echoes and returns None."""
    buf = np.zeros(max(1, nbytes), np.uint8)
    times = []
    for i in range(reps + 5):  # 5 unrecorded round trips: connections warm, buffers faulted in
        if group.rank == 0:
            t0 = time.perf_counter()
            back = group.irecv(buf, 1, TAG_PONG)
            group.send(buf, 1, TAG_PING)
            back.wait()
            if i >= 5:
                times.append((time.perf_counter() - t0) / 2)
        else:
            group.recv(buf, 0, TAG_PING)
            group.send(buf, 0, TAG_PONG)
    return statistics.median(times) if group.rank == 0 else None


def bulk_rate(group: PeerGroup, nbytes: int, reps: int = 3) -> float | None:
    """Bytes per second of one large message from rank 0 to rank 1 (timed until rank 1 acknowledges
    the whole message); the best of ``reps``; rank 1 returns None."""
    buf = np.zeros(nbytes, np.uint8)
    ack = np.zeros(1, np.uint8)
    best = None
    for _ in range(reps + 1):
        if group.rank == 0:
            t0 = time.perf_counter()
            got = group.irecv(ack, 1, TAG_ACK)
            group.send(buf, 1, TAG_BULK)
            got.wait()
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        else:
            group.recv(buf, 0, TAG_BULK)
            group.send(ack, 0, TAG_ACK)
    return nbytes / best if group.rank == 0 else None


def synthetic_kv(config, length: int, capacity: int, seed: int = 0):
    """A full session cache of ``length`` positions with random values (attention's cost does not
    depend on them): the history a ring session is opened with."""
    from weaved.kv.cache import KVCache

    rng = np.random.default_rng(seed)
    shape = (config.n_layers, 2, config.n_kv_heads, capacity, config.head_dim)
    data = (rng.standard_normal(shape, np.float32) * 0.5).astype(np.float16)
    return KVCache(data, length)


def decode_compare(members: dict, sessions: int, context: int, steps: int) -> dict:
    """On the home of several rings over the same ranks (a Q-Ring, its broadcast alternative, a
    single node): open ``sessions`` sessions with ``context`` positions of history on each, run one
    warm-up step on each, then ``steps`` timed decode steps taking turns (one token per session, all
    batched), so that every protocol meets the same machine conditions; stop them all."""
    from weaved.federation.qring import RingChunk

    capacity = context + steps + 2
    kv = synthetic_kv(next(iter(members.values())).config, context, capacity)
    for m in members.values():
        for sid in range(sessions):  # every session opens from the same history: only its cost matters
            m.open_session(sid, capacity, kv=kv)
    del kv
    chunks = [RingChunk(sid, np.array([sid + 1], np.int32)) for sid in range(sessions)]
    times: dict[str, list[float]] = {name: [] for name in members}
    waited = {}
    for m in members.values():
        m.step(chunks)
    for name, m in members.items():
        waited[name] = m.stats.wait_seconds
    for _ in range(steps):
        for name, m in members.items():
            t0 = time.perf_counter()
            m.step(chunks)
            times[name].append(time.perf_counter() - t0)
    out = {}
    for name, m in members.items():
        out[name] = {"step_s": statistics.median(times[name]), "steps_s": times[name],
                     "home_wait_s": (m.stats.wait_seconds - waited[name]) / steps,
                     "sessions": sessions, "context": context, "nodes": m.n}
        m.stop()
    return out
