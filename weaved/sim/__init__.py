"""The capacity simulator: the daemon's own router, admission, scheduler and engines, run on a virtual
clock over backends that compute nothing and take the time a cost model says.

``hardware.py`` describes hosts (devices for a roofline, CPUs relative to this one), ``cost.py`` turns
a host and a model shape into step-time models (``weaved.calibration.cost.StepCost``): this host's
calibrated CPU scaled to the shape and the host, a roofline for a GPU; ``backend.py`` is the backend
that advances the clock by them; ``clock.py`` the clock.
"""
