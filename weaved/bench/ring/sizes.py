"""What one head group's Q-Ring message weighs and what its attention costs, from the model's shape.

A head group is ``hg`` kv heads and their ``hg * G`` query heads (G query heads share a kv head).
Its ring packet (``weaved.federation.ring_rows.Packet``) is float32: q [T, Gq, D] | k [T, hg, D] |
v [T, hg, D] | out [T, Gq, D] | lse [T, Gq] for T rows; the last hop home carries only out | lse.
The broadcast alternative sends q | k | v to every member and gets out | lse back from each.
"""

from __future__ import annotations

from dataclasses import dataclass

F32 = 4
F16 = 2


@dataclass(frozen=True)
class HeadGroup:
    rows: int  # T: query rows (one per ring session in a decode step)
    q_heads: int  # Gq = hg * G
    kv_heads: int  # hg
    head_dim: int  # D

    @classmethod
    def of(cls, config, rows: int, heads_per_group: int = 1) -> HeadGroup:
        g = config.n_heads // config.n_kv_heads
        return cls(rows, heads_per_group * g, heads_per_group, config.head_dim)

    @property
    def query_bytes(self) -> int:
        """q | k | v: what the broadcast alternative sends each member."""
        return F32 * self.rows * (self.q_heads + 2 * self.kv_heads) * self.head_dim

    @property
    def tail_bytes(self) -> int:
        """out | lse: the accumulator alone (the last hop home; a member's answer in the broadcast)."""
        return F32 * self.rows * self.q_heads * (self.head_dim + 1)

    @property
    def packet_bytes(self) -> int:
        """The full ring packet between two members."""
        return self.query_bytes + self.tail_bytes

    def flops(self, keys: int) -> int:
        """Multiply-adds of scores and weighted values, 2 flops each, over ``keys`` keys per row."""
        return 4 * self.rows * self.q_heads * keys * self.head_dim

    def kv_bytes(self, keys: int) -> int:
        """float16 K and V each row reads (every row its own session's shard)."""
        return self.rows * keys * self.kv_heads * self.head_dim * 2 * F16


def transfer_s(nbytes: int, gbps: float, latency_s: float = 0.0) -> float:
    """Time on a link of ``gbps`` gigabits per second, plus a fixed latency."""
    return nbytes * 8 / (gbps * 1e9) + latency_s
