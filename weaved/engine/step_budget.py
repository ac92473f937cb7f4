"""The tokens a step may hold while an interactive turn decodes, from the pool's step-time model.

A step's time is that turn's inter-token gap, so the prefill chunks other turns feed in it are cut to
what keeps the step within the target: the step's decode rows (every decoding sequence, one token each,
at its context) take their predicted time first, and the prefill tokens get what is left - the largest
n with ``per_token * n + per_token_context * n * (c + n / 2)`` within it (``calibration.cost``: a chunk
of n tokens after c positions), c the longest context a waiting prompt has reached.  When the decode
rows alone already fill the target, no prefill runs until the interactive turn ends.
"""

from __future__ import annotations

import math

from weaved.calibration.cost import StepCost
from weaved.engine.sequence import Sequence


def interactive_step_tokens(cost: StepCost, target_s: float, active: list[Sequence], max_batch: int) -> int:
    """Tokens (decode rows plus prefill tokens) of a step predicted to take at most ``target_s``."""
    live = [s for s in active if not s.status.done and s.pending]
    decodes = [s for s in live if not s.prefilling][:max_batch]
    prompts = [s for s in live if s.prefilling]
    rows = len(decodes)
    left = target_s - (cost.decode.s(rows, sum(s.kv.length for s in decodes)) if rows else 0.0)
    left -= max(0.0, cost.prefill.base - cost.decode.base)  # a mixed step pays the larger fixed part once
    if left <= 0 or not prompts:
        return max(1, rows)
    c = max(s.kv.length for s in prompts)
    a = cost.prefill.per_token_context / 2  # seconds per n^2
    b = cost.prefill.per_token + cost.prefill.per_token_context * c  # seconds per n
    if a > 0:
        n = (-b + math.sqrt(b * b + 4 * a * left)) / (2 * a)
    else:
        n = left / b if b > 0 else float(2**31)
    return max(1, rows + int(min(n, 2**31)))
