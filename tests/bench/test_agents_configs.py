"""The agents scenario's profiles: what each configuration runs with."""

from __future__ import annotations

import dataclasses

from weaved.bench.agents.configs import BASE_PROFILE, SPECS, ResolvedConfig, build_profile
from weaved.config.load import load_profile
from weaved.config.profile import ThreadBudget


def _base(kernels: int):
    base = load_profile(BASE_PROFILE)
    return dataclasses.replace(base, threads=ThreadBudget(kernels=kernels, gpu_driver=0, api=0))


def test_a_gpu_pool_gets_a_core_of_its_own(tmp_path):
    # the base profile is a host without a GPU: every core to the CPU pool's kernels, none to launch GPU work
    p = build_profile(ResolvedConfig(SPECS["weave"], ("gpu", "cpu")), tmp_path, base=_base(16))
    assert (p.threads.kernels, p.threads.gpu_driver) == (15, 1)
    assert [q.name for q in p.pools] == ["gpu", "cpu"]
    p = build_profile(ResolvedConfig(SPECS["gpu-only"], ("gpu",)), tmp_path, base=_base(16))
    assert p.threads.gpu_driver == 1


def test_without_a_gpu_pool_the_cpu_keeps_every_core(tmp_path):
    p = build_profile(ResolvedConfig(SPECS["weave"], ("cpu",)), tmp_path, base=_base(16))
    assert (p.threads.kernels, p.threads.gpu_driver) == (16, 0)


def test_threads_asked_for_are_the_kernels_and_rates_given_by_hand_follow(tmp_path):
    base = _base(8)
    base = dataclasses.replace(base, routing=dataclasses.replace(base.routing, cpu_prefill_tokens_per_s=800.0,
                                                                 cpu_decode_tokens_per_s=80.0))
    p = build_profile(ResolvedConfig(SPECS["weave"], ("gpu", "cpu")), tmp_path, threads=4, base=base)
    assert (p.threads.kernels, p.threads.gpu_driver) == (4, 1)
    assert (p.routing.cpu_prefill_tokens_per_s, p.routing.cpu_decode_tokens_per_s) == (400.0, 40.0)
    p = build_profile(ResolvedConfig(SPECS["weave"], ("gpu", "cpu")), tmp_path, base=base)
    assert p.threads.kernels == 7
    assert p.routing.cpu_decode_tokens_per_s == 70.0
