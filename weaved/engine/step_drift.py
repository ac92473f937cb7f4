"""How far a pool's steps run from its step-time model, so that the model's decisions follow the host.

A pool's step model (``calibration.cost.StepCost``) is calibrated once per model and host and stored.
A host can be slower than when it was measured - a VM moved to busier hardware, other work on the
cores, a slow memory phase - and then every step the scheduler sizes to the interactive gap overruns
it, and admission accepts interactive turns whose gap it cannot keep.  So the engine compares each
step's measured time with the model's prediction for what the step held and keeps the ratio's moving
geometric mean (``factor``); the scheduler and admission use the model scaled by it.  A factor of 1
leaves the model as calibrated; one ratio moves it by at most ``WEIGHT`` of its logarithm, and it stays
within [``LOW``, ``HIGH``].
"""

from __future__ import annotations

import math

from weaved.calibration.cost import StepCost

WEIGHT = 0.05  # each step's share of the mean (of the log ratio): about the last twenty steps
LOW, HIGH = 0.25, 4.0
MIN_PREDICTED_S = 1e-3  # steps predicted shorter are mostly the engine's own overhead: not counted


class StepDrift:
    """The ratio of measured to predicted step times, averaged; read from any thread."""

    def __init__(self) -> None:
        self.factor = 1.0
        self.samples = 0

    def reset(self) -> None:
        """Measure anew (the model it was measured against has been replaced)."""
        self.factor, self.samples = 1.0, 0

    def record(self, predicted_s: float, took_s: float) -> None:
        if not predicted_s >= MIN_PREDICTED_S or not took_s > 0:
            return
        ratio = min(HIGH, max(LOW, took_s / predicted_s))
        log = math.log(self.factor) * (1 - WEIGHT) + math.log(ratio) * WEIGHT
        self.factor = min(HIGH, max(LOW, math.exp(log)))
        self.samples += 1

    def scaled(self, cost: StepCost) -> StepCost:
        """``cost`` as this host runs it now."""
        return cost if self.factor == 1.0 else cost.scaled(self.factor)

