"""Commands a group's driver (rank 0: the ring's home, the pipeline's first stage) sends its members,
and the message tags.

A command is a fixed int64 header ``[kind, a0 .. a5, body_len]`` optionally followed by an int64 body
(session ids, positions, lengths).  Everything else a member receives has a size it computes from
the last command, so no other message carries metadata.  Tags keep the streams of one pair apart;
within one (peer, tag) gloo delivers in order, which is what lets each step reuse its tags.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

from weaved.federation.comm import PeerGroup, Pending

HEADER_LEN = 8

TAG_CMD = 1  # command headers
TAG_BODY = 2  # command bodies
TAG_ACK = 3  # a member's answer to a command that needs one
TAG_LOAD = 4  # a session's shard rows sent by the home (OPEN with rows)
TAG_LOGITS = 5  # the last pipeline stage's logits to rank 0
TAG_KV = 6  # a pipeline stage's KV hand-off
TAG_RING = 1 << 16  # + layer * n_groups + group: a Q-Ring packet
TAG_ACT = 1 << 24  # + micro-batch: a pipeline activation


class Cmd(IntEnum):
    STOP = 1  # leave the serve loop
    PING = 2  # liveness; acked
    OPEN = 3  # sid, capacity, length, rows (Rows), n_layers, n_kv_heads; acked
    CLOSE = 4  # sid
    TRUNCATE = 5  # sid, length
    STEP = 6  # n_seqs, n_rows, kv heads per group; body: sids, pos0, n_tokens
    PREFILL = 7  # n_seqs, n_stages, micro-batch tokens, hand-off (Handoff), hand-off rank; body: see pipeline


class Rows(IntEnum):
    """Where an opened ring session's history comes from."""

    NONE = 0  # a new session, empty
    SENT = 1  # the home sends each member its shard rows (TAG_LOAD)
    HELD = 2  # the members already hold their shards (adopted from a pipeline prefill's hand-off)


class ProtocolError(RuntimeError):
    """A member received a command it cannot follow (a bug or a mismatched peer); it leaves the group."""


def send_cmd(group: PeerGroup, dst: int, kind: Cmd, *args: int, body: np.ndarray | None = None) -> list[Pending]:
    """Post a command to ``dst``; wait on the returned sends before changing ``body``."""
    if len(args) > HEADER_LEN - 2:
        raise ValueError("too many command arguments")
    body = np.zeros(0, np.int64) if body is None else np.ascontiguousarray(body, np.int64)
    hdr = np.zeros(HEADER_LEN, np.int64)
    hdr[0] = int(kind)
    hdr[1 : 1 + len(args)] = args
    hdr[-1] = body.size
    return [group.isend(hdr, dst, TAG_CMD), group.isend(body, dst, TAG_BODY)]


def broadcast_cmd(group: PeerGroup, kind: Cmd, *args: int, body: np.ndarray | None = None) -> list[Pending]:
    """The same command to every other rank."""
    out: list[Pending] = []
    for r in range(group.world_size):
        if r != group.rank:
            out += send_cmd(group, r, kind, *args, body=body)
    return out


def recv_cmd(group: PeerGroup, src: int, timeout_s: float) -> tuple[Cmd, np.ndarray, np.ndarray]:
    """The next command from ``src``: (kind, args int64 [6], body int64 [n])."""
    hdr = group.recv(np.empty(HEADER_LEN, np.int64), src, TAG_CMD, timeout_s)
    body = group.recv(np.empty(int(hdr[-1]), np.int64), src, TAG_BODY)
    try:
        kind = Cmd(int(hdr[0]))
    except ValueError:
        raise ProtocolError(f"unknown command {int(hdr[0])} from rank {src}") from None
    return kind, hdr[1:-1], body


def send_ack(group: PeerGroup, dst: int, status: int = 0) -> None:
    group.send(np.array([status], np.int64), dst, TAG_ACK)


def recv_acks(group: PeerGroup, what: str) -> None:
    """An ack from every other rank; a non-zero status raises ``ProtocolError``."""
    bufs = {r: np.empty(1, np.int64) for r in range(group.world_size) if r != group.rank}
    pend = [group.irecv(b, r, TAG_ACK) for r, b in bufs.items()]
    for p in pend:
        p.wait()
    bad = {r: int(b[0]) for r, b in bufs.items() if b[0] != 0}
    if bad:
        raise ProtocolError(f"{what} refused by ranks {sorted(bad)} (status {bad})")
