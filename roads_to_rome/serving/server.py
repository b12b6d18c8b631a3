"""An OpenAI-compatible HTTP server for R2R, with continuous batching and per-token provenance.

Its rooms are listed in docs/architecture.md; here: the app, its routes and errors, and `run`. A request is checked
in full before it queues (submission.py), so nothing a client sends can fail the batch; its prompt is then read in
chunks between decode steps, so running streams keep going. Every error is a JSON body in the shape of the API asked
(OpenAI's, or Anthropic's on /v1/messages); internals go to the server's log, not to clients.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import html
import importlib.resources
import logging
import socket
from typing import Annotated, Any, Literal

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Query
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.staticfiles import StaticFiles

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.scheduler import Scheduling
from roads_to_rome.errors import R2RError
from roads_to_rome.reasoning import parser_for, resolve_parser
from roads_to_rome.serving import request_ids
from roads_to_rome.serving.adapter import check_body, check_model, truncated
from roads_to_rome.serving.bodies import body_of, documented, off_loop, validated, with_body_schemas
from roads_to_rome.serving.chat_schemas import ChatBody, TokenizeChat
from roads_to_rome.serving.connections import uvicorn_config
from roads_to_rome.serving.engine_thread import EngineThread
from roads_to_rome.serving.errors import APIError, error_response, shaped, validation_error
from roads_to_rome.serving.guard import Compiling, Guard, TemplateLane, Tokenizing, check_api_key
from roads_to_rome.serving.limits import SERVER_SCHEDULING, Limits
from roads_to_rome.serving.messages import MessageDraft, message_events, whole_message
from roads_to_rome.serving.messages_schemas import CountTokensBody, MessagesBody
from roads_to_rome.serving.response_store import ResponseStore
from roads_to_rome.serving.responses import Draft, response_events, whole_response
from roads_to_rome.serving.responses_schemas import ResponsesBody
from roads_to_rome.serving.schemas import CompletionBody, DetokenizeBody, TokenizeText
from roads_to_rome.serving.state import ServerState, llm_health, server
from roads_to_rome.serving.streams import whole_answer
from roads_to_rome.serving.submission import chat_prompt, checked_chat, queue_chat, respond, tokenize
from roads_to_rome.tool_calls import resolve_tool_parser

log = logging.getLogger(__name__)


def create_app(engine: Engine, model_name: str = "r2r", limits: Limits | None = None, api_key: str | None = None,
               loopback_only: bool = True, docs: bool = False, reasoning_parser: str = "auto",
               tool_call_parser: str = "auto", trust_request_chat_template: bool = False,
               scheduling: Scheduling = SERVER_SCHEDULING) -> FastAPI:
    """`loopback_only`: refuse requests whose Host or Origin is not localhost (for a server bound to a
    loopback address). `docs`: serve /docs and /openapi.json. `reasoning_parser`: how chat replies' thinking is
    told from their answer (roads_to_rome/reasoning.py); `tool_call_parser`: how their tool calls are read
    (roads_to_rome/tool_calls.py). `trust_request_chat_template`: chat requests may give their own `chat_template`
    (vLLM's flag; transformers runs templates sandboxed, but a client's may take long to write). `scheduling`: how
    requests are admitted and their prompts read (core/scheduler.py)."""
    check_api_key(api_key)
    limits = dataclasses.replace(limits or Limits())  # this server's own copy: the caller's is left as it was
    if engine.max_rows is not None and limits.max_batch > engine.max_rows:
        raise R2RError(f"--max-batch {limits.max_batch} is more than the backend holds ({engine.max_rows} rows at "
                       f"once): lower --max-batch")
    # One request's limit: what one row may hold, and the KV pool all rows share where the backend has one.
    limits.context_length = min(limits.context_length, engine.max_context, engine.kv_capacity or engine.max_context)
    reasoning = parser_for(resolve_parser(reasoning_parser, engine.tokenizer))
    state = ServerState(engine, model_name, limits, EngineThread(engine, limits, scheduling),
                        Tokenizing(limits.max_tokenizing), Compiling(limits.max_compile_seconds, limits.max_tokenizing,
                                  lambda: engine.grammar_tokenizer),
                        reasoning,
                        resolve_tool_parser(tool_call_parser, engine.tokenizer),
                        concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="r2r-probe"),
                        ResponseStore(limits.responses_store_bytes),
                        TemplateLane(engine.tokenizer, limits.max_template_seconds, limits.max_template_bytes,
                                     limits.max_tokenizing) if trust_request_chat_template else None, scheduling)

    async def lifespan(app):
        state.engine_thread.start()
        yield
        state.engine_thread.stop()
        state.tokenizing.shutdown()
        state.compiling.shutdown()
        if state.templates is not None:
            state.templates.shutdown()
        state.probing.shutdown(wait=False)

    app = FastAPI(title="R2R", lifespan=lifespan, docs_url="/docs" if docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if docs else None)
    app.state.r2r = state
    # The handlers are coroutines: Starlette runs a plain function in a worker thread, one per error at once.
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, body_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    app.add_middleware(Guard, api_key=api_key, loopback_only=loopback_only, limits=limits)
    app.add_middleware(request_ids.RequestIds)  # (the last added is the outermost)
    app.include_router(routes)
    with_body_schemas(app, [ChatBody, CompletionBody, ResponsesBody, MessagesBody, CountTokensBody, DetokenizeBody])
    # The playground's renderers (`make web` puts them there; without them the page shows plain text).
    static = importlib.resources.files(__package__).joinpath("static")
    app.mount("/static", StaticFiles(directory=str(static), check_dir=False), name="static")
    return app


async def api_error(http: HTTPRequest, e: APIError) -> Response:
    return shaped(http.url.path, e.response())


async def http_error(http: HTTPRequest, e: HTTPException) -> Response:
    return shaped(http.url.path, error_response(e.status_code, str(e.detail)))


async def body_error(http: HTTPRequest, e: RequestValidationError) -> Response:
    return shaped(http.url.path, await validation_error(http, e))


async def internal_error(http: HTTPRequest, e: Exception) -> Response:
    log.error("internal error on %s, request %s", http.url.path, request_ids.get(), exc_info=e)
    return shaped(http.url.path, error_response(500, f"internal error ({request_ids.details()})", kind="server_error"))


routes = APIRouter()


@routes.get("/health")
async def health(http: HTTPRequest):
    """`ok`; `degraded` while a remote LLM is away or stalled (requests that need it wait, or get 503 once it is
    unavailable; SLM-only ones still run); 503 `failed` once the engine's thread has failed. Only the status
    without the API key."""
    s = server(http)
    if s.engine_thread.failed is not None:
        return JSONResponse({"status": "failed"}, status_code=503)
    away = await llm_health(s)
    status = {"status": "degraded" if away else "ok"}
    if not http.state.key_ok:
        return status
    return {**status, "model": s.model_name, **s.engine_thread.load(), **({"llm": away} if away else {})}


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
                "policy": engine.policy.name, "threshold": engine.policy.threshold, "verify": engine.verify.value,
                "max_unverified": engine.max_unverified, "defer": engine.deferral.mode,
                "defer_group": engine.deferral.group, "defer_steps": engine.deferral.steps, "overlap": engine.overlap,
                "max_batch": s.limits.max_batch, "max_tokens": s.limits.max_tokens,
                "reasoning_parser": s.reasoning.name if s.reasoning else None, "tool_call_parser": s.tool_parser},
    }]}


@routes.get("/", response_class=HTMLResponse)
async def playground(http: HTTPRequest):
    page = importlib.resources.files(__package__).joinpath("playground.html").read_text()
    return page.replace("{{MODEL}}", html.escape(server(http).model_name))


@routes.get("/favicon.ico", include_in_schema=False)
async def favicon():
    return Response(status_code=204)


@routes.post("/v1/chat/completions", openapi_extra=documented(ChatBody))
async def chat_completions(body: Annotated[ChatBody, Depends(body_of(ChatBody))], http: HTTPRequest):
    s = server(http)
    request_ids.name(body.request_id)
    prompt_ids, checked, tools = await checked_chat(s, body)
    return await respond(http, s, body, checked, [prompt_ids], chat=True, tools=tools, echo=body.echoed())


@routes.post("/v1/responses", openapi_extra=documented(ResponsesBody))
async def create_response(body: Annotated[ResponsesBody, Depends(body_of(ResponsesBody))], http: HTTPRequest):
    """OpenAI's Responses API: the input as a chat, answered as output items (serving/responses.py)."""
    s = server(http)
    body.checked()
    chat, conversation = await off_loop(http, body.chat_request, s.responses.history(body.previous_response_id))
    jobs, reply, _ = await queue_chat(s, chat, fit=body.truncation == "auto")
    draft = Draft(body, chat, conversation, s.model_name, jobs[0].sequence.params.max_new_tokens)
    if body.background:
        return JSONResponse(s.responses.start(jobs[0], reply, draft))
    if body.stream:
        events = response_events(jobs[0], reply, draft, s.responses.put)
        return StreamingResponse(events, media_type="text/event-stream")

    def kept(gens):
        response = whole_response(draft, reply, gens[0])
        if body.store:
            s.responses.put(response, draft)
        return response

    return await whole_answer(http, jobs, s.limits.max_request_seconds, kept)


@routes.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, http: HTTPRequest):
    return JSONResponse(server(http).responses.stored(response_id).response)  # (not walked by FastAPI's encoder)


@routes.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, http: HTTPRequest, order: Literal["asc", "desc"] = "desc",
                           limit: Annotated[int, Query(ge=1, le=100)] = 20, after: str | None = None):
    """A stored response's input items, a page at a time (OpenAI's cursor: `after` an item's id)."""
    stored = server(http).responses.stored(response_id)
    items = stored.input_items[::-1] if order == "desc" else stored.input_items
    ids = [item["id"] for item in items]
    if after is not None and after not in ids:
        raise APIError(400, f"after names {after!r}, which is not one of this response's input items", param="after")
    start = ids.index(after) + 1 if after is not None else 0
    page = items[start:start + limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(items)})


@routes.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, http: HTTPRequest):
    """A background response stopped where it is."""
    return server(http).responses.cancel(response_id)


@routes.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, http: HTTPRequest):
    responses = server(http).responses
    if not responses.delete(response_id):
        responses.stored(response_id)  # (the 404 naming it)
    return {"id": response_id, "object": "response", "deleted": True}


@routes.post("/v1/messages", openapi_extra=documented(MessagesBody))
async def create_message(body: Annotated[MessagesBody, Depends(body_of(MessagesBody))], http: HTTPRequest):
    """Anthropic's Messages API: the messages as a chat, answered as content blocks (serving/messages.py)."""
    s = server(http)
    body.checked()
    jobs, reply, prompt_ids = await queue_chat(s, await off_loop(http, body.chat_request))
    draft = MessageDraft(s.model_name, len(prompt_ids), tuple(body.stop_sequences or ()))
    if body.stream:
        return StreamingResponse(message_events(jobs[0], reply, draft), media_type="text/event-stream")
    return await whole_answer(http, jobs, s.limits.max_request_seconds,
                              lambda gens: whole_message(draft, reply, gens[0]))


@routes.post("/v1/messages/count_tokens", openapi_extra=documented(CountTokensBody))
async def count_message_tokens(body: Annotated[CountTokensBody, Depends(body_of(CountTokensBody))], http: HTTPRequest):
    """The prompt tokens a Messages request would take."""
    s = server(http)
    body.checked()
    chat = await off_loop(http, body.chat_request, False)
    check_model(chat.requested, s.model_name)
    tools = chat.tool_use(s.tool_parser)
    return {"input_tokens": len(await chat_prompt(s, chat, tools.prompt_tools))}


@routes.post("/v1/completions", openapi_extra=documented(CompletionBody))
async def completions(body: Annotated[CompletionBody, Depends(body_of(CompletionBody))], http: HTTPRequest):
    s = server(http)
    request_ids.name(body.request_id)
    checked = check_body(body, s.model_name, s.limits, s.scheduling.by_priority)
    suffix = body.suffix or None
    if suffix is not None and not all(isinstance(p, str) for p in body.prompts()):
        raise APIError(400, "a suffix goes with a prompt given as text: the prompt and the suffix are framed by the "
                            "model's fill-in-the-middle tokens", param="suffix")
    encode = s.engine.prompts.raw if suffix is None else lambda text: s.engine.prompts.infill(text, suffix)
    given = [await tokenize(s, len(p) + len(suffix or ""), encode, p) if isinstance(p, str) else p
             for p in body.prompts()]
    prompts = [truncated(body, ids, s.limits) for ids in given]
    echoed = [p if isinstance(p, str) and len(ids) == len(whole) else s.engine.tokenizer.decode(ids)
              for p, ids, whole in zip(body.prompts(), prompts, given)] if body.echo else None
    return await respond(http, s, body, checked, prompts, chat=False, echo=echoed)


@routes.post("/tokenize")
async def tokenize_prompt(body: dict[str, Any], http: HTTPRequest):
    """vLLM's: a text's tokens, or a chat's (`messages`) as a chat request's prompt holds them."""
    s = server(http)
    chat = "messages" in body
    asked = await off_loop(http, validated, TokenizeChat if chat else TokenizeText, body)
    check_model(asked.requested, s.model_name)
    if chat:
        ids = await chat_prompt(s, asked, asked.template_tools())
        bos = s.engine.tokenizer.bos_token_id
        ids = [bos, *ids] if asked.add_special_tokens and bos is not None and ids[:1] != [bos] else ids
    else:
        encode = functools.partial(s.engine.tokenizer.encode, add_special_tokens=asked.add_special_tokens)
        ids = await tokenize(s, len(asked.prompt), encode, asked.prompt)
    strings = s.engine.tokenizer.convert_ids_to_tokens(ids) if asked.return_token_strs else None
    # JSONResponse: FastAPI's encoder would walk every token on the event loop
    return JSONResponse({"count": len(ids), "max_model_len": s.limits.context_length, "tokens": ids,
                         "token_strs": strings})


@routes.post("/detokenize", openapi_extra=documented(DetokenizeBody))
async def detokenize(body: Annotated[DetokenizeBody, Depends(body_of(DetokenizeBody))], http: HTTPRequest):
    """vLLM's: the text of token ids."""
    s = server(http)
    check_model(body.requested, s.model_name)
    vocab = s.engine.writer.vocab_size
    if any(token >= vocab for token in body.tokens):
        raise APIError(400, f"tokens holds {max(body.tokens)}, beyond the vocabulary: ids are 0 to {vocab - 1}",
                       param="tokens")
    return {"prompt": await tokenize(s, 4 * len(body.tokens), s.engine.tokenizer.decode, body.tokens)}


def run(app: FastAPI, host: str, port: int, sock: socket.socket | None = None) -> int:
    """Serve until SIGINT/SIGTERM, or until the engine's thread fails; returns the exit status (1 after a failure, for
    a supervisor to start a fresh process). The first signal stops admitting new requests (503) and gives those in
    flight the drain timeout to finish (then they are cut with an error a client can read; at once while the LLM's
    server does not answer); a second exits at once. `sock`: the socket, bound already (`listening_socket`)."""
    state = app.state.r2r

    def llm_stalled() -> bool:
        llm = state.engine.llm
        return llm is not None and llm.health() is not None

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            drain = 0 if self.should_exit else state.limits.drain_timeout
            if self.should_exit:
                self.force_exit = True  # uvicorn then stops waiting for connections
            state.engine_thread.drain(drain, llm_stalled)
            super().handle_exit(sig, frame)

    drain = state.limits.drain_timeout
    uvicorn_server = Server(uvicorn_config(app, host, port, timeout_graceful_shutdown=drain + 5))
    state.engine_thread.on_failure = lambda _: setattr(uvicorn_server, "should_exit", True)
    uvicorn_server.run(sockets=[sock] if sock is not None else None)
    return 1 if state.engine_thread.failed is not None else 0
