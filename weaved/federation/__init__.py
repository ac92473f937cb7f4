"""Peers and distributed strategies: the gloo data plane (``comm``), Q-Ring decode (``qring``) and
pipeline-parallel prefill (``pipeline``).  See docs/federation.md."""
