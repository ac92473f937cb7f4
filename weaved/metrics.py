"""Prometheus metrics of one daemon: requests, tokens, latency per SLA class, pool queues, KV tiers.

Counters and histograms are updated by the API as requests and tokens pass through it, so latencies
are what a client sees (time to first token from the request's arrival, gaps between streamed
tokens).  Gauges (pool depths, KV bytes) are read from the daemon's status when ``/metrics`` is
scraped, so they are never stale.  Each ``Metrics`` owns its registry: several daemons (or tests)
in one process do not share counters.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["Metrics", "CONTENT_TYPE"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds.  TTFT spans interactive turns on a GPU (tens of ms) to background prefills on a busy CPU.
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
INTER_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
# A whole turn: an interactive answer in seconds, a batch one within its budget of minutes.
TURN_BUCKETS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
KV_TIERS = ("file", "ram", "device")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("weave_requests", "HTTP requests by route and status code",
                                ["route", "status"], registry=r)
        self.tokens = Counter("weave_tokens", "Tokens by kind (prompt, cached, completion, reprefilled: "
                              "held context the chat template rewrote, dropped; its new rendering "
                              "is computed as prompt) and SLA class",
                              ["kind", "sla_class"], registry=r)
        self.turns = Counter("weave_turns", "Finished turns by SLA class and finish reason",
                             ["sla_class", "finish_reason"], registry=r)
        self.ttft = Histogram("weave_time_to_first_token_seconds",
                              "From a turn's request to its first token, by SLA class",
                              ["sla_class"], buckets=TTFT_BUCKETS, registry=r)
        self.inter_token = Histogram("weave_inter_token_seconds", "Gaps between a turn's tokens, by SLA class",
                                     ["sla_class"], buckets=INTER_TOKEN_BUCKETS, registry=r)
        self.queue_depth = Gauge("weave_pool_queue_depth", "Turns waiting or preempted, per pool",
                                 ["pool"], registry=r)
        self.batch_depth = Gauge("weave_pool_batch_depth", "Turns decoding, per pool", ["pool"], registry=r)
        self.kv_bytes = Gauge("weave_kv_bytes", "KV cache bytes per tier (file on disk, resident in RAM, "
                              "on a device)", ["tier"], registry=r)
        self.kv_cap = Gauge("weave_kv_cap_bytes", "The cap on total KV bytes", registry=r)
        self.kv_reserved = Gauge("weave_kv_reserved_bytes", "KV bytes reserved by sessions", registry=r)
        self.sessions = Gauge("weave_sessions", "Sessions held by the daemon", registry=r)
        self.turn_seconds = Histogram("weave_turn_seconds", "From a turn's request to its last token, by SLA class "
                                      "(turns that ended by themselves: stop, length, tool calls)",
                                      ["sla_class"], buckets=TURN_BUCKETS, registry=r)
        self.sla = Counter("weave_sla_targets", "Turns with an SLA target, by class, target (ttft: first token; "
                           "ttlt: whole turn) and outcome (met, missed), as the client saw the times",
                           ["sla_class", "target", "outcome"], registry=r)
        self.disk_free = Gauge("weave_disk_free_bytes", "Free bytes on the data directory's file system (KV files "
                               "grow into it)", registry=r)
        self.unrecovered = Gauge("weave_unrecovered_sessions", "Sessions in the data directory this daemon did not "
                                 "recover (another model's KV file, a damaged record)", registry=r)
        self.peer_up = Gauge("weave_peer_up", "1 when a federated peer answers its health checks, else 0",
                             ["peer"], registry=r)
        ProcessCollector(registry=r)  # process_resident_memory_bytes, process_open_fds, CPU seconds, ...
        self._daemon_counters = _DaemonCounters()  # the daemon's own running totals, read at scrape time
        r.register(self._daemon_counters)

    def observe_request(self, route: str, status: int) -> None:
        self.requests.labels(route, str(status)).inc()

    def observe_turn(self, sla_class: str, finish_reason: str, prompt_tokens: int, cached_tokens: int,
                     completion_tokens: int, reprefilled_tokens: int = 0) -> None:
        self.turns.labels(sla_class, finish_reason).inc()
        if reprefilled_tokens:
            self.tokens.labels("reprefilled", sla_class).inc(reprefilled_tokens)
        self.tokens.labels("prompt", sla_class).inc(max(0, prompt_tokens))
        self.tokens.labels("cached", sla_class).inc(max(0, cached_tokens))
        self.tokens.labels("completion", sla_class).inc(max(0, completion_tokens))

    def observe_targets(self, sla_class: str, seconds: float, ttft_s: float | None, targets: dict) -> None:
        """A turn that ended by itself: its duration, and each SLA target it had (``targets``: the engine's
        ``ttft_target_s`` / ``ttlt_target_s``) met or missed, from the times the client saw."""
        self.turn_seconds.labels(sla_class).observe(seconds)
        for target, took in (("ttft", ttft_s), ("ttlt", seconds)):
            limit = targets.get(f"{target}_target_s")
            if limit is not None and took is not None:
                self.sla.labels(sla_class, target, "met" if took <= limit else "missed").inc()

    def render(self, status: dict) -> bytes:
        """The exposition text, with gauges refreshed from ``status`` (the daemon's ``status()``)."""
        self.queue_depth.clear()
        self.batch_depth.clear()
        for pool in status.get("pools", []):
            self.queue_depth.labels(pool["name"]).set(pool.get("queue_depth", 0))
            self.batch_depth.labels(pool["name"]).set(pool.get("batch_depth", 0))
        kv = status.get("kv", {})
        for tier in KV_TIERS:
            self.kv_bytes.labels(tier).set(kv.get(f"{tier}_bytes", 0) or 0)
        self.kv_cap.set(kv.get("cap_bytes") or 0)
        self.kv_reserved.set(kv.get("reserved_bytes") or 0)
        self.sessions.set(sum(1 for s in status.get("sessions", []) if not s.get("ephemeral")))
        self.disk_free.set(kv.get("disk_free_bytes") or 0)
        self.unrecovered.set(len(status.get("unrecovered") or ()))
        self.peer_up.clear()
        for peer in status.get("peers") or ():
            self.peer_up.labels(peer["name"]).set(1 if peer.get("alive") else 0)
        self._daemon_counters.status = status
        return generate_latest(self.registry)


class _DaemonCounters(Collector):
    """Totals the daemon keeps itself (``/v1/status``), exposed with their true types at each scrape:
    counters for what only grows since start (moves, prefix lookups, compilations), gauges for what is
    held now (prefix files)."""

    def __init__(self) -> None:
        self.status: dict = {}

    def collect(self):
        mig = self.status.get("migrations") or {}
        moves = CounterMetricFamily("weave_migrations", "Session moves that changed backend since start, by reason",
                                    labels=["reason"])
        for reason, n in sorted((mig.get("by_reason") or {}).items()):
            moves.add_metric([reason], n)
        yield moves
        yield CounterMetricFamily("weave_migration_bytes", "KV bytes copied between memories by session moves",
                                  value=mig.get("bytes", 0))
        yield CounterMetricFamily("weave_migration_seconds", "Time spent copying KV for session moves",
                                  value=mig.get("seconds", 0.0))
        pre = (self.status.get("kv") or {}).get("prefixes") or {}
        lookups = CounterMetricFamily("weave_prefix_lookups", "New sessions' prompts looked up in the shared "
                                      "prefixes, by result", labels=["result"])
        lookups.add_metric(["hit"], pre.get("hits") or 0)
        lookups.add_metric(["miss"], pre.get("misses") or 0)
        yield lookups
        yield CounterMetricFamily("weave_prefix_reused_tokens", "Prompt tokens taken from shared prefixes instead "
                                  "of prefilled", value=pre.get("reused_tokens") or 0)
        yield CounterMetricFamily("weave_prefixes_published", "Shared prefixes stored: files written or grown",
                                  value=pre.get("published") or 0)
        yield CounterMetricFamily("weave_prefixes_extended", "Shared prefixes stored by growing a file in place "
                                  "(a longer conversation, a deeper fork)", value=pre.get("extended") or 0)
        yield CounterMetricFamily("weave_prefixes_branched", "Shared prefixes stored as a branch: a file of its "
                                  "own blocks past another file's (diverging conversations)",
                                  value=pre.get("branched") or 0)
        for what, doc in (("files", "Shared prefix files held"), ("bytes", "Bytes of shared prefix files held"),
                          ("branches", "Shared prefix files that branch from another file"),
                          ("in_use", "Shared prefix files mapped by a session now")):
            yield GaugeMetricFamily(f"weave_prefix_{what}", doc, value=pre.get(what) or 0)
        pools = self.status.get("pools") or []
        steps = CounterMetricFamily("weave_pool_steps", "Engine steps run, per pool", labels=["pool"])
        tokens = CounterMetricFamily("weave_pool_tokens", "Tokens an engine computed, per pool and kind "
                                     "(prefilled: prompt tokens fed; generated: sampled)", labels=["pool", "kind"])
        preempt = CounterMetricFamily("weave_pool_preemptions", "Turns preempted for more urgent ones, per pool",
                                      labels=["pool"])
        rate = GaugeMetricFamily("weave_pool_tokens_per_second", "A pool's recent rate of computed tokens",
                                 labels=["pool"])
        scale = GaugeMetricFamily("weave_pool_step_model_scale", "Measured step times over the step model's "
                                  "predictions (1: as calibrated), per pool", labels=["pool"])
        ring = CounterMetricFamily("weave_ring_changes", "A Q-Ring pool's ring formations and peers lost",
                                   labels=["pool", "change"])
        for p in pools:
            name = p["name"]
            steps.add_metric([name], p.get("steps", 0))
            tokens.add_metric([name, "prefilled"], p.get("tokens_prefilled", 0))
            tokens.add_metric([name, "generated"], p.get("tokens_generated", 0))
            preempt.add_metric([name], p.get("preemptions", 0))
            rate.add_metric([name], p.get("tokens_per_s", 0.0))
            if "step_model_scale" in p:
                scale.add_metric([name], p["step_model_scale"])
            if p.get("ring"):
                ring.add_metric([name, "formed"], p["ring"].get("formed", 0))
                ring.add_metric([name, "lost"], p["ring"].get("lost", 0))
        yield from (steps, tokens, preempt, rate, scale, ring)
        kernels = self.status.get("kernels") or {}
        comp = CounterMetricFamily("weave_kernel_compilations", "Kernels compiled by this process: at load (none "
                                   "when they came from the cache) and while serving (a request waited)",
                                   labels=["phase"])
        comp.add_metric(["load"], kernels.get("compiled_at_load", 0))
        comp.add_metric(["serving"], kernels.get("compiled_while_serving", 0))
        yield comp
