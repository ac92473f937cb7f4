import math

import numpy as np
import pytest

from weaved.engine.logit_edits import apply_repetition_penalty
from weaved.engine.sampling import (
    MAX_LOGPROBS,
    Sampler,
    SamplingParams,
    _draw,
    _weights,
    logprobs_of,
    min_p_filter,
    top_k_filter,
    top_p_filter,
)


def _ids(n):
    return np.arange(n)


def test_greedy_is_argmax_with_ties_to_lowest_id():
    s = Sampler(SamplingParams(temperature=0.0))
    logits = np.array([0.1, 3.0, -1.0, 3.0], np.float32)
    assert s.sample(logits, []) == 1


def test_greedy_does_not_consume_randomness():
    s = Sampler(SamplingParams(temperature=0.0, seed=5))
    state = s.rng.bit_generator.state
    s.sample(np.array([1.0, 2.0], np.float32), [])
    assert s.rng.bit_generator.state == state


def test_greedy_applies_repetition_penalty_first():
    s = Sampler(SamplingParams(temperature=0.0, repetition_penalty=2.0))
    logits = np.array([3.0, 2.0, 0.0], np.float32)
    assert s.sample(logits, [0]) == 1  # 3.0 / 2 = 1.5 < 2.0


def test_same_seed_same_tokens_and_different_seed_differs():
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(50, 1000)).astype(np.float32) * 3
    p = SamplingParams(temperature=0.8, top_p=0.95, top_k=50, min_p=0.01, seed=42)
    a, b = Sampler(p), Sampler(p)
    ta = [a.sample(r, []) for r in rows]
    tb = [b.sample(r, []) for r in rows]
    assert ta == tb
    c = Sampler(SamplingParams(temperature=0.8, top_p=0.95, top_k=50, min_p=0.01, seed=43))
    assert [c.sample(r, []) for r in rows] != ta


def test_unseeded_sampler_records_its_seed_for_replay():
    s = Sampler(SamplingParams())
    replay = Sampler(SamplingParams(seed=s.seed))
    row = np.zeros(100, np.float32)
    assert [s.sample(row, []) for _ in range(20)] == [replay.sample(row, []) for _ in range(20)]


def test_input_logits_are_not_modified():
    logits = np.array([1.0, -2.0, 0.5], np.float32)
    before = logits.copy()
    Sampler(SamplingParams(repetition_penalty=1.5, seed=1)).sample(logits, [0, 1])
    np.testing.assert_array_equal(logits, before)


def test_draw_frequencies_match_softmax():
    # 20,000 draws on 5 tokens with a fixed seed: Pearson chi-square well under the 0.999 quantile
    # for 4 degrees of freedom (18.47).  Deterministic given the seed.
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0], np.float32)
    temp = 0.7
    s = Sampler(SamplingParams(temperature=temp, seed=123))
    n = 20_000
    counts = np.bincount([s.sample(logits, []) for _ in range(n)], minlength=5)
    e = np.exp(logits / temp)
    expected = n * e / e.sum()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 18.47, (counts, expected)


def test_filtered_tokens_are_never_drawn():
    logits = np.array([3.0, 2.9, 2.8, 0.0, -5.0, -5.0], np.float32)
    s = Sampler(SamplingParams(temperature=1.5, top_k=3, seed=7))
    drawn = {s.sample(logits, []) for _ in range(500)}
    assert drawn == {0, 1, 2}


def test_top_k_exact_with_boundary_ties_to_lowest_id():
    vals = np.array([1.0, 5.0, 3.0, 3.0, 3.0, 0.0], np.float32)
    ids, v = top_k_filter(_ids(6), vals, 3)
    assert ids.tolist() == [1, 2, 3]
    assert v.tolist() == [5.0, 3.0, 3.0]
    ids, _ = top_k_filter(_ids(6), vals, 10)  # k >= n: everything, sorted
    assert ids.tolist() == [1, 2, 3, 4, 0, 5]


def test_top_k_on_large_vocab_matches_full_sort():
    rng = np.random.default_rng(3)
    vals = rng.normal(size=49152).astype(np.float32)
    ids, _ = top_k_filter(_ids(49152), vals, 40)
    assert ids.tolist() == np.argsort(-vals, kind="stable")[:40].tolist()


def test_top_p_keeps_shortest_prefix_reaching_p():
    probs = np.array([0.1, 0.5, 0.25, 0.15])
    vals = np.log(probs).astype(np.float32)
    # sorted: 0.5, 0.25, 0.15, 0.1 -> cumulative 0.5, 0.75, 0.9, 1.0
    assert top_p_filter(_ids(4), vals, 0.5)[0].tolist() == [1]
    assert top_p_filter(_ids(4), vals, 0.6)[0].tolist() == [1, 2]
    assert top_p_filter(_ids(4), vals, 0.8)[0].tolist() == [1, 2, 3]
    assert top_p_filter(_ids(4), vals, 0.95)[0].tolist() == [1, 2, 3, 0]
    assert top_p_filter(_ids(4), vals, 0.01)[0].tolist() == [1]
    assert top_p_filter(_ids(4), vals, 0.0)[0].tolist() == [1]  # OpenAI's top_p 0: the most probable


def test_top_p_on_flat_large_vocab_grows_past_first_selection():
    # Uniform over 49152: the nucleus for p=0.5 is half the vocabulary, far more than the first
    # partial selection, so the growth path must find it - with ties going to the lowest ids.
    vals = np.zeros(49152, np.float32)
    ids, _ = top_p_filter(_ids(49152), vals, 0.5)
    assert len(ids) in (24576, 24577)  # float rounding at exactly p
    assert ids.tolist() == list(range(len(ids)))


def test_min_p_threshold_relative_to_top_probability():
    probs = np.array([0.5, 0.3, 0.1, 0.06, 0.04])
    vals = np.log(probs).astype(np.float32)
    ids, _ = min_p_filter(_ids(5), vals, 0.2)  # keep p >= 0.1
    assert ids.tolist() == [0, 1, 2]
    ids, _ = min_p_filter(_ids(5), vals, 1.0)
    assert ids.tolist() == [0]


def test_chain_order_top_k_then_top_p_renormalizes_over_survivors():
    # After top_k=2 the survivors are {0: 0.4, 1: 0.3} -> renormalized 0.571, 0.429; top_p=0.5 keeps
    # only token 0.  Without top_k first, top_p=0.5 would keep {0, 1}.
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    logits = np.log(probs).astype(np.float32)
    s = Sampler(SamplingParams(top_k=2, top_p=0.5, seed=0))
    assert {s.sample(logits, []) for _ in range(200)} == {0}
    s = Sampler(SamplingParams(top_p=0.5, seed=0))
    assert {s.sample(logits, []) for _ in range(200)} == {0, 1}


def test_top_p_is_computed_before_temperature():
    # llama.cpp's order: top-p sees unscaled probabilities.  At temperature 5 the scaled distribution
    # is nearly flat, but the nucleus (p=0.6 on [0.5, 0.3, 0.2]) is still {0, 1}.
    logits = np.log(np.array([0.5, 0.3, 0.2])).astype(np.float32)
    s = Sampler(SamplingParams(temperature=5.0, top_p=0.6, seed=11))
    assert {s.sample(logits, []) for _ in range(300)} == {0, 1}


def test_repetition_penalty_llama_cpp_semantics():
    logits = np.array([2.0, -2.0, 1.0, 0.0, 4.0], np.float32)
    out = apply_repetition_penalty(logits, [0, 1, 1, 3, 4], penalty=2.0, last_n=4)
    # window = [1, 1, 3, 4]: token 0 is outside it; each seen token is penalized once.
    np.testing.assert_array_equal(out, np.array([2.0, -4.0, 1.0, 0.0, 2.0], np.float32))
    assert apply_repetition_penalty(logits, [0], penalty=1.0, last_n=64) is logits
    assert apply_repetition_penalty(logits, [0], penalty=2.0, last_n=0) is logits
    whole = apply_repetition_penalty(logits, [0, 1, 1, 3, 4], penalty=2.0, last_n=-1)
    assert whole[0] == 1.0


def test_repetition_penalty_below_one_boosts():
    out = apply_repetition_penalty(np.array([2.0, -2.0], np.float32), [0, 1], penalty=0.5, last_n=8)
    np.testing.assert_array_equal(out, np.array([4.0, -1.0], np.float32))


def test_nan_and_all_masked_logits_raise():
    s = Sampler(SamplingParams(seed=0))
    with pytest.raises(ValueError, match="NaN"):
        s.sample(np.array([0.0, np.nan], np.float32), [])
    with pytest.raises(ValueError, match="-inf"):
        s.sample(np.full(3, -np.inf, np.float32), [])
    with pytest.raises(ValueError, match="-inf"):
        Sampler(SamplingParams(temperature=0)).sample(np.full(3, -np.inf, np.float32), [])


def test_tiny_temperature_is_effectively_greedy():
    s = Sampler(SamplingParams(temperature=1e-30, seed=0))
    logits = np.array([1.0, 1.5, 1.49], np.float32)
    assert {s.sample(logits, []) for _ in range(50)} == {1}


def test_logprobs_of_matches_log_softmax():
    logits = np.array([1.0, 3.0, 2.0, 3.0], np.float32)
    lp, top = logprobs_of(logits, 2, 3)
    ref = logits.astype(np.float64) - math.log(np.exp(logits.astype(np.float64)).sum())
    assert lp == pytest.approx(ref[2], abs=1e-12)
    assert [i for i, _ in top] == [1, 3, 2]
    assert [v for _, v in top] == pytest.approx([ref[1], ref[3], ref[2]], abs=1e-12)
    assert logprobs_of(logits, 0, 0)[1] == []


def test_logprobs_of_is_stable_for_large_logits():
    lp, top = logprobs_of(np.array([1000.0, 0.0], np.float32), 0, 1)
    assert lp == pytest.approx(0.0, abs=1e-12)
    assert top[0][0] == 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": -0.5}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.5}, "min_p"),
        ({"min_p": 1.01}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repeat_last_n": -2}, "repeat_last_n"),
        ({"seed": -1}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"stop_token_ids": (-3,)}, "stop_token_ids"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"top_k": True}, "top_k"),
    ],
)
def test_validation_errors_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_params_store_tuples_and_are_hashable():
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[2])
    assert p.stop == ("a", "b") and p.stop_token_ids == (2,)
    hash(p)


def _ref_sorted(vals):
    """Reference order: descending logit, ties by ascending id (a full sort)."""
    return np.lexsort((np.arange(len(vals)), -vals))


@pytest.mark.parametrize("k", [1, 7, 40, 300, 1200, 4999])
def test_top_k_matches_full_sort_reference_with_many_ties(k):
    rng = np.random.default_rng(k)
    vals = np.round(rng.normal(size=5000) * 2).astype(np.float32)  # ~15 distinct values: ties everywhere
    vals[rng.integers(0, 5000, 50)] = -np.inf
    ids, v = top_k_filter(_ids(5000), vals, k)
    ref = _ref_sorted(vals)[:k]
    assert ids.tolist() == ref.tolist()
    np.testing.assert_array_equal(v, vals[ref])


@pytest.mark.parametrize("p", [0.05, 0.3, 0.9, 0.999])
def test_top_p_matches_full_sort_reference(p):
    rng = np.random.default_rng(int(p * 1000))
    vals = (rng.normal(size=20_000) * 1.5).astype(np.float32)
    ids, _ = top_p_filter(_ids(20_000), vals, p)
    order = _ref_sorted(vals)
    probs = np.exp(vals[order].astype(np.float64) - vals.max())
    cum = np.cumsum(probs) / probs.sum()
    n_ref = int(np.searchsorted(cum, p, side="left")) + 1
    assert abs(len(ids) - n_ref) <= 1  # the running sum may land on p within rounding
    m = min(len(ids), n_ref)
    assert ids[:m].tolist() == order[:m].tolist()


def test_large_vocab_draw_frequencies_and_masked_tokens_never_drawn():
    # Mass on a few ids spread over different blocks of the two-level search; everything else masked.
    vocab = 49152
    logits = np.full(vocab, -np.inf, np.float32)
    hot = np.array([3, 1500, 20_000, 49151])
    logits[hot] = np.log(np.array([0.1, 0.2, 0.3, 0.4])).astype(np.float32)
    s = Sampler(SamplingParams(seed=99))
    n = 4000
    draws = [s.sample(logits, []) for _ in range(n)]
    assert set(draws) <= set(hot.tolist())
    counts = np.array([draws.count(int(h)) for h in hot])
    expected = n * np.array([0.1, 0.2, 0.3, 0.4])
    assert float(((counts - expected) ** 2 / expected).sum()) < 16.27  # chi-square 0.999, 3 dof


def test_large_vocab_draw_matches_softmax_on_dense_logits():
    # 49,152 live tokens: bucket ids into 8 groups and compare group frequencies with their mass.
    rng = np.random.default_rng(5)
    logits = rng.normal(size=49152).astype(np.float32)
    w = _weights(logits, 1.0)
    n = 8000
    groups = np.array([_draw(w, u) for u in rng.random(n)]) * 8 // 49152
    e = np.exp(logits.astype(np.float64))
    mass = np.array([e[g * 6144 : (g + 1) * 6144].sum() for g in range(8)]) / e.sum()
    counts = np.bincount(groups, minlength=8)
    chi2 = float(((counts - n * mass) ** 2 / (n * mass)).sum())
    assert chi2 < 24.32  # chi-square 0.999, 7 dof
