"""What every handler reads: the server's engine, limits and lanes (`ServerState`, made by `create_app`), and whether a
remote LLM is away."""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass

from fastapi import Request as HTTPRequest

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.scheduler import Scheduling
from roads_to_rome.reasoning import ReasoningParser
from roads_to_rome.serving.engine_thread import EngineThread
from roads_to_rome.serving.guard import Compiling, TemplateLane, Tokenizing
from roads_to_rome.serving.limits import SERVER_SCHEDULING, Limits
from roads_to_rome.serving.response_store import ResponseStore


@dataclass
class ServerState:
    engine: Engine
    model_name: str
    limits: Limits
    engine_thread: EngineThread
    tokenizing: Tokenizing
    compiling: Compiling
    reasoning: ReasoningParser | None  # splits chat replies' thinking from their answer
    tool_parser: str | None  # the call syntax chat replies' tool calls are read in (None: tools are refused)
    probing: concurrent.futures.ThreadPoolExecutor  # asks a remote LLM whether it is back, off the event loop
    responses: ResponseStore  # the Responses API's stored responses
    templates: TemplateLane | None = None  # writes chats in templates requests bring (None: they may bring none)
    scheduling: Scheduling = SERVER_SCHEDULING  # how requests are admitted and read


def server(http: HTTPRequest) -> ServerState:
    return http.app.state.r2r


async def llm_health(s: ServerState) -> dict | None:
    """None while the LLM is up (or there is none); what `/health` reports of it while a remote one is away
    (`Backend.health`: a probe of its server, off the event loop)."""
    llm = s.engine.llm
    return None if llm is None else await asyncio.get_running_loop().run_in_executor(s.probing, llm.health)
