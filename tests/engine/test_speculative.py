"""Speculative decoding (prompt lookup): the drafter, and exactness against plain decoding in the engine."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.engine_run import Run, same, shared_backend, turn
from weaved.engine.sampling import SamplingParams
from weaved.engine.scheduler import SchedulerConfig, Work
from weaved.engine.sequence import Sequence, SLARank
from weaved.engine.speculative import Drafter, NgramIndex, SpecConfig, verify
from weaved.kv.cache import KVCache

# --- the drafter --------------------------------------------------------------------------------------


def _ref_draft(toks: list[int], sizes, k: int) -> list[int]:
    """Brute force: scan back for the most recent earlier occurrence of the last n tokens."""
    total = len(toks)
    for n in sorted(sizes, reverse=True):
        if total <= n:
            continue
        suffix = toks[total - n :]
        for j in range(total - 1, n - 1, -1):  # j: the position right after an occurrence
            if toks[j - n : j] == suffix:
                out: list[int] = []
                for i in range(k):
                    out.append(toks[j + i] if j + i < total else out[j + i - total])
                return out
    return []


def test_draft_is_what_followed_the_most_recent_occurrence():
    idx = NgramIndex((3, 2, 1))
    idx.extend([5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 6, 7])
    assert idx.draft(3) == [9, 2, 6]  # "6 7" last occurred before "9 2 …" (not before "8")
    idx.extend([8])  # suffix "6 7 8" occurred once before, followed by "1 5"
    assert idx.draft(2) == [1, 5]
    toks = [1, 2, 3, 9, 5, 2, 3, 8, 1, 2, 3]
    longest, shorter = NgramIndex((3, 2)), NgramIndex((2,))
    longest.extend(toks)
    shorter.extend(toks)
    assert longest.draft(2) == [9, 5]  # the longest suffix with an earlier occurrence decides ...
    assert shorter.draft(2) == [8, 1]  # ... over a more recent occurrence of a shorter one
    assert NgramIndex((2,)).draft(4) == []
    fresh = NgramIndex((2, 1))
    fresh.extend([1, 2, 3])
    assert fresh.draft(4) == []  # its suffix is never its own earlier occurrence


def test_short_period_repetition_continues_periodically():
    idx = NgramIndex((2, 1))
    idx.extend([9, 4, 4, 4])
    assert idx.draft(5) == [4, 4, 4, 4, 4]
    idx = NgramIndex((3,))
    idx.extend([1, 2, 3, 1, 2, 3, 1, 2])
    assert idx.draft(7) == [3, 1, 2, 3, 1, 2, 3]


def test_incremental_and_bulk_indexing_match_a_brute_force_scan():
    rng = random.Random(3)
    for trial in range(30):
        sizes = tuple(rng.sample(range(1, 6), rng.randint(1, 3)))
        toks = [rng.randrange(6 if trial % 2 else 40) for _ in range(rng.randint(1, 400))]
        idx = NgramIndex(tuple(sorted(sizes, reverse=True)))
        pos = 0
        while pos < len(toks):
            step = rng.choice([1, 1, 2, 5, 70, 150])  # > 64 tokens go through the numpy bulk path
            idx.extend(toks[pos : pos + step])
            pos += step
            k = rng.randint(1, 12)
            assert idx.draft(k) == _ref_draft(toks[:pos], sizes, k), (trial, pos)


def test_long_history_is_indexed_without_a_scan_per_step():
    """Tens of thousands of tokens: one bulk pass, then each step costs a few dict operations."""
    rng = np.random.default_rng(0)
    toks = rng.integers(0, 49152, 50_000).tolist()
    toks[20_000:20_010] = list(range(100, 110))
    idx = NgramIndex((3, 2))
    idx.extend(toks)
    idx.extend([100, 101, 102])
    assert idx.draft(4) == [103, 104, 105, 106]
    assert all(len(d) <= len(toks) for d in idx._last.values())


def _decoding_seq(history, pending, max_tokens=100, capacity=1000, generated=0) -> Sequence:
    kv = KVCache(np.zeros((1, 2, 1, capacity, 1), np.float16), length=len(history))
    s = Sequence("s", kv, list(pending), SamplingParams(max_tokens=max_tokens, temperature=0), SLARank.INTERACTIVE,
                 history=list(history))
    s.first_token_at = 0.0  # decoding
    s.generated = [0] * generated
    return s


def test_drafter_caps_and_threshold():
    cfg = SpecConfig(draft_tokens=6, ngram_sizes=(2,), max_concurrency=2)
    rep = [1, 2, 3, 4] * 5
    a = _decoding_seq(rep[:-1], rep[-1:])
    assert Drafter(cfg).propose([Work(a, 1)], [a], 512)[a] == [1, 2, 3, 4, 1, 2]
    # max_tokens: 3 more tokens at most, the first from the pending token's row
    b = _decoding_seq(rep[:-1], rep[-1:], max_tokens=10, generated=7)
    assert Drafter(cfg).propose([Work(b, 1)], [b], 512)[b] == [1, 2]
    # KV capacity: the pending token goes to position 19; plain decoding stops once length + 1 reaches 23
    c = _decoding_seq(rep[:-1], rep[-1:], capacity=23)
    assert Drafter(cfg).propose([Work(c, 1)], [c], 512)[c] == [1, 2]
    # the token budget left by the step is shared in the step's order
    d, e = _decoding_seq(rep[:-1], rep[-1:]), _decoding_seq(rep[:-1], rep[-1:])
    three = SpecConfig(draft_tokens=6, ngram_sizes=(2,), max_concurrency=3)
    assert [len(v) for v in Drafter(three).propose([Work(d, 1), Work(e, 1)], [d, e], 2 + 8).values()] == [6, 2]
    # two sequences decode: not below the threshold of 2, no drafts
    assert Drafter(cfg).propose([Work(d, 1)], [d, e], 512) == {}
    # a prefilling sequence is not drafted for
    p = _decoding_seq(rep[:-1], rep[-1:])
    p.first_token_at = None
    assert Drafter(cfg).propose([Work(p, 1)], [p], 512) == {}


def test_drafter_follows_the_sequence_and_reindexes_replaced_tokens():
    dr = Drafter(SpecConfig(draft_tokens=3, ngram_sizes=(2,)))
    s = _decoding_seq([7, 8, 9, 7], [8])
    assert dr.propose([Work(s, 1)], [s], 64)[s] == [9, 7, 8]
    s.history.append(s.pending.pop())  # what a step does: fed token into the history, sampled one pending
    s.pending.append(9)
    assert dr.propose([Work(s, 1)], [s], 64)[s] == [7, 8, 9]
    s.history[:] = [1, 2, 3, 1, 2, 3, 1]  # replaced, not extended (same length): indexed again
    s.pending[:] = [2]
    assert dr.propose([Work(s, 1)], [s], 64)[s] == [3, 1, 2]


def test_spec_config_validation():
    assert SpecConfig(ngram_sizes=(1, 3, 2, 3)).ngram_sizes == (3, 2, 1)
    for bad in ({"draft_tokens": 0}, {"ngram_sizes": ()}, {"ngram_sizes": (2, 0)}, {"max_concurrency": 0}):
        with pytest.raises(ValueError):
            SpecConfig(**bad)


def test_verify_stops_at_the_token_that_finishes_the_turn():
    """A draft accepted up to a token that ends the turn: nothing after it is fed or committed."""
    s = _decoding_seq([1, 2, 3], [4], capacity=16)
    s.kv.length = 3 + 1 + 4  # the forward wrote [pending] + 4 draft rows
    sampled = iter([5, 6, 7, 8, 9])
    fed_at: list[tuple[list[int], int]] = []

    def advance(rows):  # the engine's plain path, reduced to what verify relies on
        fed_at.append((s.pending[:], s.kv.length))
        s.history.extend(s.pending)
        s.pending = [next(sampled)]
        if s.pending == [7]:
            s.status = s.status.FINISHED
        return 1

    assert verify(s, [5, 6, 7, 8], np.zeros((5, 3), np.float32), advance) == (3, 2)
    assert fed_at == [([4], 4), ([5], 5), ([6], 6)] and s.kv.length == 6 and s.pending == [7]


# --- exactness in the engine --------------------------------------------------------------------------

BACKENDS = ["cpu", "torch"]
MODELS = ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_qwen3moe", "smollm2_q4_0"]


# every backend on every architecture, and SmolLM2 itself on the CPU backend (on the torch backend, whose
# exactness the tiny models show, it took three minutes of the suite)
@pytest.fixture(params=[(k, m) for k in BACKENDS for m in MODELS if (k, m) != ("torch", "smollm2_q4_0")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def backend(request):
    return shared_backend(request, *request.param)


REPEATED_LIST = [1, 300, 301, 302, 303, 304, 305, 306] * 4  # a list the model has seen four times
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"


def test_greedy_speculation_gives_exactly_the_plain_tokens(backend):
    be = backend
    turns = [
        turn("list", REPEATED_LIST, max_tokens=40),
        turn("plain", [1, 1000, 2000, 3000, 4000, 5000, 6000, 7000, 8000], max_tokens=40),
        turn("one", [7] * 10, max_tokens=40),
    ]
    spec = SpecConfig(draft_tokens=6, ngram_sizes=(3, 2, 1))
    for t in turns:  # one at a time: each decodes alone, below any threshold
        plain, fast = Run(be, [t], None), Run(be, [t], spec)
        same(plain, fast)
        assert plain.counters.drafted == 0
        if t["id"] == "list":
            assert fast.counters.accepted > 0, "no draft was accepted: the test would pass vacuously"
            assert fast.counters.steps < plain.counters.steps


def test_seeded_sampling_with_penalties_and_logprobs_is_reproduced(smol, tokenizer):
    """Accept-while-equal draws one random number per emitted token, in order, as plain decoding does."""
    prompt = tokenizer.encode("Repeat this code exactly:\n" + CODE + "\nHere it is again:\n")
    t = turn("s", prompt, max_tokens=48, temperature=0.7, top_k=40, top_p=0.95, min_p=0.05,
              repetition_penalty=1.05, seed=1234, logprobs=2)
    plain, fast = Run(smol, [t], None, tokenizer=tokenizer), Run(smol, [t], SpecConfig(), tokenizer=tokenizer)
    same(plain, fast)
    assert fast.counters.accepted > 0
    assert all("logprob" in ev for ev in fast.events["s"] if ev["type"] == "token" and ev["token"] is not None)


def _cut_mid_draft(run: Run, seq: Sequence) -> bool:
    """Did the turn end on a token its last step's draft predicted, with more draft fed after it?"""
    fed, before = next((toks, n) for step in reversed(run.backend.chunks) for k, toks, n in step if k == id(seq.kv))
    emitted, draft = seq.generated[before:], fed[1:]
    return emitted == draft[: len(emitted)] and len(emitted) < len(draft)


def test_stop_strings_and_stop_tokens_cut_inside_a_draft(smol, tokenizer):
    prompt = tokenizer.encode("Repeat this code exactly:\n" + CODE + "\nHere it is again:\n")
    ref = Run(smol, [turn("r", prompt, max_tokens=40)], None, tokenizer=tokenizer)
    text = "".join(ev["text"] for ev in ref.events["r"] if ev["type"] == "token")
    assert "return a - b" in text  # the model repeats the code; drafts should cover it
    cut = 0
    for params in ({"stop": ["a - b"]}, {"stop": ["sub("]}, {"stop": ["b)"]},
                   {"stop_token_ids": [ref["r"].generated[12]]}):
        t = turn("s", prompt, max_tokens=40, **params)
        plain = Run(smol, [t], None, tokenizer=tokenizer)
        fast = Run(smol, [t], SpecConfig(), tokenizer=tokenizer)
        same(plain, fast)
        assert plain["s"].finish_reason == "stop" and len(plain["s"].generated) < 40
        cut += _cut_mid_draft(fast, fast["s"])
    assert cut > 0, "no stop fell inside an accepted draft: the test did not test that"


def test_max_tokens_and_kv_capacity_end_a_turn_exactly(smol, tokenizer):
    prompt = tokenizer.encode("Repeat this code exactly:\n" + CODE + "\nHere it is again:\n")
    for max_tokens in (1, 2, 7, 13, 30):
        t = turn("s", prompt, max_tokens=max_tokens)
        plain, fast = Run(smol, [t], None, tokenizer=tokenizer), Run(smol, [t], SpecConfig(), tokenizer=tokenizer)
        same(plain, fast)
        assert len(fast["s"].generated) == max_tokens and fast["s"].finish_reason == "length"
    t = {**turn("s", prompt, max_tokens=100), "capacity": len(prompt) + 21}
    plain, fast = Run(smol, [t], None, tokenizer=tokenizer), Run(smol, [t], SpecConfig(), tokenizer=tokenizer)
    same(plain, fast)
    assert fast["s"].finish_reason == "length" and fast.counters.accepted > 0


def test_several_sequences_in_the_pool_each_match_their_solo_plain_run(backend):
    """Three turns share the pool (one still prefilling while others verify drafts); each gets the tokens
    it gets alone in plain decoding.  A fourth turn reaches the threshold: drafting stops, still exact."""
    be = backend
    turns = [
        turn("a", REPEATED_LIST, max_tokens=30),
        turn("b", [1, 2000, 2001, 2002, 2000, 2001, 2002, 2000], max_tokens=25),
        turn("c", list(range(400, 460)) + list(range(400, 430)), max_tokens=20),  # long: prefills in chunks
    ]
    sched = SchedulerConfig(token_budget=64, prefill_chunk=16)
    solo = {t["id"]: Run(be, [t], None, sched) for t in turns}
    fast = Run(be, turns, SpecConfig(draft_tokens=5, ngram_sizes=(3, 2, 1), max_concurrency=4), sched)
    for t in turns:
        same(solo[t["id"]], _only(fast, t["id"]))
    assert fast.counters.accepted > 0
    mixed = [step for step in fast.backend.chunks if len(step) > 1 and any(len(toks) > 1 for _, toks, _ in step)]
    assert mixed  # steps verified drafts beside other sequences' work
    busy = Run(be, turns + [turn("d", [1, 9, 8, 7, 6], max_tokens=25)],
               SpecConfig(ngram_sizes=(3, 2, 1), max_concurrency=3), sched)
    for t in turns:
        same(solo[t["id"]], _only(busy, t["id"]))
    # two turns decode side by side for their whole length: never below a threshold of 2, never a draft
    pair = [turn("a", REPEATED_LIST, max_tokens=20), turn("b", REPEATED_LIST[:16], max_tokens=20)]
    both = Run(be, pair, SpecConfig(ngram_sizes=(3, 2, 1), max_concurrency=2), sched)
    assert both.counters.drafted == 0 and all(len(s.generated) == 20 for s in both.seqs)


def _only(run: Run, sid: str) -> Run:
    """A view of one turn of a run, for ``_same``."""
    view = Run.__new__(Run)
    view.seqs, view.events, view.commits, view.counters = [run[sid]], run.events, run.commits, run.counters
    return view


def test_a_draft_that_does_not_fit_the_kv_cap_is_dropped_not_the_turn(smol):
    """reserve refuses the draft's extra rows (a KV cap): the step decodes plainly and the turn goes on."""
    t = turn("s", REPEATED_LIST, max_tokens=30)
    plain = Run(smol, [t], None)
    capped = Run(smol, [t], SpecConfig(), reserve_limit=1)  # only ever one more row than the pending token
    same(plain, capped)
    assert capped.counters.drafted == 0 and capped["s"].finish_reason == "length"
    some = Run(smol, [t], SpecConfig(draft_tokens=8), reserve_limit=4)  # short drafts fit, long ones do not
    same(plain, some)
    assert all(len(toks) <= 4 for step in some.backend.chunks[1:] for _, toks, _ in step)
    assert some.counters.accepted > 0  # near max_tokens the drafts are short enough to fit


@pytest.mark.slow
def test_the_benchmark_runs_and_both_variants_agree(smollm2_q4_0):
    """A smoke run of the (not timed here) benchmark: its shape, and the same tokens both ways."""
    from weaved.bench.speculative import format_result, measure

    r = measure(smollm2_q4_0, threads=2, n_gen=12, reps=1, workloads=("repetitive",))
    rep = r["repetitive"]
    assert rep["identical"] and rep["tokens"] == 12 and rep["plain_tps"] > 0 and rep["spec_tps"] > 0
    assert set(rep) >= {"speedup", "acceptance", "tokens_per_verify", "verify_steps"}
    table = format_result(r)
    assert "repetitive" in table and "natural" not in table.splitlines()[-1]
