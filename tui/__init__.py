"""``weave top``: a textual view of a running daemon."""
