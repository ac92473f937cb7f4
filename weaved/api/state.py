"""What every route reaches through ``request.app.state.weave``: the daemon, the metrics, the closing flag."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from weaved.metrics import Metrics


@dataclass
class ApiState:
    daemon: Any  # weaved.daemon.core.Daemon, or anything with its interface
    metrics: Metrics = field(default_factory=Metrics)
    # Set when the server begins to shut down: endless streams (/v1/events) end, new turns get 503.
    closing: asyncio.Event = field(default_factory=asyncio.Event)
    # Stored responses still being generated, by id (``/v1/responses/{id}`` shows them in_progress).
    running_responses: dict[str, Any] = field(default_factory=dict)


def state_of(request: Request) -> ApiState:
    return request.app.state.weave
