"""The compiled sampler chain: the same tokens as the chain written out in numpy, and a step's rows
sampled together get the tokens each gets alone."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from weaved.kernels.sample_chain import ALL_NEG_INF, chain_row

from weaved.backends.cpu import CPUBackend
from weaved.engine.engine import BatchEngine
from weaved.engine.sampling import (
    Sampler,
    SamplingParams,
    _draw,
    _weights,
    min_p_filter,
    sample_rows,
    top_k_filter,
    top_p_filter,
)
from weaved.engine.scheduler import SchedulerConfig
from weaved.engine.sequence import Sequence, SLARank


def _numpy_chain(x: np.ndarray, k: int, top_p: float, min_p: float, temperature: float, u: float) -> int:
    """llama.cpp's chain step by step with the module's numpy filters (the chain before it was compiled)."""
    ids, vals = top_k_filter(np.arange(x.shape[0]), x, k)
    if top_p < 1.0:
        ids, vals = top_p_filter(ids, vals, top_p, sorted_desc=True)
    if min_p > 0.0:
        ids, vals = min_p_filter(ids, vals, min_p)
    return int(ids[_draw(_weights(vals, temperature), u)])


@pytest.mark.parametrize("vocab", [7, 1000, 49152])
def test_compiled_chain_draws_what_the_numpy_chain_draws(vocab):
    rng = np.random.default_rng(vocab)
    for i in range(120):
        x = (rng.standard_normal(vocab) * rng.uniform(0.5, 6)).astype(np.float32)
        if i % 4 == 0:  # ties at the top-k boundary
            x = np.round(x)
        if i % 5 == 0:  # masked tokens
            x[rng.integers(0, vocab, vocab // 3)] = -np.inf
        k = int(rng.choice([1, 5, 40, 300]))
        top_p = float(rng.choice([1.0, 0.95, 0.5, 0.0]))
        min_p = float(rng.choice([0.0, 0.05, 0.3]))
        temp = float(rng.choice([0.3, 0.7, 1.0, 1.8]))
        u = float(rng.random())
        want = _numpy_chain(x, k, top_p, min_p, temp, u)
        got = chain_row(x, k, top_p, min_p, np.float32(min(1.0 / temp, 1e30)), u)
        assert got == want, (i, k, top_p, min_p, temp)


def test_compiled_chain_says_when_every_logit_is_masked():
    x = np.full(100, -np.inf, np.float32)
    assert chain_row(x, 40, 0.95, 0.05, np.float32(1.0), 0.5) == ALL_NEG_INF
    assert chain_row(x, 0, 1.0, 0.0, np.float32(1.0), 0.0) == ALL_NEG_INF
    with pytest.raises(ValueError, match="-inf"):
        Sampler(SamplingParams(top_k=40, seed=1)).sample(x, [])


def _params(i: int) -> SamplingParams:
    if i % 4 == 0:
        return SamplingParams(temperature=0, seed=i)
    return SamplingParams(temperature=0.5 + 0.1 * (i % 7), top_k=[40, 5, 1000][i % 3], top_p=[0.95, 1.0][i % 2],
                          min_p=[0.05, 0.0, 0.2][i % 3], seed=i)


@pytest.mark.parametrize("parallel", [True, False], ids=["parallel", "serial"])
@pytest.mark.parametrize("layout", ["views", "padded", "separate"])
def test_rows_sampled_together_get_the_tokens_each_gets_alone(layout, parallel):
    rng = np.random.default_rng(1)
    n, vocab = 24, 5000
    wide = (rng.standard_normal((n, vocab + (48 if layout == "padded" else 0))) * 3).astype(np.float32)
    logits = wide[:, :vocab]
    rows = [logits[i] for i in range(n)] if layout != "separate" else [logits[i].copy() for i in range(n)]
    order = rng.permutation(n)  # the rows in another order than the array's
    together, alone = [Sampler(_params(i)) for i in range(n)], [Sampler(_params(i)) for i in range(n)]
    for _ in range(3):  # each draw advances each generator once, as alone
        got = sample_rows([together[i] for i in order], [rows[i] for i in order], parallel)
        want = [alone[i].sample(rows[i], []) for i in order]
        assert got == want


def test_a_row_the_chain_cannot_sample_is_left_to_the_sampler():
    rows = np.zeros((3, 50), np.float32)
    rows[1, 7] = np.nan
    rows[2, 3] = np.inf
    got = sample_rows([Sampler(SamplingParams(top_k=10, seed=i)) for i in range(3)], list(rows))
    assert got[0] is not None and got[1] is None and got[2] is None
    with pytest.raises(ValueError, match="NaN"):
        Sampler(SamplingParams(top_k=10, seed=1)).sample(rows[1], [])


def test_plain_means_nothing_edits_the_row():
    assert Sampler(SamplingParams(top_k=40)).plain
    assert Sampler(SamplingParams(temperature=0)).plain
    assert not Sampler(SamplingParams(top_k=0)).plain  # the full-vocabulary chain stays in numpy
    assert not Sampler(SamplingParams(top_k=40, repetition_penalty=1.1)).plain
    assert not Sampler(SamplingParams(top_k=40, presence_penalty=0.5)).plain
    assert not Sampler(SamplingParams(top_k=40, logit_bias=((3, 1.0),))).plain
    assert Sampler(SamplingParams(top_k=40, repetition_penalty=1.1, repeat_last_n=0)).plain


@pytest.fixture(scope="module")
def backend(tiny_llama):
    return CPUBackend.from_file(tiny_llama, threads=2)


def _run(be, specs: list[tuple[str, SamplingParams]]) -> dict[str, list[int]]:
    eng = BatchEngine("cpu", be, SchedulerConfig(max_batch=8))
    done = {name: threading.Event() for name, _ in specs}
    seqs = {}
    for name, params in specs:
        j = sum(map(ord, name))  # a prompt of its own, whatever else runs
        prompt = list(range(20 + j, 36 + j))
        seqs[name] = Sequence(name, be.new_kv(64), prompt, params, SLARank.BATCH,
                              emit=lambda ev, name=name: ev["type"] in ("done", "error") and done[name].set())
        eng.submit(seqs[name])
    for _ in range(200):
        if all(e.is_set() for e in done.values()):
            break
        eng.run_once()
    assert all(e.is_set() for e in done.values())
    return {name: s.generated for name, s in seqs.items()}


def test_an_engine_step_samples_plain_rows_together_with_the_tokens_each_gets_alone(backend, monkeypatch):
    import weaved.engine.engine_step as engine_module

    batches = []

    def counted(samplers, rows, parallel):
        batches.append(len(rows))
        assert parallel  # the CPU backend's engine thread owns the kernels' threads
        return sample_rows(samplers, rows, parallel)

    monkeypatch.setattr(engine_module, "sample_rows", counted)
    specs = [(f"s{i}", SamplingParams(max_tokens=12, temperature=0.9, top_k=[40, 3][i % 2], seed=100 + i))
             for i in range(5)]
    specs.append(("greedy", SamplingParams(max_tokens=12, temperature=0)))
    specs.append(("penalized", SamplingParams(max_tokens=12, temperature=0.9, top_k=40, repetition_penalty=1.3,
                                              seed=7)))
    together = _run(backend, specs)
    assert max(batches) == 6  # the five top-k rows and the greedy one; the penalized row alone
    for spec in specs:
        assert _run(backend, [spec]) == {spec[0]: together[spec[0]]}
