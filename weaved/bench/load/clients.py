"""The load's clients: each loops until the run's end, one request at a time, and records every outcome."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass

import httpx
import openai

from weaved.bench.load import SLAS, WHOLE_INTERACTIVE_S, LoadOptions

CLASSES = ("interactive", "interactive", "background", "batch")  # client i: CLASSES[i % 4]
TIMEOUT_S = 360.0  # a client gives up on one request after this: past the longest SLA budget (batch, 300 s)
TOPICS = ("the sea", "a lighthouse", "bread", "rain on a tin roof", "trains", "an old map", "bees", "snow")


@dataclass
class Outcome:
    cls: str
    via: str  # "sdk" | "httpx"
    stream: bool
    status: str  # "ok", "503", "cancelled" (by the client, on purpose), or "error <status or exception>"
    start: float  # seconds since the run began
    ttft_s: float | None = None
    latency_s: float | None = None
    tokens: int = 0

    @property
    def within_sla(self) -> bool:
        sla = SLAS[self.cls]
        if self.status != "ok":
            return False
        if "ttft_ms" in sla and self.stream:
            return self.ttft_s is not None and self.ttft_s * 1000 <= sla["ttft_ms"]
        limit = sla.get("ttlt_s", WHOLE_INTERACTIVE_S)
        return self.latency_s is not None and self.latency_s <= limit


class Client:
    def __init__(self, i: int, opts: LoadOptions, http: httpx.AsyncClient, sdk: openai.AsyncOpenAI, model: str,
                 t0: float):
        self.i, self.opts, self.http, self.sdk, self.model, self.t0 = i, opts, http, sdk, model, t0
        self.cls = CLASSES[i % 4]
        self.via = "sdk" if i % 2 == 0 else "httpx"
        self.sessions = i % 4 == 3  # works in sessions it creates, uses and deletes
        self.rng = random.Random(opts.seed * 1000 + i)
        self.outcomes: list[Outcome] = []

    async def run(self, end: float) -> None:
        session, turns = None, 0
        while time.monotonic() < end:
            if self.sessions and session is None:
                r = await self.http.post("/v1/sessions", json={"sla": SLAS[self.cls]})
                if r.status_code != 200:
                    self._record(Outcome(self.cls, "httpx", False, self._status(r.status_code), self._now()))
                    await self._back_off(r, end)
                    continue
                session, turns = r.json()["id"], 0
            out = await self._request(session)
            self.outcomes.append(out)
            turns += 1
            if out.status == "503":
                await asyncio.sleep(min(5.0, max(0.0, end - time.monotonic())))
            if session is not None and (turns >= 3 or out.status.startswith("error")):
                await self.http.delete(f"/v1/sessions/{session}")  # rotated: a fresh one next
                session = None
        if session is not None:
            with contextlib.suppress(httpx.HTTPError):
                await self.http.delete(f"/v1/sessions/{session}")

    def _now(self) -> float:
        return time.monotonic() - self.t0

    def _record(self, out: Outcome) -> None:
        self.outcomes.append(out)

    @staticmethod
    def _status(code: int) -> str:
        return "ok" if code == 200 else "503" if code == 503 else f"error {code}"

    async def _back_off(self, r: httpx.Response, end: float) -> None:
        wait = float(r.headers.get("retry-after", "1")) if r.status_code == 503 else 1.0
        await asyncio.sleep(min(wait, 5.0, max(0.0, end - time.monotonic())))

    def _body(self, session: str | None) -> dict:
        topic = self.rng.choice(TOPICS)
        body = {"messages": [{"role": "user", "content": f"Write a few lines about {topic}."}],
                "max_tokens": self.opts.max_tokens, "temperature": 0.7, "sla": SLAS[self.cls]}
        if session is not None:
            body["session"] = session
        return body

    async def _request(self, session: str | None) -> Outcome:
        stream = self.rng.random() < 2 / 3
        cancel_after = 3 if stream and self.rng.random() < 0.1 else None
        out = Outcome(self.cls, self.via, stream, "ok", self._now())
        t = time.monotonic()
        try:
            if self.via == "sdk":
                await self._sdk(self._body(session), stream, cancel_after, out, t)
            else:
                await self._httpx(self._body(session), stream, cancel_after, out, t)
        except openai.APIStatusError as e:
            out.status = self._status(e.status_code)
        except (openai.APIError, httpx.HTTPError, ValueError) as e:
            out.status = f"error {type(e).__name__}"
        out.latency_s = time.monotonic() - t
        return out

    async def _sdk(self, body: dict, stream: bool, cancel_after: int | None, out: Outcome, t: float) -> None:
        extra = {k: body[k] for k in ("sla", "session") if k in body}
        kw = {"model": self.model, "messages": body["messages"], "max_tokens": body["max_tokens"],
              "temperature": body["temperature"], "extra_body": extra}
        if not stream:
            r = await self.sdk.chat.completions.create(**kw)
            out.tokens = r.usage.completion_tokens if r.usage else 0
            return
        chunks = await self.sdk.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
        n = 0
        async for c in chunks:
            if c.choices and c.choices[0].delta.content:
                out.ttft_s = out.ttft_s if out.ttft_s is not None else time.monotonic() - t
                n += 1
                if cancel_after is not None and n >= cancel_after:
                    await chunks.close()
                    out.status, out.tokens = "cancelled", n
                    return
            if c.usage is not None:
                out.tokens = c.usage.completion_tokens

    async def _httpx(self, body: dict, stream: bool, cancel_after: int | None, out: Outcome, t: float) -> None:
        if not stream:
            r = await self.http.post("/v1/chat/completions", json=body)
            out.status = self._status(r.status_code)
            if r.status_code == 200:
                out.tokens = r.json()["usage"]["completion_tokens"]
            return
        n, usage = 0, None
        # (the usage chunk counts the tokens: a token whose text is held back, half a character, has no chunk)
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with self.http.stream("POST", "/v1/chat/completions", json=streamed) as r:
            out.status = self._status(r.status_code)
            if r.status_code != 200:
                await r.aread()
                return
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.status = "error in stream"
                    return
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    out.ttft_s = out.ttft_s if out.ttft_s is not None else time.monotonic() - t
                    n += 1
                    if cancel_after is not None and n >= cancel_after:
                        out.status, out.tokens = "cancelled", n
                        return  # leaving the block closes the connection: the daemon cancels the turn
            out.tokens = n if usage is None else usage
            if not done:
                out.status = "error stream ended without [DONE]"
