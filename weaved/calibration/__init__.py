"""Calibration: the step-time model of a backend on this host, measured, stored, and used by the router
and the scheduler instead of rates written into a profile by hand.

``cost.py`` is the model (seconds of one engine step from what it holds), ``measure.py`` measures it on
a backend in seconds, ``store.py`` keeps the result in the data directory keyed by the model's
fingerprint, the host, the backend, its threads and its kernel path.
"""
