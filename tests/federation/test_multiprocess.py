"""Q-Ring decode and pipeline prefill across processes on loopback, against the single node, and
peers lost in the middle of a ring step.  Each member is a process (``_worker``); see ``harness``."""

from __future__ import annotations

import numpy as np
import pytest

from tests.federation.harness import describe, greedy_agree, kl, margin, run_members
from weaved.federation.shards import join_shards

pytestmark = pytest.mark.federation

PROMPTS = [[1, 504, 3458, 282, 4649, 314, 253, 1345, 28], [1, 19556, 905, 30, 1073], [1, 1812, 2116, 3458, 17, 23, 4563,
                                                                                     7, 1241, 982, 7543, 21, 339]]
KL_MAX = 0.0005  # mean KL to the single node from the same inputs (token and KV) (docs/architecture.md, "Correctness")
# Free running (each side appends its own K/V), one flipped rounding in a Q8_0 activation block
# propagates through later positions: on SmolLM2 even exact float64 attention drifts to a mean KL of
# ~1e-3 from the CPU backend over 24 steps (measured), the ring alike.  Bounded by the bar the tests set
# for the CPU backend against llama.cpp; greedy continuations carry the real check.
KL_FREE = 0.005
TIE = 0.3  # greedy continuations may part only where the single node's top two are this close


def _check_decode(a: dict, n_seq: int, report: dict) -> None:
    """Free running: ring logits vs the single node fed the same tokens, and the ring's greedy
    continuation vs the single node's own (where the scenario recorded one)."""
    kls = []
    for s in range(n_seq):
        kls.append(kl(a[f"dec_ref_logits_{s}"], a[f"dec_ring_logits_{s}"]))
        if f"single_tokens_{s}" in a:
            toks = a[f"dec_ring_tokens_{s}"]
            single, single_logits = a[f"single_tokens_{s}"], a[f"single_logits_{s}"]
            assert greedy_agree(single[: len(toks)], single_logits, toks, TIE), (s, toks, single)
            report.setdefault("greedy_equal", []).append(bool(np.array_equal(single[: len(toks)], toks)))
    kls = np.concatenate(kls)
    report.update(free_mean_kl=float(kls.mean()), free_max_kl=float(kls.max()), free_rows=len(kls))
    assert kls.mean() < KL_FREE, report


def _check_same_inputs(a: dict, n_seq: int, report: dict) -> None:
    """Every step from the single node's token and KV: the ring's logits within the KL bar.  Then a
    multi-token turn (from the same KV; its later rows see the chunk's own K/V, each side its own,
    so it is held to the free-running bound)."""
    kls = np.concatenate([kl(a[f"same_ref_logits_{s}"], a[f"same_ring_logits_{s}"]) for s in range(n_seq)])
    turn = np.concatenate([kl(a[f"turn_ref_{s}"], a[f"turn_ring_{s}"]) for s in range(n_seq)])
    report.update(same_mean_kl=float(kls.mean()), same_max_kl=float(kls.max()), same_rows=len(kls),
                  turn_mean_kl=float(turn.mean()), turn_max_kl=float(turn.max()))
    assert kls.mean() < KL_MAX and turn.mean() < KL_FREE, report


def _ok(members, ranks=None) -> None:
    for m in members:
        if ranks is None or m.rank in ranks:
            assert m.result is not None and m.result["status"] == "ok", describe(members)


@pytest.mark.parametrize("model,world,heads_per_group", [("tiny_llama", 3, 1), ("tiny_qwen3", 2, 2)])
def test_qring_decode_matches_single_node(request, tmp_path, model, world, heads_per_group):
    path = request.getfixturevalue(model)
    members = run_members(tmp_path, "ring", world, model=str(path), prompts=PROMPTS, steps=8, capacity=64,
                          turn=[5, 6, 7, 8, 9], heads_per_group=heads_per_group, timeout_s=10.0)
    _ok(members)
    a = members[0].arrays(tmp_path)
    report: dict = {}
    _check_decode(a, len(PROMPTS), report)
    _check_same_inputs(a, len(PROMPTS), report)  # includes a multi-token turn: causal across shards
    for s in range(len(PROMPTS)):
        full = a[f"full_kv_{s}"]  # the shards, joined, are the single node's KV (same dense arithmetic)
        shards = [members[r].arrays(tmp_path)[f"shard_{s}"] for r in range(world)]
        assert max(x.shape[3] for x in shards) - min(x.shape[3] for x in shards) <= 1  # balanced
        joined = np.zeros_like(full)
        join_shards(shards, full.shape[3], joined)
        assert np.array_equal(joined, full)
    print(f"qring {model} x{world}: {report}")


def test_pipeline_prefill_then_qring_decode(tmp_path, tiny_llama_deep):
    """Layers split 1:2:1 over three stages, micro-batches of 4 tokens: gathered KV and logits are the
    single node's bit for bit; scattered onto a ring, decode stays within the KL bound."""
    members = run_members(tmp_path, "pipeline", 3, model=str(tiny_llama_deep), prompts=PROMPTS, steps=6,
                          capacity=64, speeds=[1.0, 2.0, 1.0], mb_tokens=4, timeout_s=10.0)
    _ok(members)
    r0 = members[0].result
    assert r0["ranges"] == [[0, 1], [1, 4], [4, 5]]
    assert r0["logits_equal_dst0"] and r0["kv_equal_dst0"] and r0["logits_equal_dst2"] and r0["scatter_logits_equal"]
    a0, a2 = members[0].arrays(tmp_path), members[2].arrays(tmp_path)
    for s in range(len(PROMPTS)):  # gathered on the last rank
        assert np.array_equal(a2[f"gathered_{s}"], a0[f"ref_kv_{s}"])
    report: dict = {}
    _check_decode(a0, len(PROMPTS), report)
    print(f"pipeline+qring: {report}")


@pytest.mark.parametrize("victim,how", [(2, "exit"), (1, "hang"), (0, "exit")])
def test_lost_peer_mid_step_raises_on_every_survivor(tmp_path, tiny_llama, victim, how):
    """A member that dies or goes silent, or a home that dies, in the middle of a ring step: every
    survivor raises PeerLost by itself (the harness only has to kill the victim) and none hangs."""
    survivors = [r for r in range(3) if r != victim]
    members = run_members(tmp_path, "fail", 3, wait_for=survivors, deadline_s=120.0, model=str(tiny_llama),
                          prompts=PROMPTS[:2], steps=10, capacity=64, victim=victim, at_step=3, how=how,
                          timeout_s=2.0, idle_timeout_s=30.0)
    for r in survivors:
        m = members[r]
        assert m.returncode == 0 and m.result is not None, describe(members)
        assert m.result["status"] == "peerlost", describe(members)
    if victim != 0:
        assert members[0].result["steps_done"] == 3  # lost in the step the victim failed in


@pytest.mark.slow
def test_smollm2_ring_and_pipeline(tmp_path, smollm2_q4_0):
    """The real model: a 2-node ring (rows sent from a single-node prefill), then a 2-stage pipeline
    prefill scattered onto a ring; KL and greedy continuations against the single node."""
    prompts = PROMPTS + [[1, 9690, 314, 260, 3575, 282, 4649, 30, 378]]
    ring = run_members(tmp_path / "ring", "ring", 2, model=str(smollm2_q4_0), prompts=prompts, steps=12,
                       same_steps=24, capacity=128, turn=[28, 339, 253, 1345], timeout_s=30.0)
    _ok(ring)
    a = ring[0].arrays(tmp_path / "ring")
    report: dict = {}
    _check_decode(a, len(prompts), report)
    _check_same_inputs(a, len(prompts), report)
    report["min_margin"] = min(margin(a[f"single_logits_{s}"][t]) for s in range(len(prompts)) for t in range(12))
    print(f"qring smollm2 x2: {report}")
    pipe = run_members(tmp_path / "pipe", "pipeline", 2, model=str(smollm2_q4_0), prompts=prompts, steps=8,
                       capacity=128, speeds=[2.0, 1.0], mb_tokens=8, timeout_s=30.0)
    _ok(pipe)
    r0 = pipe[0].result
    assert r0["logits_equal_dst0"] and r0["kv_equal_dst0"] and r0["logits_equal_dst1"] and r0["scatter_logits_equal"]
    report = {}
    _check_decode(pipe[0].arrays(tmp_path / "pipe"), len(prompts), report)
    print(f"pipeline+qring smollm2: {report}")
