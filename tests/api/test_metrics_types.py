"""``/metrics`` exposes what only grows as counters (``_total``, so ``rate()`` works) and what is held
now as gauges, including the totals the daemon keeps itself and reports in its status."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from weaved.metrics import Metrics

STATUS = {"migrations": {"by_reason": {"promotion": 2}, "bytes": 4096, "seconds": 0.5},
          "kv": {"prefixes": {"hits": 3, "misses": 1, "reused_tokens": 384, "published": 2, "extended": 1, "files": 2,
                              "bytes": 8192, "in_use": 1}},
          "kernels": {"compiled_at_load": 5, "compiled_while_serving": 0}}


def test_running_totals_are_counters_and_holdings_are_gauges():
    families = {f.name: f for f in text_string_to_metric_families(Metrics().render(STATUS).decode())}
    for name in ("weave_migrations", "weave_migration_bytes", "weave_migration_seconds", "weave_prefix_lookups",
                 "weave_prefix_reused_tokens", "weave_prefixes_published", "weave_prefixes_extended",
                 "weave_kernel_compilations",
                 "weave_requests", "weave_tokens", "weave_turns"):
        assert families[name].type == "counter", name
    for name in ("weave_prefix_files", "weave_prefix_bytes", "weave_prefix_in_use", "weave_sessions"):
        assert families[name].type == "gauge", name

    def value(name: str, **labels: str) -> float:
        return next(s.value for s in families[name].samples
                    if s.name == name + ("_total" if families[name].type == "counter" else "")
                    and all(s.labels.get(k) == v for k, v in labels.items()))

    assert value("weave_migrations", reason="promotion") == 2 and value("weave_migration_bytes") == 4096
    assert value("weave_prefix_lookups", result="hit") == 3 and value("weave_prefix_lookups", result="miss") == 1
    assert value("weave_prefix_files") == 2 and value("weave_kernel_compilations", phase="load") == 5
    assert value("weave_prefixes_published") == 2 and value("weave_prefixes_extended") == 1
