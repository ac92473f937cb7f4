"""Pipeline-parallel prefill: the model's layers split over the ranks of one group, the prompts cut
into micro-batches that flow through the stages, each stage keeping the KV of its own layers.

Rank 0 is the first stage (it has the tokens and embeds them) and drives: it sends every stage the
plan (``Cmd.PREFILL``: sessions, prompt lengths, layer ranges, micro-batch size, hand-off), then
all stages run the same loop::

    stage s, micro-batch j:  x_j = embed(tokens_j)  (s = 0)  |  receive x_j from s-1
                             layers [a_s, b_s) over x_j, causal attention over this stage's KV
                             send x_j to s+1  |  logits of rows that end a prompt  (last stage)

Stage s works on micro-batch j while s+1 works on j-1: every receive is posted up front and every
send is asynchronous, so a stage never waits for its successor.  Hidden states travel as float32 and
every kernel is batch-invariant, so the pipeline's KV and logits are the single node's bit for bit,
whatever the split or the micro-batch size.  Afterwards the KV goes to the decode strategy's layout
(``handoff``); once ``prefill`` returns, every rank holds its part (each stage acks rank 0).

Layer split: proportional to each stage's measured speed (largest remainder, at least one layer
each).  The output matrix (on the last stage) runs on one row per prompt, so it is left out of the
balance.

Waits on computation: a stage's receive of micro-batch j waits for the stages before it to compute
j, and rank 0's receive of the logits for the stages after it to drain - both grow with the
micro-batches (about a quarter of the prompt per stage), so they get the group's timeout plus an
allowance for that work (``compute_allowance_s``): rank 0 estimates one stage's seconds per token from
its own measured prefill rate (the split makes the stages about equally fast) and sends it with the
plan.  A peer process that dies is still seen at once (gloo reports the closed connection); only a
silent one is waited on for the allowance.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from weaved.backends.cpu import CPUBackend
from weaved.federation import protocol as P
from weaved.federation.comm import PeerGroup, PeerLost, wait_all
from weaved.federation.handoff import Handoff, hand_off
from weaved.federation.layers import LayerRunner
from weaved.federation.node_report import measured_prefill_rate
from weaved.federation.shards import KVFactory, memory_kv_factory
from weaved.kernels import attention as ka
from weaved.kv.cache import KVCache

OnKV = Callable[[int, KVCache, int], None]  # (session id, cache that landed here, session length)
UNMEASURED_RATE = 5.0  # tokens/s of the whole model assumed until this node has measured its own
WAIT_MARGIN = 4.0  # a wait's allowance: this many times the estimate of the computation before it


def stage_seconds_per_token(backend: CPUBackend, n_stage_layers: int) -> float:
    """One stage's estimated seconds per token: this node's measured prefill rate (or a slow
    ``UNMEASURED_RATE``) for ``n_stage_layers`` of the model's layers."""
    rate = measured_prefill_rate(backend.stats) or UNMEASURED_RATE
    return n_stage_layers / (backend.config.n_layers * rate)


def compute_allowance_s(stages: int, tokens: int, s_per_token: float) -> float:
    """How long a wait may take beyond the group's timeout for ``stages`` stages to compute ``tokens``
    tokens each, at ``s_per_token`` per stage and token (with ``WAIT_MARGIN``)."""
    return WAIT_MARGIN * stages * tokens * s_per_token


def split_layers(n_layers: int, speeds: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous layer ranges, one per stage, sized in proportion to ``speeds`` (layers per second,
    or any relative measure); every stage gets at least one layer."""
    n = len(speeds)
    if not 1 <= n <= n_layers or any(s <= 0 for s in speeds):
        raise ValueError(f"need 1..{n_layers} stages with positive speeds, got {list(speeds)}")
    quota = [n_layers * s / sum(speeds) for s in speeds]
    counts = [max(1, math.floor(q)) for q in quota]
    while sum(counts) > n_layers:  # only possible through the minimum of one: take from the most over quota
        i = max((i for i in range(n) if counts[i] > 1), key=lambda i: counts[i] - quota[i])
        counts[i] -= 1
    while sum(counts) < n_layers:  # largest remainder first
        i = max(range(n), key=lambda i: quota[i] - counts[i])
        counts[i] += 1
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
    return [(int(bounds[i]), int(bounds[i + 1])) for i in range(n)]


def plan_microbatches(lens: Sequence[int], mb_tokens: int) -> list[list[tuple[int, int, int]]]:
    """The prompts (lengths ``lens``), back to back, cut into micro-batches of at most ``mb_tokens``
    tokens: each a list of (sequence, start, end) pieces in order."""
    if mb_tokens < 1:
        raise ValueError("mb_tokens must be >= 1")
    plan: list[list[tuple[int, int, int]]] = [[]]
    room = mb_tokens
    for s, m in enumerate(lens):
        start = 0
        while start < m:
            if room == 0:
                plan.append([])
                room = mb_tokens
            end = min(m, start + room)
            plan[-1].append((s, start, end))
            room -= end - start
            start = end
    return [mb for mb in plan if mb]


def default_mb_tokens(total: int, n_stages: int) -> int:
    """About 4 micro-batches per stage (a pipeline bubble of ~(N-1)/(5N-1)), but none under 32 tokens,
    where the dense products stop being efficient."""
    return max(32, math.ceil(total / (4 * n_stages)))


@dataclass
class PrefillResult:
    logits: list[np.ndarray]  # float32 [1, vocab] per prompt (rank 0)
    kv: dict[int, KVCache] = field(default_factory=dict)  # session id -> this rank's cache after the hand-off
    seconds: float = 0.0


class PipelineMember:
    """This daemon's stage in one pipeline group: ``prefill`` on rank 0, ``serve`` on the others."""

    def __init__(self, group: PeerGroup, backend: CPUBackend, kv_factory: KVFactory | None = None,
                 on_kv: OnKV | None = None, lock: threading.Lock | None = None):
        self.group, self.backend, self.config = group, backend, backend.config
        self.kv_factory = kv_factory or memory_kv_factory(backend.config)  # the hand-off's caches
        self.on_kv = on_kv  # e.g. a ring member's ShardTable.adopt for SCATTER
        # one operation at a time on the group: a ring sharing the group passes its own lock
        self._lock = lock or threading.Lock()

    def prefill(self, sids: Sequence[int], prompts: Sequence[np.ndarray], *, ranges: list[tuple[int, int]],
                capacities: Sequence[int] | None = None, mb_tokens: int | None = None,
                handoff: Handoff = Handoff.GATHER, dst: int = 0) -> PrefillResult:
        """Prefill ``prompts`` (sessions ``sids``, from position 0) through the pipeline; returns the
        last-token logits of each prompt and the caches that landed on rank 0."""
        if self.group.rank != 0:
            raise RuntimeError("rank 0 drives the pipeline")
        n, cfg = self.group.world_size, self.config
        lens = [len(p) for p in prompts]
        caps = list(capacities) if capacities is not None else lens
        if len(ranges) != n or ranges[0][0] != 0 or ranges[-1][1] != cfg.n_layers or any(
            a >= b or b != ranges[i + 1][0] for i, (a, b) in enumerate(ranges[:-1])
        ):
            raise ValueError(f"ranges {ranges} do not cover the {cfg.n_layers} layers in {n} contiguous stages")
        if len(sids) != len(prompts) or len(caps) != len(prompts) or not prompts:
            raise ValueError("one session id and capacity per prompt, at least one prompt")
        if min(lens) < 1 or any(c < m for c, m in zip(caps, lens, strict=True)):
            raise ValueError("every prompt needs a token and a capacity at least its length")
        ids = [np.asarray(p, np.int32) for p in prompts]
        if any(p.min() < 0 or p.max() >= cfg.vocab_size for p in ids):
            raise ValueError(f"token id out of range [0, {cfg.vocab_size})")
        mb = mb_tokens or default_mb_tokens(sum(lens), n)
        body = np.concatenate([np.asarray(sids, np.int64), lens, caps, np.asarray(ranges, np.int64).reshape(-1)])
        us_per_token = math.ceil(1e6 * stage_seconds_per_token(self.backend, ranges[0][1] - ranges[0][0]))
        with self._lock:
            try:
                t0 = time.perf_counter()
                pend = P.broadcast_cmd(self.group, P.Cmd.PREFILL, len(ids), n, mb, int(handoff), dst, us_per_token,
                                       body=body)
                res = self._run(list(sids), lens, caps, ranges, mb, Handoff(handoff), dst, ids, us_per_token / 1e6)
                wait_all(pend)
                P.recv_acks(self.group, "prefill")
                res.seconds = time.perf_counter() - t0
                return res
            except BaseException:  # the stages are mid-protocol: the group cannot be trusted again
                self.group.close()
                raise

    def stop(self) -> None:
        with self._lock:
            try:
                wait_all(P.broadcast_cmd(self.group, P.Cmd.STOP))
            except PeerLost:
                pass
            self.group.close()

    def serve(self) -> None:
        """A stage's loop: run each PREFILL rank 0 sends until STOP; ``PeerLost`` / ``ProtocolError``
        close the group and propagate."""
        try:
            while True:
                cmd, args, body = P.recv_cmd(self.group, 0, self.group.spec.idle_timeout_s)
                if cmd == P.Cmd.STOP:
                    return
                if cmd == P.Cmd.PING:
                    P.send_ack(self.group, 0)
                    continue
                if cmd != P.Cmd.PREFILL:
                    raise P.ProtocolError(f"unexpected command {cmd.name} on a pipeline")
                self.serve_prefill(args, body)
        finally:
            self.group.close()

    def serve_prefill(self, args: np.ndarray, body: np.ndarray) -> None:
        """A stage's part of one PREFILL command (its header ``args`` and ``body``), then its ack."""
        S, n, mb, mode, dst, us_per_token = (int(a) for a in args[:6])
        if n != self.group.world_size:
            raise P.ProtocolError(f"a plan for {n} stages in a group of {self.group.world_size}")
        sids, lens, caps = (body[i * S : (i + 1) * S].tolist() for i in range(3))
        ranges = [tuple(r) for r in body[3 * S :].reshape(n, 2).tolist()]
        self._run(sids, lens, caps, ranges, mb, Handoff(mode), dst, None, us_per_token / 1e6)
        P.send_ack(self.group, 0)

    def _run(self, sids, lens, caps, ranges, mb, mode: Handoff, dst: int, ids, s_per_token: float) -> PrefillResult:
        g, cfg = self.group, self.config
        n, s = g.world_size, g.rank
        a, b = ranges[s]
        runner = LayerRunner(self.backend, a, b)
        stage_kv = [runner.new_kv(c if mode == Handoff.KEEP else m) for m, c in zip(lens, caps, strict=True)]
        plan = plan_microbatches(lens, mb)
        recvs = []
        if s > 0:  # every activation this stage will receive, posted now
            for j, pieces in enumerate(plan):
                buf = np.empty((sum(e - st for _, st, e in pieces), cfg.d_model), np.float32)
                recvs.append((buf, g.irecv(buf, s - 1, P.TAG_ACT + j)))
        sends, ends = [], {}  # ends: sequence -> its last hidden row (last stage)
        for j, pieces in enumerate(plan):
            if s == 0:
                x = runner.embed(np.concatenate([ids[q][st:e] for q, st, e in pieces]))  # [T_j, d_model]
            else:
                x, pending = recvs[j]  # once the stages before this one have computed it
                pending.wait(g.spec.timeout_s + compute_allowance_s(s, len(x), s_per_token))
            seq_starts = np.concatenate([[0], np.cumsum([e - st for _, st, e in pieces])]).astype(np.int64)
            pos0 = np.array([st for _, st, _ in pieces], np.int64)
            runner.run(x, ka.kv_list([stage_kv[q].data for q, _, _ in pieces]), seq_starts, pos0)
            for i, (q, _, e) in enumerate(pieces):
                stage_kv[q].length = e
                if s == n - 1 and e == lens[q]:
                    ends[q] = x[seq_starts[i + 1] - 1]
            if s < n - 1:
                sends.append(g.isend(x, s + 1, P.TAG_ACT + j))
        logits = np.empty((len(lens), cfg.vocab_size), np.float32)
        if s == n - 1:
            logits = runner.logits(np.stack([ends[q] for q in range(len(lens))]))
            if s != 0:
                sends.append(g.isend(logits, 0, P.TAG_LOGITS))
        elif s == 0:  # once the stages after this one have drained (they may lag by every micro-batch)
            g.recv(logits, n - 1, P.TAG_LOGITS, g.spec.timeout_s + compute_allowance_s(n - 1, sum(lens), s_per_token))
        wait_all(sends)
        kvs = hand_off(g, cfg, mode, dst, ranges, stage_kv, sids, lens, caps, self.kv_factory)
        res = PrefillResult(logits=[logits[i : i + 1] for i in range(len(lens))] if s == 0 else [])
        for sid, kv, m in zip(sids, kvs, lens, strict=False):
            if self.on_kv is not None:
                self.on_kv(int(sid), kv, int(m))
            res.kv[int(sid)] = kv
        return res
