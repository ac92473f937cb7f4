"""Logit bias, llama.cpp's penalties, masks and min_tokens, each changing the choice as specified."""

from __future__ import annotations

import numpy as np
import pytest

from weaved.engine.logit_edits import apply_logit_bias, apply_mask, apply_penalties
from weaved.engine.sampling import Sampler, SamplingParams
from weaved.engine.sequence import Sequence, SLARank
from weaved.engine.stops import StopChecker


def test_logit_bias_adds_to_the_named_tokens_only():
    x = np.array([1.0, 2.0, 3.0], np.float32)
    out = apply_logit_bias(x, ((0, 5.0), (2, -100.0)))
    assert out.tolist() == [6.0, 2.0, -97.0] and x.tolist() == [1.0, 2.0, 3.0]
    assert Sampler(SamplingParams(temperature=0, logit_bias=((0, 100.0),))).sample(x, []) == 0


def test_penalties_follow_llama_cpp():
    """Seen c times in the window: repetition divides a positive logit (multiplies a negative one), then
    c * frequency + presence is subtracted; unseen tokens and tokens outside the window are untouched."""
    x = np.array([2.0, -1.0, 3.0, 0.5], np.float32)
    out = apply_penalties(x, [9, 0, 1, 1, 0, 1], last_n=5, repeat=2.0, frequency=0.5, presence=0.25)
    # window [0, 1, 1, 0, 1]: token 0 twice, token 1 three times
    assert out.tolist() == pytest.approx([2.0 / 2 - (2 * 0.5 + 0.25), -1.0 * 2 - (3 * 0.5 + 0.25), 3.0, 0.5])
    assert apply_penalties(x, [0, 1], last_n=0, frequency=1.0) is x  # no window: nothing to do


@pytest.mark.parametrize(("kw", "want"), [({"frequency_penalty": 1.5}, 1), ({"presence_penalty": 1.5}, 1),
                                          ({}, 0)])
def test_frequency_and_presence_change_the_greedy_choice(kw, want):
    x = np.array([3.0, 2.0], np.float32)
    assert Sampler(SamplingParams(temperature=0, **kw)).sample(x, [0]) == want


def test_mask_and_banned_ids():
    x = np.array([1.0, 5.0, 3.0], np.float32)
    out = apply_mask(x, np.array([True, False, True]), banned=[2])
    assert out.tolist() == [1.0, -np.inf, -np.inf]
    with pytest.raises(ValueError):
        apply_mask(x, np.array([True, False]))
    with pytest.raises(ValueError, match="-inf"):
        Sampler(SamplingParams(temperature=0)).sample(x, [], allowed=np.zeros(3, bool))


def test_min_tokens_holds_back_the_end_of_turn():
    eos = 0
    seq = Sequence("s", None, [5], SamplingParams(temperature=0, min_tokens=2), SLARank.INTERACTIVE,
                   stops=StopChecker((), {eos}))
    row = np.array([9.0, 1.0, 2.0], np.float32)  # end of turn is the likeliest
    assert seq.sample(row) == 2
    seq.generated.append(2)
    assert seq.sample(row) == 2
    seq.generated.append(2)
    assert seq.sample(row) == eos  # two tokens written: it may end now


def test_params_validation():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=((1, 101.0),))
    with pytest.raises(ValueError, match="frequency_penalty"):
        SamplingParams(frequency_penalty=3.0)
