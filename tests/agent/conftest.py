"""The shared engine-run fixtures: SmolLM2 on the CPU backend (kernels compiled once) and its tokenizer."""

from tests.engine_run import smol, tokenizer  # noqa: F401  (fixtures)
