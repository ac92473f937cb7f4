"""OpenAI-compatible routes: ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``.

The daemon serves one model: a request may name it (or ``default``); any other name is OpenAI's 404
``model_not_found``.  Every answer carries the served model's name.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from weaved.api import body
from weaved.api.chat import answer_chat
from weaved.api.completions import answer_completion
from weaved.api.models import ChatRequest, CompletionRequest
from weaved.api.params import check_model, session_from
from weaved.api.state import state_of

router = APIRouter()


def _model(request: Request) -> dict:
    d = state_of(request).daemon
    # the model's own context, and what a request without a session of its own gets (a stateless request,
    # a Responses chain, a session created without max_context): the profile's default capped by the model's
    default = min(d.profile.host.default_context, d.config.context_length)
    return {"id": d.model_name, "object": "model", "created": int(getattr(d, "started", 0)), "owned_by": "weave",
            "context_length": d.config.context_length, "default_context": default}


@router.get("/v1/models")
async def list_models(request: Request) -> dict:
    return {"object": "list", "data": [_model(request)]}


@router.get("/v1/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> dict:
    check_model(state_of(request), model_id)  # the served name or its alias, as requests may name it
    return _model(request)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    req = await body.read(request, ChatRequest)
    return await answer_chat(request, req, session_from(req, request.headers))


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await answer_completion(request, await body.read(request, CompletionRequest))
