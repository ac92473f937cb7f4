"""Sequences, sampling and the batch engine."""
