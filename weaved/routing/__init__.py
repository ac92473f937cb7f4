"""The router: placing a session (``tree``), the policies it is compared with (``baselines``), and the
types both speak (``types``)."""
