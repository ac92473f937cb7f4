"""The benchmark's baseline policies: pool isolation and one FIFO pool."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from tests.routing.test_tree import BA, BG, HOST, IA, TH, cpu, req, state
from weaved.config.load import load_profile
from weaved.config.profile import RoutingThresholds
from weaved.config.tables import ProfileError
from weaved.engine.sampling import SamplingParams
from weaved.engine.scheduler import SchedulerConfig, schedule
from weaved.engine.sequence import Sequence, SLARank
from weaved.kv.cache import KVCache
from weaved.routing.tree import place, promote
from weaved.routing.types import PRIORITY

ISO = dataclasses.replace(TH, policy="isolation")
FIFO = dataclasses.replace(TH, policy="fifo")


def test_isolation_binds_by_class():
    s = state(*HOST)
    assert place(req(IA), s, ISO).decode_pool in ("gpu", "gpu-spec")
    for cls in (BG, BA):
        p = place(req(cls, prompt=5000), s, ISO)  # a long prompt is not prefilled elsewhere either
        assert p.decode_pool == p.prefill_pool == "cpu"
        assert p.priority == PRIORITY[cls]


def test_isolation_without_a_gpu_puts_interactive_on_the_cpu_at_its_own_priority():
    p = place(req(IA), state(cpu()), ISO)
    assert p.decode_pool == "cpu" and p.priority == PRIORITY[IA]


def test_isolation_never_moves_a_session_nor_changes_its_priority():
    s = state(*HOST)
    bg = place(req(BG), s, ISO)
    up = promote(bg, req(IA), s, ISO)
    assert (up.decode_pool, up.prefill_pool, up.priority) == (bg.decode_pool, bg.prefill_pool, bg.priority)
    assert "isolation" in " ".join(up.reasons)


def test_fifo_puts_everyone_in_the_first_standard_pool_at_one_priority():
    s = state(*HOST)
    ps = [place(req(c, prompt=n), s, FIFO) for c, n in ((IA, 10), (BG, 5000), (BA, 100))]
    assert {p.decode_pool for p in ps} == {HOST[0].name}
    assert len({p.priority for p in ps}) == 1
    assert promote(ps[1], req(IA), s, FIFO).decode_pool == HOST[0].name


def test_unknown_policy_is_refused(tmp_path):
    with pytest.raises(ValueError, match="policy"):
        RoutingThresholds(cpu_prefill_tokens_per_s=1.0, cpu_decode_tokens_per_s=1.0, policy="random")
    text = Path(load_profile("cpu-only").source).read_text()
    text = text.replace("ttft_margin = 0.8", 'policy = "random"\nttft_margin = 0.8')
    (tmp_path / "p.toml").write_text(text)
    with pytest.raises(ProfileError, match="routing.policy"):
        load_profile(tmp_path / "p.toml")


def _seq(name, rank, arrival):
    s = Sequence(name, KVCache(np.zeros((1, 2, 1, 8, 4), np.float16)), [1], SamplingParams(), rank)
    s.arrival = arrival
    return s


def test_fifo_scheduler_orders_by_arrival_only():
    seqs = [_seq("batch-early", SLARank.BATCH, 1.0), _seq("inter-late", SLARank.INTERACTIVE, 2.0)]
    one = dict(token_budget=1, max_batch=1, prefill_chunk=1)
    assert [w.seq.session_id for w in schedule(seqs, SchedulerConfig(**one, order="fifo"), 3.0)] == ["batch-early"]
    assert [w.seq.session_id for w in schedule(seqs, SchedulerConfig(**one), 3.0)] == ["inter-late"]
