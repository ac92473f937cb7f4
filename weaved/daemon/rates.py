"""The rates the daemon routes and admits with: each CPU pool's backend calibrated on this host
(``weaved.calibration``: the stored step-time model, or one measured once, on first use of the model),
unless the profile gives its own rates (``[routing] cpu_prefill_tokens_per_s`` and
``cpu_decode_tokens_per_s``: overrides).

The router's thresholds get the calibrated prefill rate (a 1,024-token prompt in the first CPU pool's
chunks) and decode rate (its full batch at 1,024 positions each); each CPU pool's admission capacity
starts from the decode rate at its own batch until it has measured its own steps, and a Q-Ring pool
splits pipeline prefills across peers by the prefill rate until it has measured its own.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from weaved.backends.base import Backend
from weaved.calibration.measure import measure
from weaved.calibration.store import Calibration, CalibrationStore, calibration_key
from weaved.config.profile import Profile
from weaved.daemon.pools import Pool

CONTEXT = 2048  # the longest context measured (a step's time is linear in it beyond)


@dataclass(frozen=True)
class Rates:
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    source: str  # "calibrated" | "profile"
    calibration: Calibration | None = None

    def to_dict(self) -> dict:
        out = {"prefill_tokens_per_s": round(self.prefill_tokens_per_s, 1),
               "decode_tokens_per_s": round(self.decode_tokens_per_s, 1), "source": self.source}
        c = self.calibration
        if c is not None:
            out.update(measured_at=c.measured_at, age_s=round(time.time() - c.measured_at, 1), key=c.key,
                       fit_error=round(c.fit_error, 4), step_cost=c.cost.to_dict())
        return out


FIT_LIMIT = 0.35  # a calibration whose fit misses a measured step by more was measured on a busy host
MEASURES = 3  # measurements tried before a poor fit is used (for this run only)


def calibration_of(backend: Backend, fingerprint: str, chunk: int, batch: int, store: CalibrationStore,
                   say: Callable[[str], None], force: bool = False) -> Calibration:
    """The stored calibration of ``backend`` for this model and host, or one measured now (``force``:
    always measured) with prefill chunks up to ``chunk`` and decode batches up to ``batch``."""
    from weaved.kernels.matmul import kernel_path

    chunk = min(chunk, backend.config.context_length)  # (no prompt is longer: nothing past it to measure)
    kernels = kernel_path() if backend.name == "cpu" else getattr(backend, "kernels", backend.name)
    threads = int(getattr(backend, "threads", 0) or 0)
    device = str(getattr(backend, "device", "cpu"))
    if not force:
        found = store.load(calibration_key(fingerprint, backend.name, device, threads, kernels))
        if found is not None:
            measured = _largest_measured(found)
            if measured[0] >= chunk and measured[1] >= batch:
                return found
            say(f"the stored calibration measured prefill chunks up to {measured[0]} tokens and decode batches "
                f"up to {measured[1]}; measuring again for this profile's {chunk} and {batch}")
    say(f"calibrating the {backend.name} backend ({threads} threads, {kernels} kernels): prefill chunks up to "
        f"{chunk} tokens, decode batches up to {batch}")

    def progress(i: int, n: int, what: str) -> None:
        say(f"calibrating: {i}/{n} {what}")

    m = measure(backend, chunk=chunk, max_batch=batch, context=CONTEXT, progress=progress)
    for attempt in range(1, MEASURES):  # a poor fit: the host was busy (other work took the cores) - again
        if m.max_error() <= FIT_LIMIT:
            break
        say(f"the step times did not fit the model (off by up to {m.max_error():.0%}: something else was using "
            f"the cores?); measuring again ({attempt + 1} of {MEASURES})")
        again = measure(backend, chunk=chunk, max_batch=batch, context=CONTEXT, progress=progress)
        m = again if again.max_error() < m.max_error() else m
    cal = Calibration(m.cost, fingerprint, backend.name, device, threads, kernels, seconds=m.seconds,
                      fit_error=m.max_error(), points=tuple(p.to_dict() for p in m.points))
    if m.max_error() > FIT_LIMIT:  # used for this run only: the next start measures again
        say(f"warning: the calibration's fit is poor (off by up to {m.max_error():.0%}); its rates serve this run "
            f"but are not stored - 'weave calibrate' on a quiet host measures them again")
        return cal
    store.save(cal)
    say(f"calibrated in {m.seconds:.1f} s (the fit is within {m.max_error():.0%} of every measured step)")
    return cal


def _largest_measured(cal: Calibration) -> tuple[int, int]:
    """(largest prefill chunk, largest decode batch) among a calibration's measured points: a pool's rates
    at a larger batch or chunk would be extrapolated from the fit, not measured."""
    chunk = max((int(p["tokens"]) for p in cal.points if p.get("kind") == "prefill"), default=0)
    batch = max((int(p["batch"]) for p in cal.points if p.get("kind") == "decode"), default=0)
    return chunk, batch


def apply_rates(profile: Profile, pools: dict[str, Pool], fingerprint: str, store: CalibrationStore,
                say: Callable[[str], None]) -> tuple[Profile, Rates | None]:
    """The profile with the routing rates in use, and where they come from (None: no CPU pool)."""
    cpu = [p for p in pools.values() if p.config.backend == "cpu" and p.config.strategy == "standard"]
    if not cpu:
        return profile, None
    th = profile.routing
    if th.cpu_prefill_tokens_per_s is not None and th.cpu_decode_tokens_per_s is not None:
        rates = Rates(th.cpu_prefill_tokens_per_s, th.cpu_decode_tokens_per_s, "profile")
    else:
        cal = calibration_of(cpu[0].backend, fingerprint, max(p.config.prefill_chunk for p in cpu),
                             max(p.config.max_batch for p in cpu), store, say)
        prefill, decode = cal.rates(cpu[0].config.prefill_chunk, cpu[0].config.max_batch)
        rates = Rates(th.cpu_prefill_tokens_per_s or prefill, th.cpu_decode_tokens_per_s or decode,
                      "calibrated", cal)
        profile = dataclasses.replace(profile, routing=dataclasses.replace(
            th, cpu_prefill_tokens_per_s=rates.prefill_tokens_per_s, cpu_decode_tokens_per_s=rates.decode_tokens_per_s))
        for p in cpu:  # each pool's admission starts from the decode rate at its own batch
            p.use_step_model(cal.cost, th.step_target_s)  # turns predicted and steps sized by it
            cap = p.engine.capacity
            if cap is not None:
                cap.prior_tps = cal.cost.decode_tokens_per_s(p.config.max_batch)
                cap.prefill_cost = cap.prior_tps / cal.cost.prefill_tokens_per_s(p.config.prefill_chunk)
    for p in pools.values():  # a Q-Ring pool splits pipeline prefills by this node's speed until it measures it
        if p.config.strategy == "qring" and hasattr(p.backend, "default_speed"):
            p.backend.default_speed = rates.prefill_tokens_per_s
    return profile, rates
