"""From a validated request to what the daemon takes: sampling parameters, SLA tags, the session.

Weave's extensions come as top-level body fields (``sla``, ``session``) or as headers
(``X-Weave-Session``, ``X-Weave-SLA-Class``, ``X-Weave-TTFT-Ms``, ``X-Weave-TTLT-S``); a body field
wins over the header of the same meaning.
"""

from __future__ import annotations

import math

from starlette.datastructures import Headers

from weaved.api.models import ChatRequest, CompletionRequest, Sampling, SLABody
from weaved.engine.sampling import SamplingParams
from weaved.errors import InvalidRequest
from weaved.routing.types import SLA, SLAClass

# Without max_tokens a chat turn may write this many tokens (a completion: OpenAI's default of 16).
DEFAULT_CHAT_MAX_TOKENS = 512
DEFAULT_COMPLETION_MAX_TOKENS = 16
# What a request that names no sampling field gets: llama.cpp server's defaults.  Small quantized
# models sampled at temperature 1 with no truncation ramble into noise within a few sentences.
SAMPLING_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}

SESSION_HEADER = "x-weave-session"
SLA_HEADERS = {"cls": "x-weave-sla-class", "ttft_ms": "x-weave-ttft-ms", "ttlt_s": "x-weave-ttlt-s"}


def check_supported(req: Sampling) -> None:
    bad = req.unsupported()
    if bad is not None:
        raise InvalidRequest(bad[1], param=bad[0])


def _sampling(req: Sampling, max_tokens: int, logprobs: int | None) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    kw = dict(SAMPLING_DEFAULTS)
    kw.update({k: getattr(req, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                                                 "ignore_eos")
               if getattr(req, k) is not None})
    try:
        return SamplingParams(max_tokens=max_tokens, stop=tuple(stop), logprobs=logprobs, **kw)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None


def chat_params(req: ChatRequest) -> SamplingParams:
    check_supported(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise InvalidRequest("max_tokens and max_completion_tokens disagree; send one", param="max_tokens")
    limit = req.max_completion_tokens or req.max_tokens or DEFAULT_CHAT_MAX_TOKENS
    return _sampling(req, limit, (req.top_logprobs or 0) if req.logprobs else None)


def completion_params(req: CompletionRequest) -> SamplingParams:
    check_supported(req)
    return _sampling(req, req.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, req.logprobs)


def _header_number(headers: Headers, name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        v = float(raw)
    except ValueError:
        raise InvalidRequest(f"header {name} must be a number, got {raw!r}", param=name) from None
    if not (math.isfinite(v) and v > 0):
        raise InvalidRequest(f"header {name} must be a positive number, got {raw!r}", param=name)
    return v


def sla_from(body: SLABody | None, headers: Headers, default_class: str = SLAClass.INTERACTIVE) -> SLA | None:
    """The request's SLA tags (body first, then headers), or None when it gives none.  Tags without a
    class take ``default_class`` (a session's own class, for a turn of that session)."""
    cls = body.cls if body is not None else None
    ttft = body.ttft_ms if body is not None else None
    ttlt = body.ttlt_s if body is not None else None
    if cls is None and (raw := headers.get(SLA_HEADERS["cls"])) is not None:
        names = [c.value for c in SLAClass]
        if raw not in names:
            raise InvalidRequest(f"header {SLA_HEADERS['cls']} must be one of {names}, got {raw!r}",
                                 param=SLA_HEADERS["cls"])
        cls = raw
    if ttft is None:
        ttft = _header_number(headers, SLA_HEADERS["ttft_ms"])
    if ttlt is None:
        ttlt = _header_number(headers, SLA_HEADERS["ttlt_s"])
    if body is None and cls is None and ttft is None and ttlt is None:
        return None
    try:
        return SLA(SLAClass(cls or default_class), ttft, ttlt)
    except ValueError as e:
        raise InvalidRequest(str(e), param="sla") from None


def session_from(req: Sampling, headers: Headers) -> str | None:
    if req.session is not None:
        return req.session
    raw = headers.get(SESSION_HEADER)
    if raw is not None and not raw.strip():
        raise InvalidRequest(f"header {SESSION_HEADER} is empty", param=SESSION_HEADER)
    return raw.strip() if raw is not None else None
