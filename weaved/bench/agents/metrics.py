"""SLA accounting and latency percentiles over a run's ``TurnRecord``s.

Each turn is MET, MISSED or UNFINISHED against its class's target:
- background, batch: MET when the turn ended within its ``ttlt_s`` of being submitted;
- interactive: MET when its first token came within ``ttft_ms`` and the 99th percentile of its
  inter-token gaps is within ``itl_p99_ms``.
A turn the daemon failed or refused is MISSED.  A turn still running when the run ends is MISSED if its
deadline had already passed by then (its outcome is known: late), and UNFINISHED otherwise - left out
of the shares, and counted separately, since the run cannot tell whether it would have made it.  An
interactive turn whose first token was on time but whose answer was still streaming is UNFINISHED
(its inter-token p99 is not known yet).

Shares are met / (met + missed).  A class with no judged turn has no share; it does not fail the
"every class meets its SLA" test, and the report marks it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from weaved.bench.agents.records import SLA_CLASSES, TurnRecord, TurnStatus
from weaved.bench.agents.workload import AgentWorkload


class Outcome(StrEnum):
    MET = "met"
    MISSED = "missed"
    UNFINISHED = "unfinished"


@dataclass(frozen=True)
class SLATargets:
    background_ttlt_s: float = 60.0
    batch_ttlt_s: float = 300.0
    interactive_ttft_s: float = 0.5
    interactive_itl_p99_s: float = 0.1
    share: float = 0.95  # "meets its SLA" for a class: at least this share of its judged turns met

    @classmethod
    def from_workload(cls, w: AgentWorkload) -> SLATargets:
        return cls(w.background_ttlt_s, w.batch_ttlt_s, w.interactive_ttft_ms / 1000.0,
                   w.interactive_itl_p99_ms / 1000.0, w.sla_share)

    def ttlt_s(self, sla_class: str) -> float:
        return self.batch_ttlt_s if sla_class == "batch" else self.background_ttlt_s


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default method); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def outcome(rec: TurnRecord, targets: SLATargets, t_end: float) -> Outcome:
    """``rec``'s outcome when the run was closed at ``t_end`` (seconds from the start)."""
    if rec.status in (TurnStatus.FAILED, TurnStatus.REJECTED):
        return Outcome.MISSED
    if rec.sla_class == "interactive":
        ttft = rec.ttft_s
        if ttft is None:
            late = t_end - rec.submitted > targets.interactive_ttft_s
            return Outcome.MISSED if late else Outcome.UNFINISHED
        if ttft > targets.interactive_ttft_s:
            return Outcome.MISSED
        if rec.status is TurnStatus.RUNNING:
            return Outcome.UNFINISHED
        p99 = percentile(rec.gaps_s, 99) or 0.0
        return Outcome.MET if p99 <= targets.interactive_itl_p99_s else Outcome.MISSED
    budget = targets.ttlt_s(rec.sla_class)
    if rec.status is TurnStatus.RUNNING:
        if t_end - rec.submitted > budget:
            return Outcome.MISSED
        # a turn that at its pace so far cannot end within its budget has missed it already: a run shorter
        # than the batch budget would otherwise never see one miss, however far behind the batch fell
        if rec.generated >= 2 and rec.first_token is not None:
            pace = (t_end - rec.first_token) / rec.generated
            if t_end + (rec.max_tokens - rec.generated) * pace - rec.submitted > budget:
                return Outcome.MISSED
        return Outcome.UNFINISHED
    ttlt = rec.ttlt_s
    return Outcome.MET if ttlt is not None and ttlt <= budget else Outcome.MISSED


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 2)


def class_summary(recs: list[TurnRecord], targets: SLATargets, t_end: float) -> dict:
    outs = [outcome(r, targets, t_end) for r in recs]
    met = outs.count(Outcome.MET)
    missed = outs.count(Outcome.MISSED)
    ttfts = [r.ttft_s for r in recs if r.ttft_s is not None]
    gaps = [g for r in recs for g in r.gaps_s]
    judged = met + missed
    return {
        "turns": len(recs), "met": met, "missed": missed, "unfinished": outs.count(Outcome.UNFINISHED),
        "failed": sum(1 for r in recs if r.status is TurnStatus.FAILED),
        "rejected": sum(1 for r in recs if r.status is TurnStatus.REJECTED),
        "share_met": round(met / judged, 4) if judged else None,
        "ttft_p50_ms": _ms(percentile(ttfts, 50)), "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "itl_p50_ms": _ms(percentile(gaps, 50)), "itl_p99_ms": _ms(percentile(gaps, 99)),
        "tokens_generated": sum(r.generated for r in recs),
    }


def summarize(records: Iterable[TurnRecord], targets: SLATargets, t_end: float) -> dict:
    """Per-class SLA shares and latencies, aggregate tokens/s over ``t_end`` seconds, and whether
    every class met its SLA (``meets_sla``)."""
    recs = list(records)
    classes = {c: class_summary([r for r in recs if r.sla_class == c], targets, t_end) for c in SLA_CLASSES}
    total = sum(c["tokens_generated"] for c in classes.values())
    waits = [r.waited_s for r in recs if r.sla_class == "interactive"]
    return {
        "classes": classes,
        "turns": len(recs),
        "tokens_generated": total,
        "tokens_per_s": round(total / t_end, 2) if t_end > 0 else None,
        "compactions": sum(1 for r in recs if r.compacted),
        "checkin_wait_p50_s": _r(percentile(waits, 50)), "checkin_wait_p99_s": _r(percentile(waits, 99)),
        "meets_sla": meets_sla(classes, targets.share),
        "limiting_class": limiting_class(classes),
    }


def meets_sla(classes: dict[str, dict], share: float) -> bool:
    """At least ``share`` of the judged turns of every class met their SLA (classes without a judged
    turn do not count against it)."""
    return all(c["share_met"] is None or c["share_met"] >= share for c in classes.values())


def limiting_class(classes: dict[str, dict]) -> str | None:
    """The class with the lowest share of turns met (None when no class has a judged turn)."""
    judged = [(c["share_met"], name) for name, c in classes.items() if c["share_met"] is not None]
    return min(judged)[1] if judged else None


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 3)
