"""An OpenAI-compatible HTTP server for R2R, with continuous batching and per-token provenance.

One engine thread (`EngineThread`) drives the engine's `Scheduler`, which owns the running batch; the HTTP handlers
(asyncio, module level, reading the server's state from `app.state.r2r`) submit requests to it
and receive each decode step through an asyncio queue. A request is checked in full before it
queues (body, sampling values, seed, context), so nothing a client sends can fail the batch. Its
prompt is then read in chunks between decode steps (chunked prefill), so the streams already
running keep going while a long prompt is read; it joins the batch once read and leaves when done
or when its client goes away. `Guard` refuses what should never reach a handler (oversized bodies,
non-JSON posts, foreign Host/Origin on a loopback server, a missing API key). Every error is an
OpenAI-style JSON body; internals go to the server's log, not to clients.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import hmac
import html
import importlib.resources
import ipaddress
import json
import logging
import threading
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import APIRouter, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from openai.types.completion_usage import CompletionTokensDetails
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException
from starlette.staticfiles import StaticFiles

from roads_to_rome.core.engine import Cancelled, Engine, Failure, Scheduler
from roads_to_rome.core.request import Request, Sequence, Step
from roads_to_rome.core.sampling import SamplingParams, parse_verify
from roads_to_rome.errors import LLMUnavailable, R2RError, RemoteError
from roads_to_rome.reasoning import ReasoningParser, parser_for, prompt_start, reason, resolve_parser
from roads_to_rome.serving.metrics import Metrics
from roads_to_rome.text import Detokenizer

log = logging.getLogger(__name__)


@dataclass
class Limits:
    max_batch: int = 8  # requests decoding (or having their prompt read) at once
    max_queue: int = 64  # requests waiting for a slot; beyond that: 429
    max_tokens: int = 4096  # the most new tokens one request may ask for
    context_length: int = 32768  # prompt + new tokens of one request
    # Prompt tokens read per model between two decode steps: large enough to read a prompt near the best rate,
    # small enough that running streams keep getting tokens while it is read (README, "Serving").
    prefill_chunk: int = 64
    max_body_bytes: int = 1 << 20  # a request body's limit (413 beyond): 8x what the longest context holds
    drain_timeout: float = 30.0  # seconds in-flight requests get to finish after a shutdown signal


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.kind, self.headers)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   kind: str = "invalid_request_error", headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


LLM_RETRY_AFTER_S = 5  # what a request refused while the LLM is away is told (Retry-After): the probe's pace
LLM_AWAY = "the LLM is unavailable at the moment; retry later (requests with r2r_policy 'slm' still run)"


def llm_away() -> APIError:
    """A request that needs a remote LLM which is away: 503, and when to try again."""
    return APIError(503, LLM_AWAY, code="llm_unavailable", kind="server_error",
                    headers={"Retry-After": str(LLM_RETRY_AFTER_S)})


# ---- request bodies (unknown fields are ignored, as OpenAI clients send many) -----------------

def utf8_text(text: str) -> str:
    """JSON can carry lone UTF-16 surrogates (\\ud800) that no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"is not valid Unicode text: it holds a lone surrogate ({text[e.start]!r}) at {e.start}") \
            from None
    return text


def verify_setting(value):
    try:
        return parse_verify(value)
    except R2RError as e:
        raise ValueError(str(e)) from None


Text = Annotated[str, AfterValidator(utf8_text)]
Number = Annotated[float, Field(allow_inf_nan=False)]
VerifySetting = Annotated[Number | str, AfterValidator(verify_setting)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class CommonBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    requested: str | None = Field(None, alias="model")  # the model id the client asks for
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: Number = Field(1.0, ge=0, le=2)  # OpenAI's range
    top_p: Number = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what a 64-bit generator takes
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    # R2R routing knobs (extra body fields)
    r2r_threshold: Number | None = None
    r2r_llm_rate: Number | None = Field(None, ge=0, le=1)
    r2r_policy: Literal["slm", "llm"] | None = None
    r2r_verify: VerifySetting | None = None  # off, strict or a tolerance in nats (default: the server's)
    r2r_max_unverified: int | None = Field(None, ge=1)


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: Text


class ChatBody(CommonBody):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionBody(CommonBody):
    prompt: Text | list[Text]


# ---- the engine thread ------------------------------------------------------------------------

@dataclass
class ErrorReply:
    """What a client sees of a request that could not go on: an engine failure while it was in flight, or the
    server shutting down."""

    message: str
    status: int = 500
    code: str | None = None


class Job:
    """A sequence and the asyncio queue its handler reads its `Step`s (or an `ErrorReply`) from."""

    def __init__(self, sequence: Sequence, loop: asyncio.AbstractEventLoop):
        self.sequence, self.loop, self.events = sequence, loop, asyncio.Queue()
        self.arrived = time.monotonic()
        self.first_token_at: float | None = None

    def send(self, event: Step | ErrorReply) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # its event loop has closed: nobody wants the tokens any more
            self.sequence.cancelled = True


class EngineThread:
    """Drives the engine's `Scheduler` in a thread of its own, a turn at a time while there is work, and hands each
    job its events. The queue's limit (429) and draining on shutdown (503) are the server's; admission, chunked
    prefill and decoding are the scheduler's."""

    def __init__(self, engine: Engine, limits: Limits):
        self.limits = limits
        self.scheduler = Scheduler(engine, limits.max_batch, limits.prefill_chunk)
        self.metrics = Metrics(engine, self.load)
        self.jobs: dict[int, Job] = {}  # id(sequence) -> its job, until the sequence leaves the scheduler
        self.wakeup = threading.Condition()
        self.stopping = False
        self.deadline: float | None = None  # set when draining: in-flight requests are cut at this time
        self.thread = threading.Thread(target=self._run, name="r2r-engine", daemon=True)

    def start(self):
        self.thread.start()

    def stop(self):
        with self.wakeup:
            self.stopping = True
            self.wakeup.notify()
        self.thread.join(timeout=10)

    def drain(self, seconds: float) -> None:
        """Stop admitting (503), fail what waits in the queue, give in-flight requests `seconds` to finish."""
        with self.wakeup:
            until = time.monotonic() + seconds
            self.deadline = until if self.deadline is None else min(self.deadline, until)
            self._deliver(self.scheduler.drop_waiting(ShuttingDown()))
            self.wakeup.notify()

    def submit(self, job: Job) -> None:
        with self.wakeup:
            if self.deadline is not None or self.stopping:
                self.metrics.refused()
                raise APIError(503, str(ShuttingDown()), kind="server_error", code="shutting_down")
            scheduler = self.scheduler
            # Waiting for a free slot (the engine thread admits between steps) is not queueing.
            free_slots = max(0, self.limits.max_batch - scheduler.admitted)
            if scheduler.load()["waiting"] >= self.limits.max_queue + free_slots:
                self.metrics.refused()
                raise APIError(429, "the server is busy: too many requests waiting; retry later",
                               code="queue_full", kind="rate_limit_error")
            self.jobs[id(job.sequence)] = job
            scheduler.add(job.sequence)
            self.metrics.admitted(job.sequence)
            self.wakeup.notify()

    def load(self) -> dict:
        return self.scheduler.load()

    def _run(self):
        while self._turn():
            pass

    def _turn(self) -> bool:
        """One turn of the scheduler once there is work; False when the server stops. (A function of its own, so
        that nothing of a finished request outlives its turn in a local variable.)"""
        with self.wakeup:
            while not self.stopping and self.scheduler.idle:
                self.wakeup.wait()
            if self.stopping:
                return False
            left = self.scheduler.admit()  # under the lock: `submit` adds to the same queue
        if self.deadline is not None and time.monotonic() >= self.deadline:
            left += self.scheduler.cut(ShuttingDown("the server is shutting down: this request was cut off at the "
                                                    "drain deadline"))
        events = left + self.scheduler.advance()
        with self.wakeup:
            self._deliver(events)
        return True

    def _deliver(self, events: list[Step | Failure]) -> None:
        for event in events:
            job = self.jobs.get(id(event.sequence))
            if isinstance(event, Failure):
                self.jobs.pop(id(event.sequence), None)
                self.metrics.failed(event.sequence, aborted=isinstance(event.error, Cancelled))
                if job is not None and not isinstance(event.error, Cancelled):
                    job.send(error_reply(event.error))
                continue
            if event.finished:
                self.jobs.pop(id(event.sequence), None)
            if job is not None:
                job.first_token_at = self.metrics.step(event, job.arrived, job.first_token_at)
                job.send(event)


class ShuttingDown(R2RError):
    def __init__(self, why: str = "the server is shutting down; retry on another server"):
        super().__init__(why)


def error_reply(e: Exception) -> ErrorReply:
    """What a client may see of an engine error: our own messages; other exceptions stay in the log."""
    if isinstance(e, ShuttingDown):
        return ErrorReply(str(e), 503)
    if isinstance(e, LLMUnavailable):
        log.error("remote LLM unavailable: %s", e)
        return ErrorReply(LLM_AWAY, 503, "llm_unavailable")
    if isinstance(e, RemoteError):  # its message names an address clients need not know
        log.error("remote model failure: %s", e)
        return ErrorReply("the LLM's server failed this request (the server's log has the details)", 502)
    if isinstance(e, R2RError):
        return ErrorReply(str(e))
    log.exception("engine failure", exc_info=e)
    return ErrorReply("internal error in the engine (the server's log has the details)")


# ---- what never reaches a handler ----------------------------------------------------------------

def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class Guard:
    """ASGI middleware: API key, loopback-only Host/Origin, JSON-only posts, and the body-size limit.

    A web page the user visits can send a "simple" cross-origin POST (text/plain, no preflight) to a
    server on localhost, or reach it through DNS rebinding under a foreign Host name: refusing foreign
    Host and Origin headers and non-JSON bodies closes both."""

    def __init__(self, app, api_key: str | None, loopback_only: bool, max_body_bytes: int):
        self.app, self.api_key, self.loopback_only, self.max_body_bytes = app, api_key, loopback_only, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        refusal = self.refusal(scope, headers)
        if refusal is None and scope["method"] == "POST":
            body, refusal = await self.read_body(receive, headers)
            if refusal is None:
                receive = replay(body, receive)
        if refusal is not None:
            return await refusal(scope, receive, send)
        await self.app(scope, receive, send)

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
        if self.api_key is not None and (scope["path"].startswith("/v1/") or scope["path"] == "/metrics"):
            sent = headers.get("authorization", "")
            if not hmac.compare_digest(sent.encode(), f"Bearer {self.api_key}".encode()):
                return error_response(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY' "
                                           "with the key the server was started with (--api-key)",
                                      code="invalid_api_key")
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return error_response(415, f"the request body must be JSON sent with content-type: "
                                           f"application/json, not {kind or 'no content type'!r}",
                                      code="unsupported_media_type")
        return None

    async def read_body(self, receive, headers: dict) -> tuple[bytes, JSONResponse | None]:
        too_large = error_response(413, f"the request body is over this server's limit of {self.max_body_bytes} "
                                        "bytes", code="request_too_large")
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            return b"", too_large
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", Response(status_code=499)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
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


# ---- the app ----------------------------------------------------------------------------------

@dataclass
class ServerState:
    engine: Engine
    model_name: str
    limits: Limits
    engine_thread: EngineThread
    tokenizing: concurrent.futures.ThreadPoolExecutor  # off the event loop; one thread: tokenizers are not
    # safe to reconfigure from several threads at once
    reasoning: ReasoningParser | None  # splits chat replies' thinking from their answer
    probing: concurrent.futures.ThreadPoolExecutor  # asks a remote LLM whether it is back, off the event loop


def create_app(engine: Engine, model_name: str = "r2r", limits: Limits | None = None, api_key: str | None = None,
               loopback_only: bool = True, docs: bool = False, reasoning_parser: str = "auto") -> FastAPI:
    """`loopback_only`: refuse requests whose Host or Origin is not localhost (for a server bound to a
    loopback address). `docs`: serve /docs and /openapi.json. `reasoning_parser`: how chat replies' thinking is
    told from their answer (roads_to_rome/reasoning.py)."""
    limits = dataclasses.replace(limits or Limits())  # this server's own copy: the caller's is left as it was
    if engine.max_rows is not None and limits.max_batch > engine.max_rows:
        raise R2RError(f"--max-batch {limits.max_batch} is more than the backend holds ({engine.max_rows} rows at "
                       f"once): lower --max-batch")
    # One request's limit: what one row may hold, and the KV pool all rows share where the backend has one.
    limits.context_length = min(limits.context_length, engine.max_context, engine.kv_capacity or engine.max_context)
    state = ServerState(engine, model_name, limits, EngineThread(engine, limits),
                        concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="r2r-tokenize"),
                        parser_for(resolve_parser(reasoning_parser, engine.tokenizer)),
                        concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="r2r-probe"))

    async def lifespan(app):
        state.engine_thread.start()
        yield
        state.engine_thread.stop()
        state.tokenizing.shutdown(wait=False)
        state.probing.shutdown(wait=False)

    app = FastAPI(title="R2R", lifespan=lifespan, docs_url="/docs" if docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if docs else None)
    app.state.r2r = state
    # The handlers are coroutines: Starlette runs a plain function in a worker thread, one per error at once.
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    app.add_middleware(Guard, api_key=api_key, loopback_only=loopback_only, max_body_bytes=limits.max_body_bytes)
    app.include_router(routes)
    # The playground's renderers (`make web` puts them there; without them the page shows plain text).
    static = importlib.resources.files(__package__).joinpath("static")
    app.mount("/static", StaticFiles(directory=str(static), check_dir=False), name="static")
    return app


async def api_error(_: HTTPRequest, e: APIError) -> JSONResponse:
    return e.response()


async def http_error(_: HTTPRequest, e: HTTPException) -> JSONResponse:
    return error_response(e.status_code, str(e.detail))


async def internal_error(http: HTTPRequest, e: Exception) -> JSONResponse:
    log.error("internal error on %s", http.url.path, exc_info=e)
    return error_response(500, "internal error (the server's log has the details)", kind="server_error")


async def validation_error(http: HTTPRequest, e: RequestValidationError) -> JSONResponse:
    """FastAPI's body validation, as an OpenAI-style 400 naming the first bad field."""
    first = e.errors()[0]
    loc = [str(x) for x in first["loc"] if x != "body"]
    param = ".".join(loc) if loc and first["type"] != "json_invalid" else None
    if first["type"] == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
    elif not loc:
        message = "the request body must be a JSON object (sent with content-type: application/json)"
    else:
        message = f"{param}: {first['msg']}"
    return APIError(400, message, param=param).response()


routes = APIRouter()


def server(http: HTTPRequest) -> ServerState:
    return http.app.state.r2r


async def llm_health(s: ServerState) -> dict | None:
    """None while the LLM is up (or there is none); what `/health` reports of it while a remote one is away
    (`Backend.health`: a probe of its server, off the event loop)."""
    llm = s.engine.llm
    return None if llm is None else await asyncio.get_running_loop().run_in_executor(s.probing, llm.health)


@routes.get("/health")
async def health(http: HTTPRequest):
    """`ok`, or `degraded` while a remote LLM is away or stalled (requests that need it wait, or get 503 once it is
    unavailable; SLM-only ones still run)."""
    s = server(http)
    away = await llm_health(s)
    return {"status": "degraded" if away else "ok", "model": s.model_name, **s.engine_thread.load(),
            **({"llm": away} if away else {})}


@routes.get("/metrics", include_in_schema=False)
async def metrics(http: HTTPRequest):
    """Prometheus's text format (`prometheus_client`); behind the API key when the server has one."""
    return Response(server(http).engine_thread.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


@routes.get("/v1/models")
async def list_models(http: HTTPRequest):
    s = server(http)
    engine = s.engine
    return {"object": "list", "data": [{
        "id": s.model_name, "object": "model", "created": 0, "owned_by": "r2r",
        "r2r": {"slm": engine.slm.name if engine.slm else None, "llm": engine.llm.name if engine.llm else None,
                "policy": engine.policy.name, "threshold": engine.policy.threshold, "verify": engine.verify,
                "max_unverified": engine.max_unverified, "defer": engine.deferral.mode,
                "defer_group": engine.deferral.group, "defer_steps": engine.deferral.steps, "overlap": engine.overlap,
                "max_batch": s.limits.max_batch,
                "max_tokens": s.limits.max_tokens,
                "reasoning_parser": s.reasoning.name if s.reasoning else None},
    }]}


@routes.get("/", response_class=HTMLResponse)
async def playground(http: HTTPRequest):
    page = importlib.resources.files(__package__).joinpath("playground.html").read_text()
    return page.replace("{{MODEL}}", html.escape(server(http).model_name))


@routes.get("/favicon.ico", include_in_schema=False)
async def favicon():
    return Response(status_code=204)


@routes.post("/v1/chat/completions")
async def chat_completions(body: ChatBody, http: HTTPRequest):
    s = server(http)
    check_body(body, s)
    prompt_ids = await tokenize(s, s.engine.encode_messages, [m.model_dump() for m in body.messages])
    return await respond(http, s, body, prompt_ids, chat=True)


@routes.post("/v1/completions")
async def completions(body: CompletionBody, http: HTTPRequest):
    s = server(http)
    check_body(body, s)
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise APIError(400, "only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    return await respond(http, s, body, await tokenize(s, s.engine.encode_raw, prompt), chat=False)


async def tokenize(s: ServerState, encode, *args) -> list[int]:
    try:
        return await asyncio.get_running_loop().run_in_executor(s.tokenizing, encode, *args)
    except R2RError as e:
        raise APIError(400, str(e)) from None


def check_body(body: CommonBody, s: ServerState) -> None:
    """What a body's types cannot say: the model it names and the options this server supports."""
    if body.requested is not None and body.requested != s.model_name:
        raise APIError(404, f"the model {body.requested!r} does not exist; this server serves {s.model_name!r}",
                       param="model", code="model_not_found")
    if body.n != 1:
        raise APIError(400, "only n=1 is supported", param="n")


def make_sequence(body: CommonBody, prompt_ids: list[int], s: ServerState) -> Sequence:
    limits = s.limits
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise APIError(400, f"max_tokens is at most {limits.max_tokens} on this server", param="max_tokens")
    context = limits.context_length
    room = context - len(prompt_ids)
    if room <= 0 or (max_tokens is not None and max_tokens > room):
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens and max_tokens is {max_tokens}, but this "
                            f"server holds at most {context} tokens per request", param="messages",
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(limits.max_tokens, room)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    params = SamplingParams(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                            top_k=body.top_k, stop=tuple(stop), seed=body.seed)
    try:
        request = Request(prompt_ids, params, force=body.r2r_policy, threshold=body.r2r_threshold,
                          target_rate=body.r2r_llm_rate, verify=body.r2r_verify,
                          max_unverified=body.r2r_max_unverified)
        return s.engine.sequence(request)  # here, not in the engine thread, where it would fail the whole batch
    except R2RError as e:
        raise APIError(400, str(e)) from None


async def respond(http: HTTPRequest, s: ServerState, body: CommonBody, prompt_ids: list[int], chat: bool):
    sequence = make_sequence(body, prompt_ids, s)
    if body.r2r_policy != "slm" and ((await llm_health(s)) or {}).get("status") == "unavailable":
        s.engine_thread.metrics.refused()
        raise llm_away()
    job = Job(sequence, asyncio.get_running_loop())
    s.engine_thread.submit(job)
    reply = Reply(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time()), s.model_name, chat,
                  s.reasoning if chat else None, s.engine.tokenizer)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream_events(job, reply, s.engine, include_usage), media_type="text/event-stream")
    sequence = job.sequence
    try:
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    sequence.cancelled = True
                    return Response(status_code=499)
                continue
            if isinstance(event, ErrorReply):
                if event.code == "llm_unavailable":
                    raise llm_away()
                raise APIError(event.status, event.message, kind="server_error")
            if event.finished:
                break
    except asyncio.CancelledError:
        sequence.cancelled = True
        raise
    return JSONResponse(reply.whole(sequence.generation))


@dataclass
class Reply:
    """The response bodies of one request, as the openai package's types (plus the "r2r" provenance)."""

    id: str
    created: int
    model_name: str
    chat: bool
    parser: ReasoningParser | None = None  # chat replies only: thinking apart from the answer
    tokenizer: object = None

    def reasoned(self, gen):
        return reason(self.parser, self.tokenizer, gen) if self.parser else None

    def whole(self, gen) -> dict:
        r2r = {"token_ids": gen.token_ids, "sources": gen.sources, "scores": gen.scores, "rollbacks": gen.rollbacks,
               "discarded_tokens": gen.discarded, "llm_calls": gen.timings.llm_calls, "deferred_tokens": gen.deferred,
               "deferred_replaced": gen.deferred_replaced, "deferred_discarded_tokens": gen.deferred_discarded}
        if self.chat:
            reasoned = self.reasoned(gen)
            if reasoned is None:
                message = ChatCompletionMessage(role="assistant", content=gen.text)
            else:  # both names: vLLM's `reasoning`, and SGLang's and llama.cpp's `reasoning_content`
                message = ChatCompletionMessage(role="assistant", content=reasoned.content,
                                                reasoning=reasoned.reasoning, reasoning_content=reasoned.reasoning)
            choice = ChatChoice(index=0, message=message, finish_reason=gen.finish_reason, logprobs=None)
            out = ChatCompletion(id=self.id, object="chat.completion", created=self.created, model=self.model_name,
                                 choices=[choice], usage=usage(gen, reasoned), r2r=r2r)
        else:
            choice = CompletionChoice(index=0, text=gen.text, logprobs=None, finish_reason=gen.finish_reason)
            out = Completion(id=self.id, object="text_completion", created=self.created, model=self.model_name,
                             choices=[choice], usage=usage(gen), r2r=r2r)
        return out.model_dump(exclude_unset=True)

    def chunk(self, delta: str | None, finish_reason=None, extra: dict | None = None, role: bool = False,
              reasoning: str | None = None) -> str:
        if self.chat:
            if role:
                d = ChoiceDelta(role="assistant", content="")
            elif reasoning:
                d = ChoiceDelta(reasoning=reasoning, reasoning_content=reasoning,
                                **({"content": delta} if delta else {}))
            else:
                d = ChoiceDelta(content=delta) if delta is not None else ChoiceDelta()
            choice = ChunkChoice(index=0, delta=d, finish_reason=finish_reason)
            out = ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                                      model=self.model_name, choices=[choice],
                                      **(extra or {})).model_dump(exclude_unset=True)
        else:
            # openai's CompletionChoice has no null finish_reason, which every chunk but the last needs.
            out = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model_name,
                   "choices": [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}],
                   **{k: v.model_dump(exclude_unset=True) if isinstance(v, BaseModel) else v
                      for k, v in (extra or {}).items()}}
        return f"data: {json.dumps(out)}\n\n"

    def usage_chunk(self, gen, reasoned=None) -> str:
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model_name, "choices": [],
               "usage": usage(gen, reasoned).model_dump(exclude_unset=True)}
        return f"data: {json.dumps(out)}\n\n"


async def stream_events(job: Job, reply: Reply, engine: Engine, include_usage: bool):
    """One chunk per token once it is final (at once without verification; with it, once the LLM has
    checked it), with its provenance; the last chunk carries the usage."""
    sequence = job.sequence
    detok = Detokenizer(engine.tokenizer)
    hold = max((len(s) for s in sequence.params.stop), default=1) - 1  # a stop string may be forming
    text, sent, finished = "", 0, False
    parser, reasoned = reply.parser, None
    start = prompt_start(parser, engine.tokenizer, sequence.prompt_ids) if parser else None
    sent_thinking, sent_answer, streamed = 0, 0, 0
    try:
        if reply.chat:
            yield reply.chunk(None, role=True)
        while not finished:
            event = await job.events.get()
            if isinstance(event, ErrorReply):  # with what the client has been sent so far, to resume from
                error = {"error": {"message": event.message, "type": "server_error", "param": None,
                                   "code": event.code, "r2r": {"token_ids": sequence.generation.token_ids[:streamed],
                                                               "text": text[:sent]}}}
                yield f"data: {json.dumps(error)}\n\n"
                break
            for n, (token, source, score) in enumerate(event.final, 1):
                finished = event.finished and n == len(event.final)
                streamed += 1
                text += detok.push(token, final=finished)
                if finished:  # the final text has any stop string cut off
                    final = sequence.generation.text
                    delta, sent = final[sent:], len(final)
                else:
                    safe = len(text) - hold
                    delta, sent = (text[sent:safe], safe) if safe > sent else ("", sent)
                thinking = None
                if parser:  # what is shown so far, split; a tag being written is held back
                    split = parser.split(text[:sent] if not finished else sequence.generation.text, start, finished)
                    thinking, delta = (split.reasoning or "")[sent_thinking:], split.content[sent_answer:]
                    sent_thinking, sent_answer = sent_thinking + len(thinking), sent_answer + len(delta)
                extra = {"r2r": {"token_id": token, "source": source, "score": score}}
                if finished:
                    reasoned = reply.reasoned(sequence.generation)
                    extra["usage"] = usage(sequence.generation, reasoned)
                yield reply.chunk(delta, sequence.generation.finish_reason if finished else None, extra,
                                  reasoning=thinking)
        if finished and include_usage:
            yield reply.usage_chunk(sequence.generation, reasoned)
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            sequence.cancelled = True  # the client went away (or an error): free the slot


def usage(gen, reasoned=None) -> CompletionUsage:
    """OpenAI's usage, plus R2R's figures; with a reasoning parser, the thinking's tokens and the LLM's share of the
    thinking and of the answer apart."""
    n = len(gen.token_ids)
    thinking = {} if reasoned is None else {
        "completion_tokens_details": CompletionTokensDetails(reasoning_tokens=reasoned.reasoning_tokens),
        "llm_rate_thinking": reasoned.llm_rate_thinking, "llm_rate_answer": reasoned.llm_rate_answer}
    return CompletionUsage(prompt_tokens=len(gen.prompt_ids), completion_tokens=n,
                           total_tokens=len(gen.prompt_ids) + n, llm_tokens=gen.llm_tokens, llm_rate=gen.llm_rate,
                           avg_activated_params_b=gen.avg_params_b, rollbacks=gen.rollbacks,
                           llm_calls=gen.timings.llm_calls, deferred_tokens=gen.deferred,
                           deferred_discarded_tokens=gen.deferred_discarded, **thinking)


def run(app: FastAPI, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM. The first signal stops admitting new requests (503) and gives those in
    flight the limits' drain timeout to finish (then they are cut with an error a client can read); a
    second signal exits at once."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if self.should_exit:
                self.force_exit = True  # uvicorn then stops waiting for connections
                app.state.r2r.engine_thread.drain(0)
            else:
                app.state.r2r.engine_thread.drain(app.state.r2r.limits.drain_timeout)
            super().handle_exit(sig, frame)

    drain = app.state.r2r.limits.drain_timeout
    Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=drain + 5)).run()
