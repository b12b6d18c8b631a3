"""An OpenAI-compatible HTTP server for R2R, with continuous batching and per-token provenance.

One engine thread (`Scheduler`) owns the models and a running `Batch`; the HTTP handlers
(asyncio, module level, reading the server's state from `app.state.r2r`) submit requests to it
and receive each decode step through an asyncio queue. Requests join the batch between steps and
leave when done or when their client goes away. Bodies are validated by FastAPI against the
models below; every error is an OpenAI-style JSON error.
"""

from __future__ import annotations

import asyncio
import collections
import importlib.resources
import json
import math
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Literal, Optional, Union

from fastapi import APIRouter, FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice, ChoiceDelta
from pydantic import BaseModel, ConfigDict, Field

from r2r.engine import Batch, Engine, Request, SamplingParams, Step
from r2r.errors import R2RError
from r2r.text import Detokenizer


@dataclass
class Limits:
    max_batch: int = 8  # requests decoding at once
    max_queue: int = 64  # requests waiting for a slot; beyond that: 429
    max_tokens: int = 4096  # the most new tokens one request may ask for
    context_length: int = 32768  # prompt + new tokens


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


# ---- request bodies (unknown fields are ignored, as OpenAI clients send many) -----------------

class StreamOptions(BaseModel):
    include_usage: bool = False


class CommonBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    requested: Optional[str] = Field(None, alias="model")  # the model id the client asks for
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = 1
    # R2R routing knobs (extra body fields)
    r2r_threshold: Optional[float] = None
    r2r_llm_rate: Optional[float] = Field(None, ge=0, le=1)
    r2r_policy: Optional[Literal["slm", "llm"]] = None
    r2r_verify: Optional[Union[float, str]] = None  # off, strict or a tolerance in nats (default: the server's)
    r2r_max_unverified: Optional[int] = Field(None, ge=1)


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatBody(CommonBody):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionBody(CommonBody):
    prompt: Union[str, list[str]]


# ---- the engine thread ------------------------------------------------------------------------

@dataclass
class Failure:
    """The engine failed while this request was in flight."""

    message: str


class Job:
    """A request and the asyncio queue its handler reads its `Step`s (or a `Failure`) from."""

    def __init__(self, request: Request, loop: asyncio.AbstractEventLoop):
        self.request, self.loop, self.events = request, loop, asyncio.Queue()

    def send(self, event: Step | Failure) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # its event loop has closed: nobody wants the tokens any more
            self.request.cancelled = True


class Scheduler:
    """Runs the decode loop in its own thread; requests join between steps (continuous batching)."""

    def __init__(self, engine: Engine, limits: Limits):
        self.engine, self.limits = engine, limits
        self.batch = Batch(engine)
        self.pending: collections.deque[Job] = collections.deque()
        self.running: dict[int, Job] = {}  # id(request) -> its job
        self.wakeup = threading.Condition()
        self.stopping = False
        self.thread = threading.Thread(target=self._run, name="r2r-engine", daemon=True)

    def start(self):
        self.thread.start()

    def stop(self):
        with self.wakeup:
            self.stopping = True
            self.wakeup.notify()
        self.thread.join(timeout=10)

    def submit(self, job: Job) -> None:
        with self.wakeup:
            if len(self.pending) >= self.limits.max_queue:
                raise APIError(429, "the server is busy: too many requests waiting; retry later",
                               code="queue_full", kind="rate_limit_error")
            self.pending.append(job)
            self.wakeup.notify()

    def load(self) -> dict:
        return {"running": len(self.batch.requests), "waiting": len(self.pending)}

    def _run(self):
        while True:
            with self.wakeup:
                while not self.stopping and not self.pending and not self.batch.requests:
                    self.wakeup.wait()
                if self.stopping:
                    return
                joining = []
                while self.pending and len(self.batch.requests) + len(joining) < self.limits.max_batch:
                    job = self.pending.popleft()
                    if not job.request.cancelled:
                        joining.append(job)
            self.running.update((id(job.request), job) for job in joining)
            try:
                if joining:
                    self.batch.add([job.request for job in joining])
                steps = self.batch.step()
            except Exception as e:  # keep serving: fail the requests in flight, start a fresh batch
                message = str(e) if isinstance(e, R2RError) else f"internal error: {type(e).__name__}: {e}"
                for job in self.running.values():
                    job.send(Failure(message))
                self.running.clear()
                self.batch = Batch(self.engine)
                continue
            for step in steps:
                job = self.running[id(step.request)]
                job.send(step)
                if step.finished:
                    del self.running[id(step.request)]
            # Cancelled requests left the batch at this step without a last Step.
            for key in set(self.running) - {id(r) for r in self.batch.requests}:
                del self.running[key]


# ---- the app ----------------------------------------------------------------------------------

@dataclass
class ServerState:
    engine: Engine
    model_name: str
    limits: Limits
    scheduler: Scheduler


def create_app(engine: Engine, model_name: str = "r2r", limits: Limits | None = None) -> FastAPI:
    limits = limits or Limits()
    limits.context_length = min(limits.context_length, engine.max_context)
    state = ServerState(engine, model_name, limits, Scheduler(engine, limits))

    async def lifespan(app):
        state.scheduler.start()
        yield
        state.scheduler.stop()

    app = FastAPI(title="R2R", lifespan=lifespan)
    app.state.r2r = state
    app.add_exception_handler(APIError, lambda _, e: e.response())
    app.add_exception_handler(RequestValidationError, validation_error)
    app.include_router(routes)
    return app


def validation_error(http: HTTPRequest, e: RequestValidationError) -> JSONResponse:
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


@routes.get("/health")
async def health(http: HTTPRequest):
    s = server(http)
    return {"status": "ok", "model": s.model_name, **s.scheduler.load()}


@routes.get("/v1/models")
async def list_models(http: HTTPRequest):
    s = server(http)
    engine = s.engine
    return {"object": "list", "data": [{
        "id": s.model_name, "object": "model", "created": 0, "owned_by": "r2r",
        "r2r": {"slm": engine.slm.name if engine.slm else None, "llm": engine.llm.name if engine.llm else None,
                "policy": engine.policy.name, "threshold": engine.policy.threshold, "verify": engine.verify,
                "max_unverified": engine.max_unverified},
    }]}


@routes.get("/", response_class=HTMLResponse)
async def playground(http: HTTPRequest):
    page = importlib.resources.files("r2r").joinpath("playground.html").read_text()
    return page.replace("{{MODEL}}", server(http).model_name)


@routes.get("/favicon.ico", include_in_schema=False)
async def favicon():
    return Response(status_code=204)


@routes.post("/v1/chat/completions")
async def chat_completions(body: ChatBody, http: HTTPRequest):
    s = server(http)
    check_body(body, s)
    prompt_ids = s.engine.encode_messages([m.model_dump() for m in body.messages])
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
    return await respond(http, s, body, s.engine.encode_raw(prompt), chat=False)


def check_body(body: CommonBody, s: ServerState) -> None:
    """What a body's types cannot say: the model it names and the options this server supports."""
    if body.requested is not None and body.requested != s.model_name:
        raise APIError(404, f"the model {body.requested!r} does not exist; this server serves {s.model_name!r}",
                       param="model", code="model_not_found")
    if body.n != 1:
        raise APIError(400, "only n=1 is supported", param="n")


def make_request(body: CommonBody, prompt_ids: list[int], s: ServerState) -> Request:
    limits = s.limits
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    room = limits.context_length - len(prompt_ids)
    if room <= 0 or (max_tokens is not None and max_tokens > room):
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens and max_tokens is {max_tokens}, but the "
                            f"context length is {limits.context_length}", param="messages",
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(limits.max_tokens, room)
    if max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if max_tokens > limits.max_tokens:
        raise APIError(400, f"max_tokens is at most {limits.max_tokens} on this server", param="max_tokens")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    params = SamplingParams(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                            top_k=body.top_k, stop=tuple(stop), seed=body.seed)
    if body.r2r_threshold is not None and not math.isfinite(body.r2r_threshold):
        raise APIError(400, "r2r_threshold must be a finite number", param="r2r_threshold")
    request = Request(prompt_ids, params, force=body.r2r_policy, threshold=body.r2r_threshold,
                      target_rate=body.r2r_llm_rate, verify=body.r2r_verify, max_unverified=body.r2r_max_unverified)
    try:
        s.engine.check(request)  # here, not in the engine thread, where it would fail the whole batch
    except R2RError as e:
        raise APIError(400, str(e)) from None
    return request


async def respond(http: HTTPRequest, s: ServerState, body: CommonBody, prompt_ids: list[int], chat: bool):
    job = Job(make_request(body, prompt_ids, s), asyncio.get_running_loop())
    s.scheduler.submit(job)
    reply = Reply(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time()), s.model_name, chat)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream_events(job, reply, s.engine, include_usage), media_type="text/event-stream")
    request = job.request
    try:
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await http.is_disconnected():
                    request.cancelled = True
                    return JSONResponse({}, status_code=499)
                continue
            if isinstance(event, Failure):
                raise APIError(500, event.message, kind="server_error")
            if event.finished:
                break
    except asyncio.CancelledError:
        request.cancelled = True
        raise
    return JSONResponse(reply.whole(request.generation))


@dataclass
class Reply:
    """The response bodies of one request, as the openai package's types (plus the "r2r" provenance)."""

    id: str
    created: int
    model_name: str
    chat: bool

    def whole(self, gen) -> dict:
        r2r = {"token_ids": gen.token_ids, "sources": gen.sources, "scores": gen.scores, "rollbacks": gen.rollbacks,
               "discarded_tokens": gen.discarded}
        if self.chat:
            choice = ChatChoice(index=0, message=ChatCompletionMessage(role="assistant", content=gen.text),
                                finish_reason=gen.finish_reason, logprobs=None)
            out = ChatCompletion(id=self.id, object="chat.completion", created=self.created, model=self.model_name,
                                 choices=[choice], usage=usage(gen), r2r=r2r)
        else:
            choice = CompletionChoice(index=0, text=gen.text, logprobs=None, finish_reason=gen.finish_reason)
            out = Completion(id=self.id, object="text_completion", created=self.created, model=self.model_name,
                             choices=[choice], usage=usage(gen), r2r=r2r)
        return out.model_dump(exclude_unset=True)

    def chunk(self, delta: str | None, finish_reason=None, extra: dict | None = None, role: bool = False) -> str:
        if self.chat:
            d = ChoiceDelta(role="assistant", content="") if role else (
                ChoiceDelta(content=delta) if delta is not None else ChoiceDelta())
            out = ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                                      model=self.model_name, choices=[ChunkChoice(index=0, delta=d,
                                                                             finish_reason=finish_reason)],
                                      **(extra or {})).model_dump(exclude_unset=True)
        else:
            # openai's CompletionChoice has no null finish_reason, which every chunk but the last needs.
            out = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model_name,
                   "choices": [{"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}],
                   **{k: v.model_dump(exclude_unset=True) if isinstance(v, BaseModel) else v
                      for k, v in (extra or {}).items()}}
        return f"data: {json.dumps(out)}\n\n"

    def usage_chunk(self, gen) -> str:
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model_name, "choices": [],
               "usage": usage(gen).model_dump(exclude_unset=True)}
        return f"data: {json.dumps(out)}\n\n"


async def stream_events(job: Job, reply: Reply, engine: Engine, include_usage: bool):
    """One chunk per token once it is final (at once without verification; with it, once the LLM has
    checked it), with its provenance; the last chunk carries the usage."""
    request = job.request
    detok = Detokenizer(engine.tokenizer)
    hold = max((len(s) for s in request.params.stop), default=1) - 1  # a stop string may be forming
    text, sent, finished = "", 0, False
    try:
        if reply.chat:
            yield reply.chunk(None, role=True)
        while not finished:
            event = await job.events.get()
            if isinstance(event, Failure):
                error = {"error": {"message": event.message, "type": "server_error", "param": None, "code": None}}
                yield f"data: {json.dumps(error)}\n\n"
                break
            for n, (token, source, score) in enumerate(event.final, 1):
                finished = event.finished and n == len(event.final)
                text += detok.push(token, final=finished)
                if finished:  # the final text has any stop string cut off
                    final = request.generation.text
                    delta, sent = final[sent:], len(final)
                else:
                    safe = len(text) - hold
                    delta, sent = (text[sent:safe], safe) if safe > sent else ("", sent)
                extra = {"r2r": {"token_id": token, "source": source, "score": score}}
                if finished:
                    extra["usage"] = usage(request.generation)
                yield reply.chunk(delta, request.generation.finish_reason if finished else None, extra)
        if finished and include_usage:
            yield reply.usage_chunk(request.generation)
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            request.cancelled = True  # the client went away (or an error): free the slot


def usage(gen) -> CompletionUsage:
    n = len(gen.token_ids)
    return CompletionUsage(prompt_tokens=len(gen.prompt_ids), completion_tokens=n,
                           total_tokens=len(gen.prompt_ids) + n, llm_tokens=gen.llm_tokens, llm_rate=gen.llm_rate,
                           avg_activated_params_b=gen.avg_params_b, rollbacks=gen.rollbacks)


class BackgroundServer:
    """Run an app with uvicorn in a thread on a free loopback port (tests and benchmarks)."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1"):
        import socket

        import uvicorn

        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "BackgroundServer":
        import httpx

        self.thread.start()
        for _ in range(200):
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("the server did not start")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
