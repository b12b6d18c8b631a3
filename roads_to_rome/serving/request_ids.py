"""Each HTTP request's id, for finding what the server logged about it: the client's `X-Request-Id` where it gives a
usable one (a proxy's or a tracer's), else a fresh one; sent back in the reply's `X-Request-Id` header (as vLLM's
`--enable-request-id-headers` does; here always), and named by every log line and error message that concerns the
request ("the server's log has the details under request ...")."""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar

HEADER = b"x-request-id"
USABLE = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")  # what a log line and a header can carry as it is

# The request being handled: set for the task that handles it, so that code deep in a handler (queueing its
# sequences, an error handler) names it without being handed it.
current: ContextVar[str] = ContextVar("request_id", default="")


class RequestIds:
    """ASGI middleware, outside every other, so that a refusal carries the id too."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == HEADER), "")
        request_id = given if USABLE.fullmatch(given) else uuid.uuid4().hex
        current.set(request_id)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (HEADER, request_id.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def details(request_id: str | None = None) -> str:
    """Where a client is told to look for what went wrong (by default: the request being handled)."""
    return f"the server's log has the details under request {request_id or current.get() or '(none)'}"
