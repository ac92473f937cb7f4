"""SLA scheduling order, token budget, chunked prefill and free preemption."""

from __future__ import annotations

import dataclasses

import numpy as np

from weaved.engine.sampling import SamplingParams
from weaved.engine.scheduler import SchedulerConfig, schedule
from weaved.engine.sequence import SeqStatus, Sequence, SLARank
from weaved.kv.cache import KVCache


def _seq(name, rank, pending=1, decoding=False, arrival=0.0, ttft=None, ttlt=None):
    kv = KVCache(np.zeros((1, 2, 1, 8, 4), np.float16))
    s = Sequence(name, kv, list(range(pending)), SamplingParams(max_tokens=10, temperature=0), rank,
                 ttft_s=ttft, ttlt_s=ttlt, arrival=arrival)
    if decoding:
        s.first_token_at = s.last_token_at = arrival
        s.status = SeqStatus.RUNNING
    return s


def test_interactive_first_then_deadline_then_batch():
    seqs = [
        _seq("batch", SLARank.BATCH, decoding=True),
        _seq("bg-late", SLARank.BACKGROUND, decoding=True, ttlt=100.0),
        _seq("bg-soon", SLARank.BACKGROUND, decoding=True, ttlt=1.0),
        _seq("inter", SLARank.INTERACTIVE, pending=5, arrival=5.0, ttft=0.5),
    ]
    work = schedule(seqs, SchedulerConfig(token_budget=100, max_batch=8, prefill_chunk=64), now=0.05)
    assert [w.seq.session_id for w in work] == ["inter", "bg-soon", "bg-late", "batch"]
    assert [w.n_tokens for w in work] == [5, 1, 1, 1]
    # later, bg-soon is behind the pace that ends it within its 1 s budget: it goes first
    work = schedule(seqs, SchedulerConfig(token_budget=100, max_batch=8, prefill_chunk=64), now=6.0)
    assert [w.seq.session_id for w in work] == ["bg-soon", "inter", "bg-late", "batch"]


def test_budget_chunks_prefill_and_pauses_the_rest():
    inter = _seq("inter", SLARank.INTERACTIVE, pending=300)
    bg = [_seq(f"bg{i}", SLARank.BACKGROUND, decoding=True) for i in range(3)]
    work = schedule([*bg, inter], SchedulerConfig(token_budget=130, max_batch=8, prefill_chunk=128), now=1.0)
    assert [(w.seq.session_id, w.n_tokens) for w in work] == [("inter", 128), ("bg0", 1), ("bg1", 1)]
    assert bg[2].status == SeqStatus.PAUSED and bg[2].preemptions == 1
    # next step: the paused one resumes (nothing was lost: its pending token is still there)
    inter.pending = inter.pending[128:]
    work = schedule([*bg, inter], SchedulerConfig(token_budget=300, max_batch=8, prefill_chunk=128), now=2.0)
    assert {w.seq.session_id for w in work} == {"inter", "bg0", "bg1", "bg2"}
    assert bg[2].status == SeqStatus.RUNNING


def test_max_batch_and_done_sequences():
    seqs = [_seq(f"s{i}", SLARank.BACKGROUND, decoding=True, arrival=float(i)) for i in range(5)]
    seqs[0].status = SeqStatus.FINISHED
    work = schedule(seqs, SchedulerConfig(token_budget=100, max_batch=2, prefill_chunk=8), now=10.0)
    assert [w.seq.session_id for w in work] == ["s1", "s2"]


def test_priority_change_takes_effect_next_step():
    a = _seq("a", SLARank.BACKGROUND, decoding=True, arrival=0.0)
    b = _seq("b", SLARank.BACKGROUND, decoding=True, arrival=1.0)
    cfg = SchedulerConfig(token_budget=1, max_batch=1, prefill_chunk=8)
    assert schedule([a, b], cfg, now=2.0)[0].seq is a
    b.rank = SLARank.INTERACTIVE
    assert schedule([a, b], cfg, now=2.0)[0].seq is b


def test_an_interactive_decode_shrinks_the_step_budget():
    """While an interactive turn decodes, other turns' prefill chunks shrink to the interactive budget
    (a step's time is that turn's inter-token gap); without one, prefills get the whole budget."""
    cfg = SchedulerConfig(token_budget=256, max_batch=8, prefill_chunk=256, interactive_budget=32)
    bg = _seq("bg", SLARank.BACKGROUND, pending=300, arrival=0.0)
    assert [w.n_tokens for w in schedule([bg], cfg, 0.0)] == [256]
    ia = _seq("ia", SLARank.INTERACTIVE, decoding=True, arrival=1.0)
    work = {w.seq.session_id: w.n_tokens for w in schedule([bg, ia], cfg, 2.0)}
    assert work == {"ia": 1, "bg": 31}
    fifo = dataclasses.replace(cfg, order="fifo")  # the baseline knows no classes: the whole budget
    assert {w.seq.session_id: w.n_tokens for w in schedule([bg, ia], fifo, 2.0)} == {"bg": 256}


def test_throughput_tolerant_turns_are_not_starved_by_a_full_batch_of_interactive_ones():
    """16 interactive decodes fill the batch every step; a background turn with a 100 s budget for its
    10 tokens is due every 10 s, and gets a slot each time it falls due - never more often."""
    cfg = SchedulerConfig(token_budget=64, max_batch=16, prefill_chunk=64)
    inter = [_seq(f"i{k:02d}", SLARank.INTERACTIVE, decoding=True) for k in range(16)]
    bg = _seq("bg", SLARank.BACKGROUND, decoding=True, ttlt=100.0)
    batch = _seq("batch", SLARank.BATCH, decoding=True)  # no budget: best effort, may wait
    picked_at = []
    for step in range(400):  # a step every 0.25 s for 100 s
        now = step * 0.25
        work = schedule([*inter, bg, batch], cfg, now)
        assert len(work) == 16
        if any(w.seq is bg for w in work):
            picked_at.append(now)
            bg.last_token_at = now
            bg.generated.append(0)
        if len(bg.generated) == 10:
            break
    assert len(bg.generated) == 10 and picked_at[-1] <= 100.0  # within its budget
    gaps = np.diff([0.0, *picked_at])
    assert all(g >= 8.0 for g in gaps)  # only when due: the interactive turns keep the rest
    assert batch.status == SeqStatus.PAUSED


def test_a_throughput_prefill_without_a_ttft_target_is_due_after_a_share_of_its_budget():
    from weaved.engine.sequence import PREFILL_SHARE

    bg = _seq("bg", SLARank.BACKGROUND, pending=40, ttlt=40.0)
    assert bg.deadline(0.0) == PREFILL_SHARE * 40.0
    inter = [_seq(f"i{k}", SLARank.INTERACTIVE, decoding=True) for k in range(4)]
    cfg = SchedulerConfig(token_budget=4, max_batch=8, prefill_chunk=64)
    assert [w.seq.session_id for w in schedule([*inter, bg], cfg, now=1.0)] == ["i0", "i1", "i2", "i3"]
    work = schedule([*inter, bg], cfg, now=PREFILL_SHARE * 40.0 + 0.1)
    # due: first, with what the interactive rows leave - at least a token, and never one of their rows
    assert work[0].seq is bg and work[0].n_tokens == 1
    assert [w.seq.session_id for w in work[1:]] == ["i0", "i1", "i2", "i3"]


def test_with_a_step_model_an_interactive_decode_keeps_the_step_within_its_target():
    """The step model sizes the prefill share while an interactive turn decodes: the decode rows' time
    first, the prompt tokens fill what is left of the target; no room left: decodes only."""
    from weaved.calibration.cost import Linear, StepCost
    from weaved.engine.step_budget import interactive_step_tokens

    cost = StepCost(prefill=Linear(0.01, 0.001, 0.0), decode=Linear(0.02, 0.002, 0.0))
    bg = _seq("bg", SLARank.BACKGROUND, pending=300, arrival=0.0)
    ia = _seq("ia", SLARank.INTERACTIVE, decoding=True, arrival=1.0)
    # 80 ms: the decode row takes 22 ms, 58 ms buys 58 prompt tokens at 1 ms each
    assert interactive_step_tokens(cost, 0.08, [0], 0) == 1 + 58
    cfg = SchedulerConfig(token_budget=256, max_batch=8, prefill_chunk=256, step_cost=cost, step_target_s=0.08)
    assert {w.seq.session_id: w.n_tokens for w in schedule([bg, ia], cfg, 2.0)} == {"ia": 1, "bg": 58}
    assert [w.n_tokens for w in schedule([bg], cfg, 0.0)] == [256]  # no interactive decode: the whole budget
    capped = dataclasses.replace(cfg, interactive_budget=16)  # the profile's cap still holds
    assert {w.seq.session_id: w.n_tokens for w in schedule([bg, ia], capped, 2.0)} == {"ia": 1, "bg": 15}
    tight = dataclasses.replace(cfg, step_target_s=0.02)  # the decode row alone fills it
    assert {w.seq.session_id: w.n_tokens for w in schedule([bg, ia], tight, 2.0)} == {"ia": 1}
    # attention: a prompt far into its context buys fewer tokens (per token-key cost)
    quad = StepCost(prefill=Linear(0.01, 0.001, 1e-6), decode=Linear(0.02, 0.002, 0.0))
    n = interactive_step_tokens(quad, 0.08, [0], 7) - 1
    assert 0.001 * n + 1e-6 * n * (7 + n / 2) <= 0.058 < 0.001 * (n + 1) + 1e-6 * (n + 1) * (7 + (n + 1) / 2)


def test_with_a_step_model_an_interactive_prompt_is_never_cut_and_others_wait_behind_it():
    """A step holding an interactive turn's prompt is that turn's time to first token: its own chunk
    always fits, other turns' prompts get what the target leaves."""
    from weaved.calibration.cost import Linear, StepCost

    cost = StepCost(prefill=Linear(0.0, 0.001, 0.0), decode=Linear(0.0, 0.002, 0.0))
    cfg = SchedulerConfig(token_budget=512, max_batch=8, prefill_chunk=256, step_cost=cost, step_target_s=0.08)
    bg = _seq("bg", SLARank.BACKGROUND, pending=300, arrival=0.0)
    short = _seq("ask", SLARank.INTERACTIVE, pending=20, arrival=1.0, ttft=0.5)
    assert {w.seq.session_id: w.n_tokens for w in schedule([bg, short], cfg, 2.0)} == {"ask": 20, "bg": 60}
    long = _seq("compact", SLARank.INTERACTIVE, pending=400, arrival=1.0, ttft=0.5)
    assert {w.seq.session_id: w.n_tokens for w in schedule([bg, long], cfg, 2.0)} == {"compact": 256}


def test_a_long_interactive_prompt_shares_the_target_with_the_other_interactive_turns():
    """An agent's long tool result (interactive, several chunks) far into its context beside a person's
    answer streaming: whole chunks would take seconds a step and hold every token of that answer as
    long, so the long prompt gets what the target leaves (at least a few tokens: it goes on); a short
    interactive prompt keeps its whole chunk (its first token); a long prompt alone keeps whole chunks."""
    from weaved.calibration.cost import Linear, StepCost
    from weaved.engine.scheduler import SHARED_CHUNK_MIN

    # 1 ms a token plus 0.25 us a token for each position before it: at 15,000 positions ~4.75 ms a token
    cost = StepCost(prefill=Linear(0.005, 0.001, 2.5e-7), decode=Linear(0.01, 0.001, 2.5e-7))
    cfg = SchedulerConfig(token_budget=512, max_batch=8, prefill_chunk=256, step_cost=cost, step_target_s=0.08)
    agent = _seq("agent", SLARank.INTERACTIVE, pending=6000, arrival=0.0, ttft=2.0)
    agent.kv.length = 15000
    person = _seq("person", SLARank.INTERACTIVE, decoding=True, arrival=1.0)
    got = {w.seq.session_id: w.n_tokens for w in schedule([agent, person], cfg, 2.0)}
    assert got["person"] == 1 and SHARED_CHUNK_MIN <= got["agent"] < 32  # ~80 ms, not ~1.2 s
    assert {w.seq.session_id: w.n_tokens for w in schedule([agent], cfg, 2.0)} == {"agent": 256}
    ask = _seq("ask", SLARank.INTERACTIVE, pending=40, arrival=1.5, ttft=0.5)
    got = {w.seq.session_id: w.n_tokens for w in schedule([agent, ask], cfg, 2.0)}
    assert got["ask"] == 40 and got["agent"] == SHARED_CHUNK_MIN
    # its last chunk shares too (a whole one would stall the person once at the end)
    agent.prefilled, agent.pending = 5900, agent.pending[:100]
    got = {w.seq.session_id: w.n_tokens for w in schedule([agent, person], cfg, 2.0)}
    assert got["person"] == 1 and SHARED_CHUNK_MIN <= got["agent"] < 32
    # two long prompts and nothing else: nobody waits on the step, each takes whole chunks
    other = _seq("other", SLARank.INTERACTIVE, pending=6000, arrival=0.5, ttft=2.0)
    got = {w.seq.session_id: w.n_tokens for w in schedule([agent, other], cfg, 2.0)}
    assert got == {"agent": 100, "other": 256}


def test_with_a_step_model_background_decodes_past_the_target_wait_for_a_later_step():
    """Forty background decodes beside an interactive one: the step keeps the rows that fit the target
    (the interactive one first), the rest are paused - but a background turn already due still runs."""
    from weaved.calibration.cost import Linear, StepCost

    cost = StepCost(prefill=Linear(0.0, 0.001, 0.0), decode=Linear(0.02, 0.002, 0.0))  # 20 ms + 2 ms a row
    cfg = SchedulerConfig(token_budget=512, max_batch=64, prefill_chunk=256, step_cost=cost, step_target_s=0.08)
    ia = _seq("ia", SLARank.INTERACTIVE, decoding=True, arrival=1.0)
    bgs = [_seq(f"bg{i:02d}", SLARank.BACKGROUND, decoding=True, arrival=0.0, ttlt=600.0) for i in range(40)]
    work = [w.seq.session_id for w in schedule([*bgs, ia], cfg, 2.0)]
    assert work[0] == "ia" and len(work) == 30  # (80 - 20) / 2 rows
    assert sum(s.status == SeqStatus.PAUSED for s in bgs) == 11
    late = _seq("late", SLARank.BACKGROUND, decoding=True, arrival=0.0, ttlt=10.0)  # due: behind its pace
    late.last_token_at = 0.0
    late.generated = [0] * 9
    work = [w.seq.session_id for w in schedule([*bgs, ia, late], cfg, 9.9)]
    assert work[0] == "late" and "ia" in work and len(work) == 30


def test_a_paced_decode_taking_each_token_when_due_ends_at_its_pace_not_at_its_budget():
    """Steps of 0.5 s; the turn runs only when due.  It ends within PACE of its budget plus a step's
    lateness per token at most - not near the end of the budget."""
    from weaved.engine.sequence import PACE

    s = _seq("b", SLARank.BATCH, decoding=True, ttlt=300.0)
    now = 0.0
    while len(s.generated) < s.params.max_tokens:
        now += 0.5
        if s.deadline(now) <= now:
            s.last_token_at = now
            s.generated.append(0)
    assert now <= PACE * 300.0 + 0.5
    assert now >= PACE * 300.0 - 0.5 * s.params.max_tokens  # paced, not run as fast as possible


def test_a_turn_without_a_length_limit_is_paced_for_a_typical_answer_not_for_the_context():
    """max_tokens set to the context's room (the API's default without a limit) with the router's
    typical answer expected: tokens are due as for that answer, and a longer answer is planned anew
    as it grows (twice what it has), never as the whole context."""
    from weaved.engine.sequence import PACE

    kv = KVCache(np.zeros((1, 2, 1, 8, 4), np.float16))
    s = Sequence("b", kv, [0], SamplingParams(max_tokens=30000, temperature=0), SLARank.BACKGROUND, ttlt_s=600.0,
                 arrival=0.0, expected_tokens=256)
    s.first_token_at = s.last_token_at = 0.0
    s.status = SeqStatus.RUNNING
    assert s.remaining_tokens == 256
    assert s.deadline(0.0) == PACE * 600.0 / 256  # not every 18 ms
    s.generated = [0] * 300
    assert s.remaining_tokens == 300
    s.generated = [0] * 20000
    assert s.remaining_tokens == 10000  # (bounded by max_tokens)


def test_a_due_background_prompt_takes_what_the_interactive_decodes_leave():
    """A throughput-tolerant prompt past its due time sorts first, but its chunk never takes the rows of
    the interactive turns decoding: they run in the same step."""
    inter = [_seq(f"i{k}", SLARank.INTERACTIVE, decoding=True) for k in range(3)]
    bg = _seq("bg", SLARank.BACKGROUND, pending=500, ttft=0.1)  # due since 0.1 s
    work = schedule([*inter, bg], SchedulerConfig(token_budget=100, max_batch=8, prefill_chunk=256), now=1.0)
    assert work[0].seq is bg and work[0].n_tokens == 97
    assert {w.seq.session_id for w in work[1:]} == {"i0", "i1", "i2"}
    assert all(s.status == SeqStatus.RUNNING for s in inter)


def test_due_prompts_one_after_another_never_take_the_interactive_rows():
    """Three throughput-tolerant prompts behind their pace go first: together they take what the
    interactive decodes leave, and every interactive decode still runs."""
    inter = [_seq(f"i{k}", SLARank.INTERACTIVE, decoding=True) for k in range(10)]
    due = [_seq(f"b{k}", SLARank.BACKGROUND, pending=600, ttlt=1.0) for k in range(3)]
    work = schedule([*inter, *due], SchedulerConfig(token_budget=528, max_batch=64, prefill_chunk=512), now=5.0)
    got = {w.seq.session_id: w.n_tokens for w in work}
    assert all(got.get(f"i{k}") == 1 for k in range(10))
    assert got["b0"] == 512 and sum(got.get(f"b{k}", 0) for k in range(3)) <= 528 - 10 + 2


def test_an_interactive_prompt_leaves_the_other_interactive_turns_their_rows():
    """A long interactive prompt under a small interactive budget: its chunk is what the decodes leave,
    so their streams go on while it is fed."""
    prompt = _seq("p", SLARank.INTERACTIVE, pending=2000, ttft=2.0)
    inter = [_seq(f"i{k}", SLARank.INTERACTIVE, decoding=True) for k in range(3)]
    cfg = SchedulerConfig(token_budget=512, max_batch=8, prefill_chunk=512, interactive_budget=64)
    work = schedule([prompt, *inter], cfg, now=0.0)
    assert {w.seq.session_id: w.n_tokens for w in work} == {"p": 61, "i0": 1, "i1": 1, "i2": 1}


def test_more_interactive_decodes_than_the_interactive_budget_all_run():
    """An interactive budget below the number of interactive decodes never leaves the newest of them
    waiting step after step: the budget is never below the rows themselves."""
    inter = [_seq(f"i{k}", SLARank.INTERACTIVE, decoding=True, arrival=float(k)) for k in range(10)]
    cfg = SchedulerConfig(token_budget=512, max_batch=16, prefill_chunk=64, interactive_budget=8)
    for _ in range(3):
        assert len(schedule(inter, cfg, now=20.0)) == 10


def test_a_due_prompt_leaves_an_interactive_prompt_its_chunk():
    """The step model sized the step for the interactive prompt's chunk: a due throughput-tolerant
    prompt sorted ahead of it takes only what is left, so the interactive turn's first token is not
    pushed back step after step."""
    from weaved.calibration.cost import Linear, StepCost

    cost = StepCost(prefill=Linear(0.01, 0.001, 0.0), decode=Linear(0.02, 0.002, 0.0))
    due = _seq("b", SLARank.BATCH, pending=5000, ttlt=1.0)
    first = _seq("a", SLARank.INTERACTIVE, pending=300, ttft=5.0)
    cfg = SchedulerConfig(token_budget=512, max_batch=8, prefill_chunk=256, step_cost=cost, step_target_s=0.05)
    got = {w.seq.session_id: w.n_tokens for w in schedule([due, first], cfg, now=10.0)}
    assert got["a"] == 256 and got["b"] >= 1
