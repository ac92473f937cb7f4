"""Q-Ring throughput projected to N nodes from measured rates (docs/ring-cost-model.md shows the
calculation and where it is uncertain).

Inputs: the model's shape; per head group, attention seconds per (row x key) and the merge's
seconds per row (``measure``); the home's dense step as a line in the batch size, fitted to two
measured batches; a link of ``gbps`` with a fixed per-message latency.  Per decode step of ``agents``
sessions at ``context`` tokens (each row one agent, every node a shard of ``context / N`` keys):

- one head group's work at a member: t_c = agents * keys * a + agents * m; at the home over its own
  shard: t_own = agents * keys * a
- its message: t_x = packet / link + latency (queries, new K/V, accumulator); the last hop t_t (tail)
- single home (the ring as ``RingMember`` runs it): per layer, the first head group goes round in
  (N-1)(t_x + t_c) + t_t and the others follow at the slower of compute and transfer, while the home
  attends its own shard:  layer = max(G t_own, (N-1)(t_x + t_c) + t_t + (G-1) max(t_c, t_x)), G head
  groups; step = dense(agents) + layers * layer
- broadcast instead, single home: the home sends every head group's queries to each of the N-1
  members (its link carries H (N-1) messages per layer), they attend in parallel and answer; the
  last member gets its first group after (N-1) t_q, then works through the G groups:
  layer = max(G (t_own + (N-1) agents m), (N-1) t_q + max(G t_c, (G-1)(N-1) t_q) + (N-1) t_t)
- every node a home (agents / N each, N rings interleaved): a node's compute is dense(agents / N)
  plus attention of every agent over its shard; its link carries ((N-1) packets + 1 tail) / N of
  the batch per head group and layer; with full overlap, step = max(compute, link)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from weaved.bench.ring.sizes import HeadGroup, transfer_s


@dataclass(frozen=True)
class Shape:
    n_layers: int
    n_kv_heads: int
    heads_per_group: int
    q_per_kv: int  # query heads per kv head
    head_dim: int
    kv_bytes_per_token: int

    @classmethod
    def of(cls, config, heads_per_group: int = 1) -> Shape:
        return cls(config.n_layers, config.n_kv_heads, heads_per_group, config.n_heads // config.n_kv_heads,
                   config.head_dim, config.kv_bytes_per_token)

    @property
    def groups(self) -> int:
        return self.n_kv_heads // self.heads_per_group

    def head_group(self, rows: int) -> HeadGroup:
        return HeadGroup(rows, self.heads_per_group * self.q_per_kv, self.heads_per_group, self.head_dim)


@dataclass(frozen=True)
class Rates:
    attend_s_per_row_key: float  # one head group
    merge_s_per_row: float  # one head group
    dense_fixed_s: float  # dense(b) = dense_fixed_s + dense_per_row_s * b
    dense_per_row_s: float
    gbps: float = 10.0
    latency_s: float = 30e-6  # per message: an assumption for 10 GbE through the kernel's TCP stack

    def dense_s(self, rows: float) -> float:
        return self.dense_fixed_s + self.dense_per_row_s * rows

    @staticmethod
    def dense_line(points: dict[int, float]) -> tuple[float, float]:
        """(fixed, per row) through the smallest and largest measured batch (per row only for one)."""
        (b1, t1), (b2, t2) = min(points.items()), max(points.items())
        if b1 == b2:
            return 0.0, t1 / b1
        per_row = max(0.0, (t2 - t1) / (b2 - b1))
        return max(0.0, t1 - per_row * b1), per_row


def _ring_layer(shape: Shape, t_own: float, t_c: float, t_x: float, t_t: float, n: int) -> float:
    g = shape.groups
    if n == 1:
        return g * t_own
    around = (n - 1) * (t_x + t_c) + t_t + (g - 1) * max(t_c, t_x)
    return max(g * t_own, around)


def _broadcast_layer(shape: Shape, t_own: float, t_c: float, t_q: float, t_t: float, merge: float, n: int) -> float:
    g = shape.groups
    if n == 1:
        return g * t_own
    home = g * (t_own + (n - 1) * merge)  # its own shard and the N-1 merges of every head group
    members = (n - 1) * t_q + max(g * t_c, (g - 1) * (n - 1) * t_q) + (n - 1) * t_t
    return max(home, members)


def project(shape: Shape, rates: Rates, agents: int, context: int, n: int) -> dict:
    """One row of the projection: N = ``n`` nodes."""
    keys = math.ceil(context / n)
    hg = shape.head_group(agents)
    t_own = agents * keys * rates.attend_s_per_row_key
    t_c = t_own + agents * rates.merge_s_per_row
    t_x = transfer_s(hg.packet_bytes, rates.gbps, rates.latency_s)
    t_t = transfer_s(hg.tail_bytes, rates.gbps, rates.latency_s)
    layer = _ring_layer(shape, t_own, t_c, t_x, t_t, n)
    layer_no_wire = _ring_layer(shape, t_own, t_c, 0.0, 0.0, n)
    dense = rates.dense_s(agents)
    step = dense + shape.n_layers * layer
    t_q = transfer_s(hg.query_bytes, rates.gbps, rates.latency_s)
    merge = agents * rates.merge_s_per_row
    bcast_step = dense + shape.n_layers * _broadcast_layer(shape, t_own, t_own, t_q, t_t, merge, n)
    # every node a home of agents / n sessions, its dense and its part of every ring overlapped
    sym_compute = rates.dense_s(agents / n) + shape.n_layers * shape.groups * (
        t_own + (agents * rates.merge_s_per_row if n > 1 else 0.0))
    sym_link_bytes = shape.n_layers * shape.groups * ((n - 1) * hg.packet_bytes + hg.tail_bytes) / n if n > 1 else 0
    sym_link = transfer_s(sym_link_bytes, rates.gbps)
    sym_step = max(sym_compute, sym_link)
    kv_total = agents * context * shape.kv_bytes_per_token
    return {
        "nodes": n, "shard_keys": keys, "kv_per_node_bytes": kv_total / n,
        "head_group": {"attend_s": t_own, "member_s": t_c, "packet_bytes": hg.packet_bytes, "transfer_s": t_x,
                       "margin": t_own / t_x},
        "single_home": {"dense_s": dense, "attention_layer_s": layer, "step_s": step,
                        "exposed_transfer_s": shape.n_layers * (layer - layer_no_wire),
                        "tokens_per_s": agents / step, "tokens_per_s_per_node": agents / step / n},
        "broadcast_single_home": {"step_s": bcast_step, "tokens_per_s": agents / bcast_step},
        "every_node_home": {"compute_s": sym_compute, "link_s": sym_link, "step_s": sym_step,
                            "bound": "link" if sym_link > sym_compute else "compute",
                            "tokens_per_s": agents / sym_step, "tokens_per_s_per_node": agents / sym_step / n},
    }


def projection(shape: Shape, rates: Rates, agents: int, context: int, nodes=range(1, 9)) -> list[dict]:
    return [project(shape, rates, agents, context, n) for n in nodes]
