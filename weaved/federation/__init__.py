"""Peers and distributed strategies (pipeline prefill, Q-Ring decode)."""
