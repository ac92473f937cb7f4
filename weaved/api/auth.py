"""The TCP listener's guard: every request needs ``Authorization: Bearer <API key>``.

The Unix socket needs no key (its file mode, 0600, admits only the daemon's user), so this wraps
only the app served on TCP.
"""

from __future__ import annotations

import hmac
import secrets

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from weaved.http_errors import error_body


class BearerAuth:
    def __init__(self, app: ASGIApp, api_key: str):
        if not api_key:
            raise ValueError("an API key must not be empty")
        self.app = app
        self._key = api_key.encode()

    def _allowed(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and not self._allowed(scope):
            body = error_body(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                              code="invalid_api_key")
            # (answered before the app, whose middleware gives every other answer its id)
            headers = {"WWW-Authenticate": "Bearer", "x-request-id": f"req_{secrets.token_hex(12)}"}
            await JSONResponse(body, status_code=401, headers=headers)(scope, receive, send)
            return
        await self.app(scope, receive, send)
