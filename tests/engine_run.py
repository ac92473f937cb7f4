"""Running the batch engine over a few turns in tests: shared backends, the run with the engine's contract
with its backend checked, and the comparison of two runs (the speculative and constrained engine tests)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from weaved.daemon.warmup import warm_up
from weaved.engine.engine import BatchEngine
from weaved.engine.sampling import SamplingParams
from weaved.engine.scheduler import SchedulerConfig
from weaved.engine.sequence import Sequence, SLARank
from weaved.engine.speculative import SpecConfig
from weaved.engine.stops import StopChecker

_backends: dict[tuple[str, str], object] = {}


def shared_backend(request, kind: str, model: str):
    """One backend per (kind, model) for the whole run, its kernels compiled before any test's deadline."""
    if kind == "torch":
        mod = pytest.importorskip("weaved.backends.torch")
    key = (kind, model)
    if key not in _backends:
        path = request.getfixturevalue(model)
        if kind == "cpu":
            from weaved.backends.cpu import CPUBackend

            _backends[key] = CPUBackend.from_file(path, threads=2)
        else:
            from weaved.model.loader import open_model

            gguf, cfg = open_model(path)
            _backends[key] = mod.TorchBackend(gguf, cfg, device="cpu")
        # compile the kernels here, as the daemon does at load: with a cold numba cache that takes minutes,
        # which no engine run's deadline below is meant to cover
        warm_up(_backends[key], _backends[key].config.vocab_size)
    return _backends[key]


@pytest.fixture
def smol(request):
    return shared_backend(request, "cpu", "smollm2_q4_0")


@pytest.fixture(scope="module")
def tokenizer(smollm2_q4_0):
    from weaved.model.tokenizer import Tokenizer

    return Tokenizer(smollm2_q4_0)


class Checked:
    """The backend, checking the engine's contract around each forward: every chunk's rows reserved.
    (Problems are collected, not raised: the engine thread would turn an exception into failed turns.)"""

    def __init__(self, be, reserved: dict[int, int], problems: list[str]):
        self.be, self.reserved, self.problems, self.name = be, reserved, problems, be.name
        self.host_parallel = be.host_parallel
        self.seqs: dict[int, Sequence] = {}  # by id(kv)
        self.chunks: list[list[tuple[int, list[int], int]]] = []  # per step: (id(kv), tokens, generated so far)

    def prepare(self, kv, new_length):
        self.be.prepare(kv, new_length)

    def forward(self, chunks):
        for c in chunks:
            if self.reserved.get(id(c.kv), -1) < c.kv.length + len(c.tokens):
                self.problems.append(f"rows {c.kv.length}..{c.kv.length + len(c.tokens) - 1} written unreserved")
        self.chunks.append([(id(c.kv), c.tokens.tolist(), len(self.seqs[id(c.kv)].generated)) for c in chunks])
        return self.be.forward(chunks)


class Run:
    """One engine run over some turns: events, commits and counters, with the contract checked."""

    def __init__(self, be, turns: list[dict], spec: SpecConfig | None, sched: SchedulerConfig | None = None,
                 tokenizer=None, reserve_limit: int | None = None):
        self.events: dict[str, list[dict]] = {}
        self.commits: dict[str, list[int]] = {}
        reserved: dict[int, int] = {}
        problems: list[str] = []
        done = {t["id"]: threading.Event() for t in turns}

        def reserve(seq, new_length):
            if reserve_limit is not None and not seq.prefilling and new_length > seq.kv.length + reserve_limit:
                raise RuntimeError("KV cap")
            reserved[id(seq.kv)] = max(reserved.get(id(seq.kv), 0), new_length)

        def commit(seq, fed):
            got = self.commits.setdefault(seq.session_id, [])
            got.extend(fed)
            if seq.kv.length != len(got):
                problems.append(f"{len(got)} tokens committed at KV length {seq.kv.length}")

        self.backend = Checked(be, reserved, problems)
        eng = BatchEngine("p", self.backend, sched or SchedulerConfig(), commit=commit, reserve=reserve,
                          speculative=spec)
        self.seqs = []
        for t in turns:
            p: SamplingParams = t["params"]
            stops = decoder = None
            if tokenizer is not None:
                decoder = tokenizer.stream_decoder()
                stops = StopChecker(p.stop, set(p.stop_token_ids) | set(tokenizer.eog_ids))
            elif p.stop_token_ids:
                stops = StopChecker((), p.stop_token_ids)
            s = Sequence(t["id"], be.new_kv(t.get("capacity", 512)), list(t["prompt"]), p, SLARank.INTERACTIVE,
                         decoder=decoder, stops=stops,
                         constraint=t["constraint"]() if "constraint" in t else None)
            s.emit = self._sink(self.events.setdefault(t["id"], []), done[t["id"]])
            self.seqs.append(s)
            self.backend.seqs[id(s.kv)] = s
            eng.submit(s)
        eng.start()
        try:
            for e in done.values():
                assert e.wait(120)
        finally:
            eng.stop()
        assert not problems, problems[:3]
        self.counters = eng.counters

    @staticmethod
    def _sink(log: list[dict], done: threading.Event):
        def emit(ev: dict) -> None:
            log.append(ev)
            if ev["type"] in ("done", "error"):
                done.set()

        return emit

    def __getitem__(self, sid: str) -> Sequence:
        return next(s for s in self.seqs if s.session_id == sid)


def same(plain: Run, spec: Run) -> None:
    """Every turn: the same events (tokens, text, logprobs, finish), commits and KV rows."""
    for a in plain.seqs:
        b = spec[a.session_id]
        assert b.generated == a.generated and b.finish_reason == a.finish_reason
        assert spec.events[a.session_id] == plain.events[a.session_id]
        assert spec.commits[a.session_id] == plain.commits[a.session_id]
        assert b.kv.length == a.kv.length == len(spec.commits[a.session_id])
        n = a.kv.length
        assert np.array_equal(b.kv.data[:, :, :, :n], a.kv.data[:, :, :, :n])


def turn(sid, prompt, **params) -> dict:
    return {"id": sid, "prompt": prompt, "params": SamplingParams(**{"temperature": 0, **params})}
