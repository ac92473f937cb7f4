"""The tokens a step may hold while an interactive turn is live, from the pool's step-time model.

A step's time is that turn's inter-token gap (or, while its prompt is fed, part of its time to first
token), so the step is cut to what the model predicts within the target: decode rows first, in the
order the scheduler takes them (each one token at its sequence's context), while they fit; then
prompt tokens get what is left - the largest n with ``per_token * n + per_token_context * n * (c + n
/ 2)`` within it (``calibration.cost``: a chunk of n tokens after c positions), c the longest context
a waiting prompt has reached.  Decode rows past the target wait for a later step (pausing costs
nothing: their KV stays where it is); ``schedule`` never cuts below the rows that must run - the
interactive turns' and the throughput-tolerant turns already due - nor an interactive prompt's chunk,
but for a prompt longer than a chunk beside other interactive turns, which shares the target with them
(``scheduler._sharing``).
"""

from __future__ import annotations

import math

from weaved.calibration.cost import StepCost


def interactive_step_tokens(cost: StepCost, target_s: float, decode_contexts: list[int],
                            prompt_context: int | None) -> int:
    """Tokens of a step predicted to take at most ``target_s``: decode rows (``decode_contexts``: their
    sequences' positions, in the scheduler's order) while they fit, then prompt tokens after
    ``prompt_context`` positions (None: no prompt waits)."""
    rows, ctx = 0, 0
    for c in decode_contexts:
        if cost.decode.s(rows + 1, ctx + c) > target_s:
            break
        rows, ctx = rows + 1, ctx + c
    if rows < len(decode_contexts) or prompt_context is None:  # the rows fill the step: no prompt beside them
        return max(1, rows)
    left = target_s - (cost.decode.s(rows, ctx) if rows else 0.0)
    left -= max(0.0, cost.prefill.base - cost.decode.base) if rows else cost.prefill.base
    if left <= 0:
        return max(1, rows)
    a = cost.prefill.per_token_context / 2  # seconds per n^2
    b = cost.prefill.per_token + cost.prefill.per_token_context * prompt_context  # seconds per n
    if a > 0:
        n = (-b + math.sqrt(b * b + 4 * a * left)) / (2 * a)
    else:
        n = left / b if b > 0 else float(2**31)
    return max(1, rows + int(min(n, 2**31)))
