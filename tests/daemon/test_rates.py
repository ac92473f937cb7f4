"""The daemon's routing and admission rates: calibrated on this host on first use of a model (stored in
the data directory, read back by later daemons), or the profile's when it gives them (an override)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from weaved.config.load import load_profile
from weaved.daemon import rates as rates_mod
from weaved.daemon.core import Daemon

REAL_FIT_LIMIT = rates_mod.FIT_LIMIT


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The machine's cache in the test's directory, and every fit good enough to store: how well step times
    fit depends on what else runs on the cores, and these tests are about where rates come from and where
    they are kept (the poor-fit test sets the real limit back)."""
    path = tmp_path / "machine-cache"
    monkeypatch.setenv("WEAVE_CACHE_DIR", str(path))
    monkeypatch.setattr(rates_mod, "FIT_LIMIT", math.inf)
    return path


def _daemon(model, data_dir, profile=None) -> Daemon:
    said: list[str] = []
    d = Daemon(profile or load_profile("cpu-only"), model, data_dir=data_dir, log_fn=lambda m: None)
    d.load(progress=said.append)
    d.said = said
    return d


def test_a_first_daemon_calibrates_and_later_ones_read_the_result(tiny_llama, tmp_path, cache):
    d = _daemon(tiny_llama, tmp_path / "a")
    try:
        rates = d.status()["rates"]
        assert rates["source"] == "calibrated" and any("calibrated in" in m for m in d.said)
        assert not any("no chat template" in m for m in d.said)
        assert list((tmp_path / "a" / "calibration").glob("*.json")) and list((cache / "calibration").glob("*.json"))
        th, pool = d.profile.routing, d.pools["cpu"]
        assert (th.cpu_prefill_tokens_per_s, th.cpu_decode_tokens_per_s) == (
            pytest.approx(rates["prefill_tokens_per_s"], rel=1e-3), pytest.approx(rates["decode_tokens_per_s"],
                                                                                  rel=1e-3))
        assert pool.engine.capacity.prior_tps == pytest.approx(th.cpu_decode_tokens_per_s)
        assert d.moves.routing is d.profile.routing  # what the router decides with
        # the router predicts turns on the pool with its step model, and interactive steps are sized by it
        cost = pool.step_cost
        assert cost is not None and cost.to_dict() == rates["step_cost"]
        assert pool.engine.config.step_cost is cost and pool.engine.config.step_target_s == pytest.approx(0.08)
        shown = next(p for p in d.status()["pools"] if p["name"] == "cpu")
        assert shown["step_model_scale"] == 1.0  # nothing run yet: as calibrated
        assert pool.state(free_kv_tokens=1000).step_cost is cost
        pool.engine.step_drift.factor = 2.0  # steps running at twice the model: the router sees it too
        seen = pool.state(free_kv_tokens=1000).step_cost
        assert seen.to_dict() == cost.scaled(2.0).to_dict() and pool.engine.step_cost_now().to_dict() == seen.to_dict()
        pool.use_step_model(cost.scaled(2.0), 0.08)  # measured again: the drift against the old one is gone
        assert pool.engine.step_drift.factor == 1.0 and pool.engine.step_cost_now().to_dict() == seen.to_dict()
    finally:
        d.shutdown()
    again = _daemon(tiny_llama, tmp_path / "b")  # another data directory on this host: nothing measured
    try:
        assert not any("calibrat" in m for m in again.said)
        assert again.status()["rates"]["measured_at"] == rates["measured_at"]
        assert list((tmp_path / "b" / "calibration").glob("*.json"))
    finally:
        again.shutdown()


def test_rates_the_profile_gives_override_calibration(tiny_llama, tmp_path, cache):
    base = load_profile("cpu-only")
    prof = dataclasses.replace(base, routing=dataclasses.replace(base.routing, cpu_prefill_tokens_per_s=123.0,
                                                                 cpu_decode_tokens_per_s=45.0))
    d = _daemon(tiny_llama, tmp_path / "a", prof)
    try:
        assert d.status()["rates"] == {"prefill_tokens_per_s": 123.0, "decode_tokens_per_s": 45.0,
                                       "source": "profile"}
        assert not (tmp_path / "a" / "calibration").exists() and not any("calibrat" in m for m in d.said)
        assert d.pools["cpu"].engine.capacity.prior_tps == 45.0
    finally:
        d.shutdown()


def test_gpu_pools_on_cuda_calibrate_their_steps_and_link(tiny_llama, tmp_path, cache):
    """A GPU pool's backend on CUDA is calibrated as the CPU pool is, with the host-to-device bandwidth
    of a promotion's copy; torch's CPU device standing in for a GPU is not (the daemon's default) - the
    same path is run here on it by asking for stand-ins."""
    pytest.importorskip("torch")
    from tests.daemon.test_coexec import coexec_profile
    from weaved.calibration.store import CalibrationStore
    from weaved.daemon.device_rates import calibrate_devices
    from weaved.kv.store import model_fingerprint

    d = _daemon(tiny_llama, tmp_path / "a", coexec_profile())
    try:
        assert d.device_rates == [] and d.status()["device_rates"] == []  # a stand-in: nothing measured
        store = CalibrationStore(tmp_path / "a", cache / "calibration")
        out = calibrate_devices(d.pools, model_fingerprint(d.config), store, lambda m: None, stand_ins=True,
                                step_target_s=0.05)
        assert [r.pools for r in out] == [("gpu",)] and out[0].calibration.backend == "torch"
        gpu = d.pools["gpu"]
        assert gpu.step_cost == out[0].calibration.cost and gpu.engine.config.step_target_s == 0.05
        assert out[0].link_bytes_per_s > 0 and out[0].calibration.cost.decode_tokens_per_s(4) > 0
        shown = out[0].to_dict()
        assert shown["device"] == "cpu" and shown["link_gb_s"] > 0 and "step_cost" in shown
    finally:
        d.shutdown()


def test_a_stored_calibration_that_measured_smaller_batches_is_measured_again(tiny_llama, tmp_path, cache):
    base = load_profile("cpu-only")

    def with_batch(n: int):
        pools = tuple(dataclasses.replace(p, max_batch=n, token_budget=p.prefill_chunk + n) if p.name == "cpu" else p
                      for p in base.pools)
        return dataclasses.replace(base, pools=pools)

    small = _daemon(tiny_llama, tmp_path / "a", with_batch(16))
    small.shutdown()
    assert any("calibrated in" in m for m in small.said)
    big = _daemon(tiny_llama, tmp_path / "b", with_batch(64))  # its rates at 64 would be extrapolated: measured
    try:
        assert any("decode batches up to 16" in m and "64" in m for m in big.said)
        assert any("calibrated in" in m for m in big.said)
    finally:
        big.shutdown()
    again = _daemon(tiny_llama, tmp_path / "c", with_batch(16))  # the batch-64 calibration covers 16
    try:
        assert not any("calibrat" in m for m in again.said)
    finally:
        again.shutdown()


def test_a_calibration_that_does_not_fit_is_measured_again_and_never_stored(tiny_llama, tmp_path, cache,
                                                                           monkeypatch):
    """A busy host makes step times the model cannot fit: measured again, and a fit still that poor serves
    only this run (a stored one would mislead admission until someone recalibrated by hand)."""
    from weaved.daemon import rates

    monkeypatch.setattr(rates, "FIT_LIMIT", REAL_FIT_LIMIT)
    real, fits = rates.measure, []

    def noisy(*a, **kw):
        m = real(*a, **kw)
        fits.append(m)
        m.max_error = lambda: 0.95  # what a measurement beside other work gave
        return m

    monkeypatch.setattr(rates, "measure", noisy)
    d = _daemon(tiny_llama, tmp_path / "a")
    try:
        assert len(fits) == rates.MEASURES
        assert d.status()["rates"]["source"] == "calibrated"  # used for this run
        assert any("measuring again (2 of 3)" in m for m in d.said) and any("not stored" in m for m in d.said)
        assert not list((tmp_path / "a" / "calibration").glob("*.json"))
        assert not list((cache / "calibration").glob("*.json"))
    finally:
        d.shutdown()
    monkeypatch.setattr(rates, "measure", real)
    monkeypatch.setattr(rates, "FIT_LIMIT", math.inf)  # (a real fit: as good as the host is quiet)
    d = _daemon(tiny_llama, tmp_path / "b")  # the next start measures afresh, and a fit that fits is kept
    try:
        assert any("calibrated in" in m for m in d.said) and list((cache / "calibration").glob("*.json"))
    finally:
        d.shutdown()


def test_a_model_without_a_chat_template_is_said_at_load(tiny_llama, tmp_path, cache, monkeypatch):
    """Said once when the daemon starts, not only in each chat request it then refuses."""
    from weaved.model import tokenizer as tk

    init = tk.Tokenizer.__init__

    def without_template(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.chat_template = None  # e.g. a base model's file

    monkeypatch.setattr(tk.Tokenizer, "__init__", without_template)
    d = _daemon(tiny_llama, tmp_path / "a")
    try:
        [said] = [m for m in d.said if "no chat template" in m]
        assert "--chat-template FILE" in said and "/v1/completions" in said
    finally:
        d.shutdown()
