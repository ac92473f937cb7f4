"""What a sequence may sample next: the engine's view of constrained decoding.

The engine knows nothing of grammars; it asks a sequence's ``TokenConstraint`` for the allowed tokens
before each sampled token and tells it the token sampled after.  The mask is applied to that
sequence's own row of logits in its own sampler, so a constrained sequence in a batch changes nothing
for the others.  ``weaved.agent.grammar`` implements it with a grammar engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np


class ConstraintError(RuntimeError):
    """The constraint cannot go on (no token allowed, or a token it refused was forced on it)."""


class TokenConstraint(ABC):
    """The tokens one sequence may produce, token by token.

    Contract: before each sampled token the engine calls ``allowed()``; after it, ``accept(token)``
    with the token sampled from the masked row.  ``allowed`` returns a boolean array as wide as the
    logits row (True: may be sampled) or None when nothing is constrained at this point; it is never
    all False while ``error`` is None.  ``accept`` raises ConstraintError for a token the mask did not
    allow.  ``valid_prefix(tokens)`` says how many of ``tokens``, in order, the constraint would accept
    from its current state without changing that state (speculative drafts are cut there).
    ``prefetch()`` may start the next mask early; ``allowed()`` then returns that mask (an ``accept``
    in between makes it stale, and it is computed again).
    """

    @abstractmethod
    def allowed(self) -> np.ndarray | None: ...

    @abstractmethod
    def accept(self, token: int) -> None: ...

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        return len(tokens)

    def prefetch(self) -> None:
        """Start computing the next ``allowed()`` now, in the background (the engine calls it just before
        the forward whose logits it will mask, so the mask overlaps the model's step).  Optional: by
        default the mask is computed when ``allowed()`` is called."""
        return None

    @property
    def error(self) -> str | None:
        """Why the constraint cannot go on, or None."""
        return None
