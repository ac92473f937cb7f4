"""The alternative Q-Ring is measured against: broadcast every head group's queries to all nodes,
let each attend its own shard in parallel, and merge the N partials once at home.

It keeps everything of ``RingMember`` (sessions, shards, the round-robin layout, the commands) and
changes only the per-layer exchange:

    home                   member r (every r at once)
    q,k,v = dense(x)  ──── g: q|k|v ────▶ store own k,v; (out, lse) = attn(q, shard r)
    own = attn(q, shard 0)                      │
    att = own ⊕ p1 ⊕ ... ⊕ p(N-1)  ◀── g: out|lse ┘
    x = dense(x, att)

Two hops instead of N, and the members compute at the same time instead of one after another; the
price is that the home's link carries N-1 copies of every query message out and N-1 answers in (the
ring's home sends one packet and receives one tail).  Same arithmetic per shard as the ring, merged
in another order, so the logits agree with the ring's to float32 rounding.
"""

from __future__ import annotations

import numpy as np

from weaved.federation import protocol as P
from weaved.federation.comm import wait_all
from weaved.federation.qring import RingMember
from weaved.federation.ring_rows import Packet, StepRows, head_groups
from weaved.federation.ring_serve import HOME


class _Query:
    """One head group's broadcast message, one float32 buffer: q [T, Gq, D] | k [T, hg, D] | v [T, hg, D]."""

    def __init__(self, T: int, Gq: int, hg: int, D: int):
        nq, nk = T * Gq * D, T * hg * D
        self.buf = np.empty(nq + 2 * nk, np.float32)
        self.q = self.buf[:nq].reshape(T, Gq, D)
        self.k = self.buf[nq : nq + nk].reshape(T, hg, D)
        self.v = self.buf[nq + nk :].reshape(T, hg, D)


class BroadcastMember(RingMember):
    """A ``RingMember`` whose steps broadcast the queries and merge once at home."""

    def _home_attention(self, li: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, rows: StepRows,
                        att: np.ndarray) -> None:
        cfg, n, hg = self.config, self.n, self.heads_per_group
        G, D, T = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim, rows.n_rows
        groups = head_groups(cfg.n_kv_heads, hg)
        sends: list = []
        rets: list[list] = [[] for _ in groups]
        for g, (h0, h1) in enumerate(groups if n > 1 else ()):  # every head group to every member at once
            msg = _Query(T, hg * G, hg, D)
            msg.q[...], msg.k[...], msg.v[...] = q[:, h0 * G : h1 * G], k[:, h0:h1], v[:, h0:h1]
            tag = P.TAG_RING + li * len(groups) + g
            for r in range(1, n):
                sends.append(self.group.isend(msg.buf, r, tag))
                ret = Packet(T, hg * G, hg, D, with_qkv=False)
                rets[g].append((ret, self.group.irecv(ret.buf, r, tag)))
        rows.store(li, 0, cfg.n_kv_heads, k, v)
        for g, (out, lse) in enumerate(self._local_partials(li, q, groups, rows)):
            for ret, pending in rets[g]:  # the N partials merged once, here
                out, lse = self._merge_back(out, lse, ret, pending)
            h0, h1 = groups[g]
            att[:, h0 * G : h1 * G] = out
        wait_all(sends)

    def _serve_step(self, rows: StepRows, hg: int) -> None:
        cfg, g = self.config, self.group
        G, D, T = cfg.n_heads // cfg.n_kv_heads, cfg.head_dim, rows.n_rows
        groups = head_groups(cfg.n_kv_heads, hg)
        for li in range(cfg.n_layers):
            msgs = [_Query(T, hg * G, hg, D) for _ in groups]
            recvs = [g.irecv(m.buf, HOME, P.TAG_RING + li * len(groups) + j) for j, m in enumerate(msgs)]
            sends = []
            for j, ((h0, h1), m, rv) in enumerate(zip(groups, msgs, recvs, strict=True)):
                rv.wait()
                rows.store(li, h0, h1, m.k, m.v)
                ret = Packet(T, hg * G, hg, D, with_qkv=False)
                ret.out[...], ret.lse[...] = rows.batch.attend(m.q, li, h0, h1, self.scale)
                sends.append(g.isend(ret.buf, HOME, P.TAG_RING + li * len(groups) + j))
            wait_all(sends)
        rows.commit()
