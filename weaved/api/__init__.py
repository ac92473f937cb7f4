"""HTTP API on the daemon's Unix socket."""
