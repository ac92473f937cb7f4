"""``POST /v1/responses/input_tokens``: how many input tokens a ``/v1/responses`` request would give the
model - its ``usage.input_tokens`` - without running it or storing anything.

It takes the fields of a response request that shape the prompt (input, instructions, tools and tool
choice, text format, the chain it continues, template arguments) and renders them as that request's turn
would: through the chat template with the tools, after the continued chain's context (as a continuation
rewinds or branches to it).  Fields that only shape the generation (``stream``, ``max_output_tokens``,
sampling, ``store``, Weave's ``sla``) are refused by name, as OpenAI refuses them here.
"""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from weaved.agent.tool_results import RESPONSES_WORDS, check_tool_results
from weaved.api import body
from weaved.api.params import check_model
from weaved.api.responses import continued_chain
from weaved.api.responses_models import ResponsesRequest
from weaved.api.state import state_of
from weaved.errors import InvalidRequest

router = APIRouter()

# fields of a response request that do not change its input: not fields of a count
GENERATION_FIELDS = ("stream", "stream_options", "store", "max_output_tokens", "temperature", "top_p", "seed",
                     "sla", "include")


class InputTokensRequest(ResponsesRequest):
    def unsupported(self) -> tuple[str, str] | None:
        for name in GENERATION_FIELDS:
            if name in self.model_fields_set:
                return name, (f"{name} is not a field of an input token count: it shapes a response's generation, "
                              f"not its input (POST /v1/responses takes it)")
        return super().unsupported()


@router.post("/v1/responses/input_tokens")
async def count_input_tokens(request: Request) -> dict:
    req = await body.read(request, InputTokensRequest)
    state = state_of(request)
    check_model(state, req.model)
    bad = req.unsupported()
    if bad is not None:
        raise InvalidRequest(bad[1], param=bad[0])
    messages = req.messages()
    if req.previous_response_id is not None:
        await continued_chain(state, req.previous_response_id, messages)
    else:
        check_tool_results(messages, set(), RESPONSES_WORDS)
    count = partial(state.daemon.count_input, messages, req.answer(), req.instructions,
                    after=req.previous_response_id)
    return {"object": "response.input_tokens", "input_tokens": await run_in_threadpool(count)}
