"""Do two backends compute the same function?  Teacher-forced decode over the same token ids."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from weaved.backends.base import Backend, Logits, SeqChunk

KL_BAR = 0.0005  # the backend contract's bar for a backend that cannot promise bit-identity
NEAR_TIE = 0.3  # a greedy disagreement is a near-tie when the reference's two logits are this close


def kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """KL(p || q) of the softmaxes of two float32 logit rows, in float64."""
    p = np.exp(p_logits.astype(np.float64) - p_logits.max())
    p /= p.sum()
    q = np.exp(q_logits.astype(np.float64) - q_logits.max())
    q /= q.sum()
    return float(np.sum(p * (np.log(p + 1e-300) - np.log(q + 1e-300))))


@dataclass
class StepResult:
    step: int
    bit_equal: bool
    kl: float
    greedy_equal: bool
    near_tie: bool  # greedy differs, but the reference's logits of the two tokens are within NEAR_TIE


@dataclass
class Agreement:
    steps: list[StepResult] = field(default_factory=list)

    @property
    def bit_equal(self) -> bool:
        return all(s.bit_equal for s in self.steps)

    @property
    def mean_kl(self) -> float:
        return float(np.mean([s.kl for s in self.steps])) if self.steps else 0.0

    @property
    def passed(self) -> bool:
        """Bit-equal, or within the contract's KL with greedy equal except at near-ties."""
        if self.bit_equal:
            return True
        return self.mean_kl <= KL_BAR and all(s.greedy_equal or s.near_tie for s in self.steps)

    def to_dict(self) -> dict:
        return {"passed": self.passed, "bit_equal": self.bit_equal, "mean_kl": self.mean_kl,
                "max_kl": max((s.kl for s in self.steps), default=0.0),
                "greedy_disagreements": sum(1 for s in self.steps if not s.greedy_equal),
                "near_ties": sum(1 for s in self.steps if s.near_tie), "steps": len(self.steps)}


def compare_step(step: int, ref: np.ndarray, got: np.ndarray) -> StepResult:
    """One logits row of the reference backend against the other's."""
    a, b = int(np.argmax(ref)), int(np.argmax(got))
    return StepResult(step, bool(np.array_equal(ref, got)), kl(ref, got), a == b,
                      a != b and float(ref[a] - ref[b]) < NEAR_TIE)


def teacher_forced(ref: Backend, other: Backend, prompt: list[int], steps: int, capacity: int,
                   report=lambda r: None) -> Agreement:
    """Prefill ``prompt`` on both, then ``steps`` decode steps each feeding the reference's greedy token
    to both (so one disagreement does not make every later step differ): every logits row compared."""
    out = Agreement()
    kv_r, kv_o = ref.new_kv(capacity), other.new_kv(capacity)
    ids = np.asarray(prompt, np.int32)
    r = ref.forward([SeqChunk(kv_r, ids, Logits.LAST)])[0][-1]
    o = other.forward([SeqChunk(kv_o, ids, Logits.LAST)])[0][-1]
    for i in range(steps + 1):
        res = compare_step(i, r, o)
        out.steps.append(res)
        report(res)
        if i == steps:
            break
        tok = np.asarray([int(np.argmax(r))], np.int32)
        r = ref.forward([SeqChunk(kv_r, tok, Logits.LAST)])[0][-1]
        o = other.forward([SeqChunk(kv_o, tok, Logits.LAST)])[0][-1]
    return out
