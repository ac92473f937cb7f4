"""The ``weave`` command line. Client commands speak to the daemon through its socket only."""
