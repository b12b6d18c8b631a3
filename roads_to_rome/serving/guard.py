"""What never reaches a handler, and what a request may cost before it queues: too many requests at once, a
missing API key, foreign Host/Origin on a loopback server, non-JSON posts, bodies too large or too slow to arrive,
and too many long prompts to tokenize at once. Each refusal is an OpenAI-style error."""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import ipaddress
import multiprocessing
import time
import urllib.parse
from collections.abc import Callable

from fastapi.responses import JSONResponse, Response

from roads_to_rome.core.chat_template import serve_templates
from roads_to_rome.errors import R2RError
from roads_to_rome.serving.errors import APIError, error_response, shaped
from roads_to_rome.serving.limits import Limits

UNCAPPED = ("/health",)  # answered under any load: a supervisor's probe must not read a full server as dead
KEYED = ("/v1/", "/metrics", "/tokenize", "/detokenize")
SHORT_PROMPT_CHARS = 16384  # a prompt this short tokenizes in milliseconds: a lane of its own, never refused


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_api_key(api_key: str | None) -> None:
    """An empty key would let the header `Bearer ` alone through: a mistake, said at start."""
    if api_key is not None and not api_key.strip():
        raise R2RError("--api-key (or $R2R_API_KEY) is empty: give a key, or leave it out on a loopback --host")


class Guard:
    """ASGI middleware: the cap on requests in the server, API key, loopback-only Host/Origin, JSON-only posts, and
    the body's size and time limits. Whether a request carried the key is left in `request.state.key_ok` (`/health`
    says more to those that do).

    A web page the user visits can send a "simple" cross-origin POST (text/plain, no preflight) to a
    server on localhost, or reach it through DNS rebinding under a foreign Host name: refusing foreign
    Host and Origin headers and non-JSON bodies closes both."""

    def __init__(self, app, api_key: str | None, loopback_only: bool, limits: Limits):
        self.app, self.api_key, self.loopback_only, self.limits = app, api_key, loopback_only, limits
        self.in_flight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        capped = scope["path"] not in UNCAPPED
        if capped and self.in_flight >= self.limits.max_connections:
            refusal = error_response(429, f"the server is handling {self.in_flight} requests, its limit "
                                          "(--max-connections); retry later", code="too_many_connections",
                                     kind="rate_limit_error")
            return await shaped(scope["path"], refusal)(scope, receive, send)
        self.in_flight += capped
        try:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            scope.setdefault("state", {})["key_ok"] = self.key_ok(headers)
            refusal = self.refusal(scope, headers)
            if refusal is None and scope["method"] == "POST":
                body, refusal = await self.read_body(receive, headers)
                if refusal is None:
                    receive = replay(body, receive)
            if refusal is not None:
                return await shaped(scope["path"], refusal)(scope, receive, send)
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= capped

    def key_ok(self, headers: dict) -> bool:
        if self.api_key is None:
            return True
        sent = headers.get("authorization", "")
        if "x-api-key" in headers:  # Anthropic's clients send the key so
            return hmac.compare_digest(headers["x-api-key"].encode(), self.api_key.encode())
        return hmac.compare_digest(sent.encode(), f"Bearer {self.api_key}".encode())

    def refusal(self, scope, headers: dict) -> JSONResponse | None:
        if self.loopback_only:
            host = urllib.parse.urlsplit("//" + headers.get("host", "")).hostname
            if not is_loopback(host):
                return error_response(403, f"this server answers only requests addressed to localhost, not to "
                                           f"{headers.get('host')!r} (start it with --host to serve other names)",
                                      code="forbidden_host")
            origin = headers.get("origin")
            if origin is not None and not is_loopback(urllib.parse.urlsplit(origin).hostname):
                return error_response(403, f"requests from web pages at {origin} are refused: this server answers "
                                           "only its own playground on localhost", code="forbidden_origin")
        if scope["path"].startswith(KEYED) and not scope["state"]["key_ok"]:
            return error_response(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY' (or "
                                       "'x-api-key: KEY') with the key the server was started with (--api-key)",
                                  code="invalid_api_key")
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return error_response(415, f"the request body must be JSON sent with content-type: "
                                           f"application/json, not {kind or 'no content type'!r}",
                                      code="unsupported_media_type")
        return None

    async def read_body(self, receive, headers: dict) -> tuple[bytes, Response | None]:
        limit = self.limits.max_body_bytes
        too_large = error_response(413, f"the request body is over this server's limit of {limit} bytes",
                                   code="request_too_large")
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            return b"", too_large
        chunks, size = [], 0
        deadline = time.monotonic() + self.limits.max_body_seconds
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return b"", error_response(408, f"the request body did not arrive within "
                                                f"{self.limits.max_body_seconds:g} s (--max-body-seconds)",
                                           code="request_timeout", headers={"Connection": "close"})
            if message["type"] == "http.disconnect":
                return b"", Response(status_code=499)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return b"", too_large
            if not message.get("more_body"):
                return b"".join(chunks), None


def replay(body: bytes, receive):
    """A receive channel that gives the body already read, then whatever the client sends next (a disconnect)."""
    sent = False

    async def receive_again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_again




class Tokenizing:
    """Prompts are tokenized, and request bodies read (serving/bodies.py), off the event loop, short ones and long
    ones in lanes of their own; at most `max_tokenizing` long ones wait or run at once, and the next gets 429 before
    anything else is spent on it."""

    def __init__(self, limit: int):
        self.limit, self.long_ones = limit, 0
        # One thread per lane: a tokenizer is not safe to reconfigure from several threads at once.
        self.short = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="r2r-tokenize")
        self.long = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="r2r-tokenize-long")

    async def __call__(self, chars: int, encode, *args) -> list[int]:
        return await self.run(chars > SHORT_PROMPT_CHARS, encode, *args)

    async def run(self, long: bool, work, *args):
        """`work(*args)` in the long lane or the short one."""
        loop = asyncio.get_running_loop()
        if not long:
            return await loop.run_in_executor(self.short, work, *args)
        if self.long_ones >= self.limit:
            raise APIError(429, f"the server is reading {self.long_ones} long prompts or large bodies, its limit "
                                "(--max-tokenizing); retry later", code="tokenizer_busy", kind="rate_limit_error")
        self.long_ones += 1
        try:
            return await loop.run_in_executor(self.long, work, *args)
        finally:
            self.long_ones -= 1

    def shutdown(self) -> None:
        self.short.shutdown(wait=False, cancel_futures=True)
        self.long.shutdown(wait=False, cancel_futures=True)


class Compiling:
    """Structured outputs are compiled off the event loop, in a lane of their own (a large schema takes seconds, and
    must hold up neither streams nor prompts being tokenized), once per request, each within `seconds` (then a 400
    naming the field; the compile goes on in its lane, bounded by llguidance's own limits, and at most `limit`
    compiles wait or run at once: 429 beyond). `prepare()` runs in the lane once, before the first compile, and
    counts against no request's time: what every compile needs (the tokenizer as the compiler reads it, seconds for
    a 150k vocabulary), which would otherwise make the first request's schema late."""

    def __init__(self, seconds: float, limit: int, prepare: Callable[[], object] = lambda: None):
        self.seconds, self.limit, self.in_lane = seconds, limit, 0
        self.lane = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="r2r-compile")
        self.prepare, self.prepared = prepare, None

    async def __call__(self, field: str, what: str, compile_, *args):
        """`compile_(*args)` in the lane; its errors as 400s naming `field`, after `what` (what the field holds)."""
        if self.in_lane >= self.limit:
            raise APIError(429, f"the server is compiling {self.in_lane} structured outputs, its limit "
                                "(--max-tokenizing); retry later", code="compiler_busy", kind="rate_limit_error")
        self.in_lane += 1
        loop, future = asyncio.get_running_loop(), None
        try:
            if self.prepared is None:
                self.prepared = loop.run_in_executor(self.lane, self.prepare)
            await asyncio.shield(self.prepared)  # (outside the limit)
            future = loop.run_in_executor(self.lane, compile_, *args)
            future.add_done_callback(self._left)  # (its place is kept until it ends, late or not)
            return await asyncio.wait_for(asyncio.shield(future), self.seconds)
        except asyncio.TimeoutError:
            raise APIError(400, f"{what}: the structured output was not compiled within {self.seconds:g} s, this "
                                "server's limit (--max-compile-seconds): make it smaller or simpler", param=field,
                           code="format_too_complex") from None
        except R2RError as e:
            raise APIError(400, f"{what}: {e}", param=field) from None
        finally:
            if future is None:  # (the preparation failed, or the client left while it ran)
                self.in_lane -= 1

    def _left(self, _) -> None:
        self.in_lane -= 1

    def shutdown(self) -> None:
        self.lane.shutdown(wait=False, cancel_futures=True)


# How long the template process may take to start (a spawned Python importing the tokenizer's library: seconds on a
# busy machine) before a request that needs it gets a 503.
TEMPLATE_START_SECONDS = 60.0


class TemplateLane:
    """Chat templates that requests bring (--trust-request-chat-template) write their chats in a process of their own,
    one at a time, within `seconds` and `memory_bytes` (`core.chat_template.serve_templates`): a template that
    loops for long or builds a large text holds up neither the event loop nor the lanes that write chats in the
    server's own template. Past its time the process is killed (the next such request starts another, in a second or
    two); at most `limit` requests wait or run at once (429 beyond)."""

    def __init__(self, tokenizer, seconds: float, memory_bytes: int, limit: int):
        self.tokenizer, self.seconds, self.memory_bytes, self.limit = tokenizer, seconds, memory_bytes, limit
        self.in_lane, self.process, self.connection = 0, None, None
        self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="r2r-template")

    async def __call__(self, *job) -> list[int]:
        """`encode_messages`' arguments after the tokenizer: the prompt's token ids, or a 400 naming chat_template."""
        if self.in_lane >= self.limit:
            raise APIError(429, f"the server is writing {self.in_lane} chats in templates requests brought, its limit "
                                "(--max-tokenizing); retry later", code="template_busy", kind="rate_limit_error")
        self.in_lane += 1
        try:
            status, value = await asyncio.get_running_loop().run_in_executor(self.thread, self._write, job)
        finally:
            self.in_lane -= 1
        if status == "unavailable":
            raise APIError(503, value, code="template_unavailable", kind="server_error")
        if status != "ok":
            raise APIError(400, value, param="chat_template")
        return value

    def _write(self, job: tuple) -> tuple[str, object]:
        if (self.process is None or not self.process.is_alive()) and not self._start():
            return "unavailable", (f"the process that writes chats in requests' templates did not start within "
                                   f"{TEMPLATE_START_SECONDS:g} s; retry")
        self.connection.send(job)
        if self.connection.poll(self.seconds):
            try:
                return self.connection.recv()
            except EOFError:  # (killed: by the kernel, out of memory)
                self._stop()
                return "error", "the chat template's process ended while it wrote these messages"
        self._stop()
        return "error", (f"the chat template did not write these messages within {self.seconds:g} s, this server's "
                         "limit: loop less in it")

    def _start(self) -> bool:
        context = multiprocessing.get_context("spawn")  # (not a fork of a process with threads and a model)
        self.connection, theirs = context.Pipe()
        self.process = context.Process(target=serve_templates, args=(theirs, self.tokenizer, self.memory_bytes),
                                       name="r2r-templates", daemon=True)
        self.process.start()
        theirs.close()
        # Its start (importing, the tokenizer) is not the template's time: the job is sent once it says it is ready.
        try:
            if self.connection.poll(TEMPLATE_START_SECONDS) and self.connection.recv()[0] == "ready":
                return True
        except EOFError:  # (it died starting)
            pass
        self._stop()
        return False

    def _stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join(5)
        self.process = self.connection = None

    def shutdown(self) -> None:
        self.thread.shutdown(wait=False, cancel_futures=True)
        self._stop()
