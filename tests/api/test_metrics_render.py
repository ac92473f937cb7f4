"""The scrape's gauges and counters read from the daemon's status: peers, pools, the disk, unrecovered
sessions; a turn's SLA targets counted met or missed."""

from __future__ import annotations

from weaved.metrics import Metrics


def test_status_figures_reach_the_scrape():
    status = {"pools": [{"name": "cpu", "steps": 7, "tokens_prefilled": 40, "tokens_generated": 12, "preemptions": 1,
                         "tokens_per_s": 3.5, "step_model_scale": 1.2},
                        {"name": "ring", "steps": 2, "ring": {"formed": 3, "lost": 1}}],
              "kv": {"disk_free_bytes": 1234}, "unrecovered": [{"id": "s-1", "reason": "x"}],
              "peers": [{"name": "b", "alive": True}, {"name": "c", "alive": False}], "sessions": []}
    m = Metrics()
    text = m.render(status).decode()
    for line in ('weave_pool_steps_total{pool="cpu"} 7.0', 'weave_pool_tokens_total{kind="prefilled",pool="cpu"} 40.0',
                 'weave_pool_preemptions_total{pool="cpu"} 1.0', 'weave_pool_step_model_scale{pool="cpu"} 1.2',
                 'weave_ring_changes_total{change="lost",pool="ring"} 1.0', "weave_disk_free_bytes 1234.0",
                 "weave_unrecovered_sessions 1.0", 'weave_peer_up{peer="b"} 1.0', 'weave_peer_up{peer="c"} 0.0'):
        assert line in text, line
    # a peer removed since is gone from the next scrape (no stale series)
    status["peers"] = [{"name": "b", "alive": True}]
    assert 'peer="c"' not in m.render(status).decode()


def test_sla_targets_are_counted_met_or_missed_per_target():
    m = Metrics()
    m.observe_targets("interactive", 3.0, 0.4, {"ttft_target_s": 0.5, "ttlt_target_s": 2.0})
    m.observe_targets("batch", 30.0, 1.0, {"ttlt_target_s": 300.0})
    text = m.render({}).decode()
    assert 'weave_sla_targets_total{outcome="met",sla_class="interactive",target="ttft"} 1.0' in text
    assert 'weave_sla_targets_total{outcome="missed",sla_class="interactive",target="ttlt"} 1.0' in text
    assert 'weave_sla_targets_total{outcome="met",sla_class="batch",target="ttlt"} 1.0' in text
    assert 'sla_class="batch",target="ttft"' not in text and 'weave_turn_seconds_count{sla_class="batch"} 1.0' in text
