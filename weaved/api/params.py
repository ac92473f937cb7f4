"""From a validated request to what the daemon takes: sampling parameters, SLA tags, the session.

Weave's extensions come as top-level body fields (``sla``, ``session``) or as headers
(``X-Weave-Session``, ``X-Weave-SLA-Class``, ``X-Weave-TTFT-Ms``, ``X-Weave-TTLT-S``); a body field
wins over the header of the same meaning.
"""

from __future__ import annotations

import math
import re

from starlette.datastructures import Headers

from weaved.api.models import ChatRequest, CompletionRequest, Sampling, SLABody
from weaved.engine.sampling import SamplingParams
from weaved.errors import InvalidRequest, ModelNotFound
from weaved.routing.types import SLA, SLAClass

# Without max_tokens a chat turn may write up to the session's context (the daemon cuts this bound to
# what fits); a completion writes OpenAI's default of 16.
FIT_CONTEXT_MAX_TOKENS = 2**31 - 1
DEFAULT_COMPLETION_MAX_TOKENS = 16
# What a request that names no sampling field gets: llama.cpp server's defaults.  Small quantized
# models sampled at temperature 1 with no truncation ramble into noise within a few sentences.
SAMPLING_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}

SESSION_HEADER = "x-weave-session"
SLA_HEADERS = {"cls": "x-weave-sla-class", "ttft_ms": "x-weave-ttft-ms", "ttlt_s": "x-weave-ttlt-s"}


def check_model(state, model: str | None) -> None:
    """A request may name the served model or ``default`` (or none); any other name is OpenAI's 404
    ``model_not_found``."""
    served = state.daemon.model_name
    if model is not None and model not in (served, "default"):
        raise ModelNotFound(f"the model {model!r} does not exist; this daemon serves {served!r}")


def check_vocab(tokenizer, params: SamplingParams) -> None:
    """Token ids a request names (``logit_bias``, ``stop_token_ids``) must be in the vocabulary."""
    vocab = getattr(tokenizer, "vocab_size", None)
    if vocab is None:
        return
    for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise InvalidRequest(f"{name} names token {bad[0]}, outside the vocabulary (0..{vocab - 1})", param=name)


def check_supported(req: Sampling) -> None:
    bad = req.unsupported()
    if bad is not None:
        raise InvalidRequest(bad[1], param=bad[0])


def sampling_refusal(e: ValueError, limit_field: str) -> InvalidRequest:
    """A ``SamplingParams`` refusal in the request's own words: the field it names as ``param``, and the
    answer's limit by the name the request gave it (``max_completion_tokens``, ``max_output_tokens``)."""
    msg = str(e)
    m = re.match(r"[a-z_]+", msg)
    param = m.group(0) if m else None
    if param == "max_tokens":
        param = limit_field
    return InvalidRequest(msg.replace("max_tokens", limit_field), param=param)


def _sampling(req: Sampling, max_tokens: int, logprobs: int | None, *, fit_context: bool = False,
              limit_field: str = "max_tokens") -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    kw = dict(SAMPLING_DEFAULTS)
    kw.update({k: getattr(req, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed",
                                                 "ignore_eos", "frequency_penalty", "presence_penalty", "min_tokens")
               if getattr(req, k) is not None})
    if req.seed == -1:  # llama.cpp's "no seed" (LLAMA_DEFAULT_SEED): a fresh random one, as there
        kw.pop("seed")
    elif req.seed is not None and req.seed < 0:  # a negative int64 as its two's complement: its own stream
        kw["seed"] = req.seed % 2**64
    if req.logit_bias:
        kw["logit_bias"] = tuple((int(k), float(v)) for k, v in req.logit_bias.items())
    if req.stop_token_ids:
        kw["stop_token_ids"] = tuple(req.stop_token_ids)
    try:
        return SamplingParams(max_tokens=max_tokens, stop=tuple(stop), logprobs=logprobs, fit_context=fit_context,
                              **kw)
    except ValueError as e:
        raise sampling_refusal(e, limit_field) from None


def chat_params(req: ChatRequest) -> SamplingParams:
    check_supported(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise InvalidRequest("max_tokens and max_completion_tokens disagree; send one", param="max_tokens")
    limit = req.max_completion_tokens or req.max_tokens
    # without a limit a chat turn may write up to the session's context (the daemon cuts it to what fits)
    return _sampling(req, limit or FIT_CONTEXT_MAX_TOKENS, (req.top_logprobs or 0) if req.logprobs else None,
                     fit_context=limit is None,
                     limit_field="max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")


def completion_params(req: CompletionRequest) -> SamplingParams:
    check_supported(req)
    limit = DEFAULT_COMPLETION_MAX_TOKENS if req.max_tokens is None else req.max_tokens  # (0: the prompt alone)
    return _sampling(req, limit, req.logprobs)


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


def sla_from(body: SLABody | None, headers: Headers, base: SLA | None = None) -> SLA | None:
    """The request's SLA tags (body first, then headers), or None when it gives none.  The tags it leaves
    out are ``base``'s (a session's own, for a turn or a fork of that session; else an interactive class
    with no targets): a turn that names only a TTFT keeps the session's class and TTLT budget."""
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
    base = base or SLA(SLAClass.INTERACTIVE)
    try:
        return SLA(SLAClass(cls) if cls is not None else base.cls, base.ttft_ms if ttft is None else ttft,
                   base.ttlt_s if ttlt is None else ttlt)
    except ValueError as e:
        raise InvalidRequest(str(e), param="sla") from None


def session_from(req: Sampling, headers: Headers) -> str | None:
    if req.session is not None:
        return req.session
    raw = headers.get(SESSION_HEADER)
    if raw is not None and not raw.strip():
        raise InvalidRequest(f"header {SESSION_HEADER} is empty", param=SESSION_HEADER)
    return raw.strip() if raw is not None else None
