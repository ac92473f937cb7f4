"""Control-plane apps of stand-in daemons, each served by uvicorn on its own loopback port in a thread.

``serve_app`` yields the server's base URL and stops it (joined, bounded) on exit; ``kill`` stops one
early, which is what a peer process dying looks like from outside: its port refuses connections.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn

from weaved.federation.control import create_federation_app

WAIT_S = 30.0
FINGERPRINT = "f00dfeedf00dfeed"  # the local node's model in these tests
N_LAYERS = 30


def report(node: str, fingerprint: str = FINGERPRINT, free_tokens: int = 1000, instance: str | None = None) -> dict:
    """A node report as ``weaved.federation.node_report`` shapes it (``instance``: the daemon's id;
    by default one per node name)."""
    return {
        "version": 1, "node": node, "instance": instance or f"instance-of-{node}",
        "model": {"name": "SmolLM2-135M-Instruct-Q4_0", "arch": "llama", "fingerprint": fingerprint,
                  "n_layers": N_LAYERS, "kv_bytes_per_token": 92160, "context_length": 8192},
        "hardware": {"physical_cores": 2, "logical_cpus": 2, "memory_bytes": 8 << 30, "cpu_model": "test",
                     "gpus": []},
        "kv": {"cap_bytes": free_tokens * 92160, "reserved_bytes": 0, "free_bytes": free_tokens * 92160,
               "free_tokens": free_tokens},
        "load": {"pools": [{"name": "cpu", "strategy": "standard", "device_kind": "cpu", "batch_depth": 1,
                            "queue_depth": 2, "max_batch": 16}], "sessions": 3},
    }


@dataclass
class Running:
    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def kill(self) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive(), "the control-plane server did not stop"


@contextmanager
def serve_app(app) -> Iterator[Running]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="off", access_log=False, log_config=None, log_level="warning",
                            timeout_graceful_shutdown=1)
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)  # what uvicorn's own serve() sets up (lifespan off)
    started = threading.Event()

    def run() -> None:
        async def main() -> None:
            await server.startup(sockets=[sock])
            started.set()
            while not server.should_exit:
                await asyncio.sleep(0.02)
            await server.shutdown(sockets=[sock])

        try:
            asyncio.run(main())
        finally:
            started.set()
            sock.close()

    thread = threading.Thread(target=run, name=f"control-{port}", daemon=True)
    thread.start()
    assert started.wait(WAIT_S), "the control-plane server did not start"
    running = Running(f"http://127.0.0.1:{port}", server, thread)
    try:
        yield running
    finally:
        if thread.is_alive():
            running.kill()


@contextmanager
def peer_node(node: str, token: str, fingerprint: str = FINGERPRINT, instance: str | None = None
              ) -> Iterator[Running]:
    """A stand-in daemon's control plane answering with a fixed report."""
    app = create_federation_app(lambda: report(node, fingerprint, instance=instance), token, node)
    with serve_app(app) as running:
        yield running
