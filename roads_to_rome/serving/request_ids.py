"""Each HTTP request's id, for finding what the server logged about it: the client's `X-Request-Id` where it gives a
usable one (a proxy's or a tracer's), else the body's `request_id` (vLLM's field, on chat and completions), else a
fresh one; sent back in the reply's `X-Request-Id` header (as vLLM's `--enable-request-id-headers` does; here
always), in the reply's own id (`chatcmpl-<id>`, `cmpl-<id>`, as vLLM's), and named by every log line and error
message that concerns the request ("the server's log has the details under request ...")."""

from __future__ import annotations

import re
import uuid
from contextvars import ContextVar
from dataclasses import dataclass

HEADER = b"x-request-id"
USABLE = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")  # what a log line and a header can carry as it is


@dataclass
class RequestId:
    value: str
    given: bool  # the client's own header: a body's `request_id` does not replace it (vLLM's order)


# The request being handled: set for the task that handles it, so that code deep in a handler (queueing its
# sequences, an error handler) names it without being handed it. A holder, not the id: a handler that learns the
# body's id (`name`) changes what the middleware then sends back.
current: ContextVar[RequestId | None] = ContextVar("request_id", default=None)


def get() -> str:
    """The id of the request being handled ("" outside one)."""
    held = current.get()
    return "" if held is None else held.value


def name(body_id: str | None) -> None:
    """The body's `request_id` names the request being handled, unless its client sent an X-Request-Id header."""
    held = current.get()
    if body_id is not None and held is not None and not held.given:
        held.value = body_id


class RequestIds:
    """ASGI middleware, outside every other, so that a refusal carries the id too."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == HEADER), "")
        held = RequestId(given, True) if USABLE.fullmatch(given) else RequestId(uuid.uuid4().hex, False)
        current.set(held)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (HEADER, held.value.encode())]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def details(request_id: str | None = None) -> str:
    """Where a client is told to look for what went wrong (by default: the request being handled)."""
    return f"the server's log has the details under request {request_id or get() or '(none)'}"
