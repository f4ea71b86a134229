"""A request body's size and arrival time, bounded: 413 past ``max_bytes``, 408 when it stalls.

A pure ASGI middleware, so it sees the body as it arrives (a declared Content-Length is refused
before a byte is read; a chunked body is counted). uvicorn has no timeout on a body that stops
short of its Content-Length: without one, a client can hold a connection and its task forever.
"""
from __future__ import annotations

import asyncio
import json

from fastapi import HTTPException


class BodyGuard:
    def __init__(self, app, max_bytes: int, read_timeout_s: float):
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s

    def _too_large(self, size: str) -> str:
        return (f"the request body is {size} bytes; this server takes at most {self.max_bytes} "
                f"(a generate request is a small JSON object)")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:  # (a malformed one is the HTTP parser's to refuse)
            body = json.dumps(dict(detail=self._too_large(declared.decode()))).encode()
            await send(dict(type="http.response.start", status=413, headers=[
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"connection", b"close")]))
            await send(dict(type="http.response.body", body=body))
            return

        received, done = 0, False

        async def guarded_receive():
            nonlocal received, done
            if done:  # the body is in: what follows is the disconnect, which may come at any time
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the request body stopped arriving: nothing for {self.read_timeout_s:g} s "
                                         f"after {received} bytes (is Content-Length larger than the body?)") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise HTTPException(413, self._too_large(f"more than {self.max_bytes}"))
                done = not message.get("more_body", False)
            else:
                done = True
            return message

        await self.app(scope, guarded_receive, send)


def default_max_body_bytes(config) -> int:
    """1 MiB, plus room for a t2i model's caption features as JSON text (at most 32 characters a number)."""
    captions = 0 if config.model_type == "c2i" else config.cls_token_num * config.caption_dim * 32
    return (1 << 20) + captions
