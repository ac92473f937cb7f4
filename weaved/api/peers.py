"""The federation's peers as the local operator sees them: list, add and remove (``weave peers``).

These routes live on the Weave API (the Unix socket, or the TCP listener behind its API key), never
on the control plane peers talk to: only this node's operator changes whom it federates with.
``/v1/status`` lists the same peers under ``"peers"``.
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from weaved.api import body
from weaved.api.state import state_of
from weaved.errors import NotFound

router = APIRouter(prefix="/v1/peers")


class PeerCreate(BaseModel):
    """``POST /v1/peers``: a peer daemon's control-plane address and the shared token it expects."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    url: str = Field(min_length=1, max_length=2048)
    token: str = Field(min_length=1, max_length=4096)


def _registry(request: Request):
    peers = getattr(state_of(request).daemon, "peers", None)
    if peers is None:
        raise NotFound("this daemon keeps no peer list (it has not finished loading)")
    return peers


@router.get("")
async def list_peers(request: Request) -> dict:
    return {"object": "list", "data": await run_in_threadpool(_registry(request).list)}


@router.post("")
async def add_peer(request: Request) -> dict:
    req = await body.read(request, PeerCreate)
    return await run_in_threadpool(_registry(request).add, req.name, req.url, req.token)


@router.get("/{name}")
async def get_peer(request: Request, name: str) -> dict:
    return await run_in_threadpool(_registry(request).get, name)


@router.delete("/{name}")
async def delete_peer(request: Request, name: str) -> dict:
    await run_in_threadpool(_registry(request).remove, name)
    return {"name": name, "object": "peer.deleted", "deleted": True}
