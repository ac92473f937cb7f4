"""The step-time model: how long one engine step takes on a backend, from what the step holds.

A step reads every weight once whatever it holds (a fixed part), does the dense layers' work per token,
and attends each token over its sequence's context.  Prefill chunks and decode batches run different
kernels (a chunk's products are matrix-matrix, a batch's few rows nearly matrix-vector; a chunk's
attention is tiled, a decode row's is not), so each has its own three numbers:

    seconds = base + per_token * tokens + per_token_context * (sum over tokens of their context)

for a prefill chunk of n tokens after c positions (token-context n * (c + n / 2)) and a decode batch
(token-context: the sum of its sequences' contexts).  A mixed step pays one fixed part, the larger.
``measure.py`` fits the numbers to timed steps; the rates the router and the scheduler use (prefill
tokens/s at a pool's chunk, decode tokens/s at its batch) follow from them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


def chunk_token_context(n: int, context: float) -> float:
    """The (token, key) pairs a chunk of ``n`` prompt tokens after ``context`` positions attends: each
    token its predecessors and itself, about ``n * (context + n / 2)``."""
    return n * (context + n / 2)


@dataclass(frozen=True)
class Linear:
    base: float  # seconds per step
    per_token: float  # seconds per token of the step
    per_token_context: float  # seconds per (token, key) pair attended

    def variable_s(self, tokens: int, token_context: float) -> float:
        return self.per_token * tokens + self.per_token_context * token_context

    def s(self, tokens: int, token_context: float) -> float:
        return self.base + self.variable_s(tokens, token_context)

    def to_list(self) -> list[float]:
        return [self.base, self.per_token, self.per_token_context]

    @classmethod
    def from_list(cls, v: list) -> Linear:
        c = cls(*(float(x) for x in v))
        if not all(math.isfinite(x) and x >= 0 for x in c.to_list()):
            raise ValueError(f"a step-time model needs finite, non-negative numbers, got {v}")
        return c


@dataclass(frozen=True)
class StepCost:
    prefill: Linear  # a step of one prefill chunk
    decode: Linear  # a step of a decode batch

    def step_s(self, prefill_tokens: int = 0, prefill_token_context: float = 0.0, decode_batch: int = 0,
               decode_context: float = 0.0) -> float:
        """A step with a prefill part and/or a decode part (``decode_context``: the batch's summed context)."""
        base = max(self.prefill.base if prefill_tokens else 0.0, self.decode.base if decode_batch else 0.0)
        return (base + self.prefill.variable_s(prefill_tokens, prefill_token_context)
                + self.decode.variable_s(decode_batch, decode_context))

    def chunks_step_s(self, prefill: Iterable[tuple[int, int]], decode_contexts: Iterable[int]) -> float:
        """A step of prefill chunks (``(tokens, context before them)`` each) and decode rows (each one's
        sequence's context)."""
        n_prefill, prefill_tc = 0, 0.0
        for n, c in prefill:
            n_prefill += n
            prefill_tc += chunk_token_context(n, c)
        contexts = list(decode_contexts)
        return self.step_s(n_prefill, prefill_tc, len(contexts), float(sum(contexts)))

    def prefill_chunk_s(self, n: int, context: int) -> float:
        """One chunk of ``n`` prompt tokens after ``context`` positions."""
        return self.prefill.s(n, chunk_token_context(n, context))

    def prefill_s(self, tokens: int, chunk: int, context: int = 0) -> float:
        """A prompt of ``tokens`` fed in chunks of ``chunk`` after ``context`` positions."""
        total, done = 0.0, 0
        while done < tokens:
            n = min(chunk, tokens - done)
            total += self.prefill_chunk_s(n, context + done)
            done += n
        return total

    def decode_step_s(self, batch: int, context_each: int) -> float:
        return self.decode.s(batch, batch * context_each)

    def prefill_tokens_per_s(self, chunk: int, prompt: int = 1024) -> float:
        """The rate of a ``prompt``-token prefill in chunks of ``chunk`` from position 0."""
        return prompt / self.prefill_s(prompt, chunk)

    def decode_tokens_per_s(self, batch: int, context_each: int = 1024) -> float:
        """Aggregate decode rate of ``batch`` sequences of ``context_each`` positions."""
        return batch / self.decode_step_s(batch, context_each)

    def scaled(self, factor: float) -> StepCost:
        """Every step ``factor`` times as long (a host slower or faster than when this was measured)."""
        return StepCost(Linear(*(x * factor for x in self.prefill.to_list())),
                        Linear(*(x * factor for x in self.decode.to_list())))

    def to_dict(self) -> dict:
        return {"prefill": self.prefill.to_list(), "decode": self.decode.to_list()}

    @classmethod
    def from_dict(cls, d: dict) -> StepCost:
        cost = cls(Linear.from_list(d["prefill"]), Linear.from_list(d["decode"]))
        for name, part in (("prefill", cost.prefill), ("decode", cost.decode)):
            if not any(x > 0 for x in part.to_list()):  # (a step of no time: every rate would be infinite)
                raise ValueError(f"a step-time model's {name} part needs a positive number, got {d[name]}")
        return cost
