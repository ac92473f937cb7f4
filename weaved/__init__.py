"""Weave: a serving daemon that chooses an execution strategy per session.

Subpackages: ``model`` (GGUF loading, conversion, tokenizer), ``kv`` (KV cache layout and store),
``backends`` (the forward-pass contract and its CPU / torch implementations), ``engine`` (sequences,
sampling, batch engine), ``kernels`` (numba CPU kernels; imports nothing from ``weaved``), ``cli`` and
``tui`` (front ends that talk to the daemon through its socket only).
"""

__version__ = "0.1.0"
