"""An OpenAI-compatible HTTP server for R2R, with continuous batching and per-token provenance.

One engine thread owns the models and a running `Batch`; HTTP handlers (asyncio) submit requests
to it and receive each decode step's tokens through an asyncio queue. Requests join the batch
between steps and leave when done or when their client goes away.
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

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from r2r.engine import Batch, Engine, Request, SamplingParams
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
    model: Optional[str] = None
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


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class ChatBody(CommonBody):
    messages: list[ChatMessage] = Field(min_length=1)


class CompletionBody(CommonBody):
    prompt: Union[str, list[str]]


# ---- the engine thread ------------------------------------------------------------------------

class Scheduler:
    """Runs the decode loop in its own thread; requests join between steps (continuous batching)."""

    def __init__(self, engine: Engine, limits: Limits):
        self.engine, self.limits = engine, limits
        self.batch = Batch(engine)
        self.pending: collections.deque[Request] = collections.deque()
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

    def submit(self, request: Request) -> None:
        with self.wakeup:
            if len(self.pending) >= self.limits.max_queue:
                raise APIError(429, "the server is busy: too many requests waiting; retry later",
                               code="queue_full", kind="rate_limit_error")
            self.pending.append(request)
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
                    request = self.pending.popleft()
                    if not request.cancelled:
                        joining.append(request)
            try:
                if joining:
                    self.batch.add(joining)
                steps = self.batch.step()
            except Exception as e:  # keep serving: fail the requests in flight, start a fresh batch
                message = str(e) if isinstance(e, R2RError) else f"internal error: {type(e).__name__}: {e}"
                for request in {id(r): r for r in self.batch.requests + joining}.values():
                    notify(request, ("error", message))
                self.batch = Batch(self.engine)
                continue
            for request, token, source, score, finished in steps:
                notify(request, ("token", token, source, score, finished))


def notify(request: Request, event: tuple) -> None:
    """Hand an event to the request's handler; a handler that is gone no longer wants its tokens."""
    try:
        request.tag(event)
    except RuntimeError:  # its event loop has closed
        request.cancelled = True


# ---- the app ----------------------------------------------------------------------------------

def create_app(engine: Engine, model_name: str = "r2r", limits: Limits | None = None) -> FastAPI:
    limits = limits or Limits()
    config = engine.slm.model.config.get_text_config() if hasattr(engine.slm, "model") else None
    if config is not None and getattr(config, "max_position_embeddings", None):
        limits.context_length = min(limits.context_length, config.max_position_embeddings)
    scheduler = Scheduler(engine, limits)

    async def lifespan(app):
        scheduler.start()
        yield
        scheduler.stop()

    app = FastAPI(title="R2R", lifespan=lifespan)
    app.state.scheduler = scheduler

    @app.exception_handler(APIError)
    async def api_error(_, e: APIError):
        return e.response()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, **scheduler.load()}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": 0, "owned_by": "r2r",
            "r2r": {"slm": engine.slm.name, "llm": engine.llm.name if engine.llm else None,
                    "policy": engine.policy.name, "threshold": getattr(engine.policy, "threshold", None)},
        }]}

    @app.get("/", response_class=HTMLResponse)
    async def playground():
        page = importlib.resources.files("r2r").joinpath("playground.html").read_text()
        return page.replace("{{MODEL}}", model_name)

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon():
        return Response(status_code=204)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        body = await parse_body(http, ChatBody)
        prompt_ids = engine.encode_messages([m.model_dump() for m in body.messages])
        return await respond(http, body, prompt_ids, chat=True)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        body = await parse_body(http, CompletionBody)
        prompt = body.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        return await respond(http, body, engine.encode_raw(prompt), chat=False)

    async def parse_body(http: HTTPRequest, model: type[BaseModel]):
        try:
            raw = json.loads(await http.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            body = model.model_validate(raw)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(x) for x in first["loc"])
            raise APIError(400, f"{param}: {first['msg']}", param=param) from None
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                           param="model", code="model_not_found")
        if body.n != 1:
            raise APIError(400, "only n=1 is supported", param="n")
        return body

    def make_request(body: CommonBody, prompt_ids: list[int]) -> Request:
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
        if body.r2r_policy == "llm" and engine.llm is None:
            raise APIError(400, "this server has no LLM loaded", param="r2r_policy")
        try:
            params.validate()
        except R2RError as e:
            raise APIError(400, str(e)) from None
        return Request(prompt_ids, params, force=body.r2r_policy, threshold=body.r2r_threshold,
                       target_rate=body.r2r_llm_rate)

    async def respond(http: HTTPRequest, body: CommonBody, prompt_ids: list[int], chat: bool):
        request = make_request(body, prompt_ids)
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        request.tag = lambda event: loop.call_soon_threadsafe(events.put_nowait, event)
        scheduler.submit(request)
        response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(stream_events(request, events, response_id, created, chat, include_usage),
                                     media_type="text/event-stream")
        try:
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        request.cancelled = True
                        return JSONResponse({}, status_code=499)
                    continue
                if event[0] == "error":
                    raise APIError(500, event[1], kind="server_error")
                if event[-1]:  # finished
                    break
        except asyncio.CancelledError:
            request.cancelled = True
            raise
        gen = request.generation
        choice = ({"index": 0, "message": {"role": "assistant", "content": gen.text}, "finish_reason": gen.finish_reason}
                  if chat else {"index": 0, "text": gen.text, "logprobs": None, "finish_reason": gen.finish_reason})
        return {"id": response_id, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model_name, "choices": [choice], "usage": usage(gen),
                "r2r": {"token_ids": gen.token_ids, "sources": gen.sources, "scores": gen.scores}}

    async def stream_events(request: Request, events: asyncio.Queue, response_id: str, created: int, chat: bool,
                            include_usage: bool):
        detok = Detokenizer(engine.tokenizer)
        hold = max((len(s) for s in request.params.stop), default=1) - 1  # a stop string may be forming
        text, sent, finished = "", 0, False

        def chunk(delta: str | None, finish_reason=None, extra=None, role=False):
            if chat:
                d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta is not None else {})
                choice = {"index": 0, "delta": d, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": delta or "", "logprobs": None, "finish_reason": finish_reason}
            out = {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
                   "created": created, "model": model_name, "choices": [choice], **(extra or {})}
            return f"data: {json.dumps(out)}\n\n"

        try:
            if chat:
                yield chunk(None, role=True)
            while not finished:
                event = await events.get()
                if event[0] == "error":
                    error = {"error": {"message": event[1], "type": "server_error", "param": None, "code": None}}
                    yield f"data: {json.dumps(error)}\n\n"
                    break
                _, token, source, score, finished = event
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
                yield chunk(delta, request.generation.finish_reason if finished else None, extra)
            if finished and include_usage:
                out = {"id": response_id, "object": "chat.completion.chunk" if chat else "text_completion",
                       "created": created, "model": model_name, "choices": [], "usage": usage(request.generation)}
                yield f"data: {json.dumps(out)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                request.cancelled = True  # the client went away (or an error): free the slot

    return app


def usage(gen) -> dict:
    n = len(gen.token_ids)
    return {"prompt_tokens": len(gen.prompt_ids), "completion_tokens": n, "total_tokens": len(gen.prompt_ids) + n,
            "llm_tokens": gen.llm_tokens, "llm_rate": gen.llm_rate, "avg_activated_params_b": gen.avg_params_b}


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
