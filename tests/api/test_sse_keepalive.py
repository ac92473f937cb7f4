"""A stream that says nothing for a while sends keep-alive comments, in order between its frames, and
closing it closes what it streams."""

from __future__ import annotations

import asyncio

import pytest

from weaved.api.sse import KEEPALIVE, with_keepalives


def test_a_silent_stream_sends_keep_alives_between_its_frames():
    async def run() -> list[bytes]:
        go = asyncio.Event()

        async def frames():
            yield b"a"
            await go.wait()  # silent until the reader has seen a keep-alive
            yield b"b"

        out = []
        async for chunk in with_keepalives(frames(), every=0.01):
            out.append(chunk)
            if chunk == KEEPALIVE:
                go.set()
        return out

    out = asyncio.run(run())
    assert out[0] == b"a" and out[-1] == b"b" and out[1:-1] and set(out[1:-1]) == {KEEPALIVE}


def test_closing_the_stream_closes_what_it_streams_and_errors_pass_through():
    async def run() -> list[str]:
        seen: list[str] = []

        async def frames():
            try:
                yield b"a"
                await asyncio.Event().wait()  # never: the client goes while it waits
            finally:
                seen.append("closed")

        stream = with_keepalives(frames(), every=0.01)
        assert await anext(stream) == b"a"
        assert await anext(stream) == KEEPALIVE
        await stream.aclose()

        async def failing():
            yield b"x"
            raise ValueError("the engine failed")

        with pytest.raises(ValueError, match="engine failed"):
            async for _ in with_keepalives(failing(), every=1.0):
                pass
        return seen

    assert asyncio.run(run()) == ["closed"]
