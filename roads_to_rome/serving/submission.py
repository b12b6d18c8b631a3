"""The one path a request takes to the engine: its chat written in the template (off the event loop), checked in full,
cut to fit where it asks (`truncation: "auto"`), its sequences queued, and what renders their answers. Every API's
handler (server.py) ends here, so nothing a client sends can fail the batch."""

from __future__ import annotations

import asyncio
import functools
import json
import time

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from roads_to_rome.errors import R2RError
from roads_to_rome.reasoning import ReasoningParser, thinking_until
from roads_to_rome.serving import request_ids
from roads_to_rome.serving.adapter import Checked, bad_words, check_body, make_sequences, truncated
from roads_to_rome.serving.chat_schemas import ChatBody, ChatPrompt, ToolUse
from roads_to_rome.serving.engine_thread import Job
from roads_to_rome.serving.errors import APIError, llm_away
from roads_to_rome.serving.replies import ChatReply, CompletionReply
from roads_to_rome.serving.schemas import CommonBody
from roads_to_rome.serving.state import ServerState, llm_health
from roads_to_rome.serving.streams import stream_events, whole_answer


async def chat_prompt(s: ServerState, body: ChatPrompt, prompt_tools: list[dict] | None) -> list[int]:
    """A chat's prompt tokens, in the model's chat template: the messages, the tools it shows, how it ends."""
    if body.chat_template is not None and s.templates is None:
        raise APIError(400, "this server writes chats in its own chat template; a request's chat_template needs a "
                            "server started with --trust-request-chat-template: leave it out",
                       param="chat_template")
    messages = [m.for_template() for m in body.messages]
    options = body.template_options()
    if body.chat_template is not None:  # a client's template: in a process of its own, within a time and memory
        return await s.templates(messages, body.chat_template_kwargs, prompt_tools, options["add_generation_prompt"],
                                 options["continue_final_message"], options["template"])
    # what the template will hold
    chars = len(json.dumps([messages, prompt_tools], ensure_ascii=False))
    encode = functools.partial(s.engine.prompts.messages, **options)
    return await tokenize(s, chars, encode, messages, body.chat_template_kwargs, prompt_tools)


async def tokenize(s: ServerState, chars: int, encode, *args) -> list[int]:
    try:
        return await s.tokenizing(chars, encode, *args)
    except R2RError as e:
        raise APIError(400, str(e)) from None


async def respond(http: HTTPRequest, s: ServerState, body: CommonBody, checked: Checked, prompts: list[list[int]],
                  chat: bool, echo: list[str] | None = None, tools: ToolUse | None = None):
    """Each prompt's `n` choices, decoded side by side, answered whole or streamed (choice i * n + j: prompt i's
    j-th), as `checked` says (their output held to its format); `echo`: each prompt's text, which its choices' text
    starts with; `tools`: how a chat reply's tool calls are read."""
    jobs, reply = await submit(s, body, checked, prompts, chat, echo, tools)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(stream_events(jobs, reply, include_usage), media_type="text/event-stream")
    return await whole_answer(http, jobs, s.limits.max_request_seconds, reply.whole)


async def checked_chat(s: ServerState, chat: ChatBody, fit: bool = False
                       ) -> tuple[list[int], Checked, ToolUse]:
    """A chat request checked in full: its prompt, what it asks for (the format its output follows: its own, or its
    tool choice's), how its tools are used. `fit`: the oldest turns go until the conversation fits (OpenAI's
    `truncation: "auto"`)."""
    checked = check_body(chat, s.model_name, s.limits, s.scheduling.by_priority)
    tools = chat.tool_use(s.tool_parser)
    prompt_ids = await chat_prompt(s, chat, tools.prompt_tools)
    fits = lambda ids: len(ids) + (chat.max_tokens or 1) <= s.limits.context_length  # noqa: E731
    if fit and not fits(prompt_ids):
        prompt_ids = await fitted_prompt(s, chat, tools, fits)
    return truncated(chat, prompt_ids, s.limits), checked.for_tools(tools.output_format), tools


async def fitted_prompt(s: ServerState, chat: ChatBody, tools: ToolUse, fits) -> list[int]:
    """The prompt of the chat less the fewest oldest turns that make it `fits` (OpenAI's `truncation: "auto"`),
    found by halving: a few renderings of the chat, not one per turn dropped. The chat keeps what is left."""
    spans = oldest_turns(chat)
    low, high, best = 1, len(spans), None  # (dropping more turns never lengthens the prompt)
    while low <= high:
        middle = (low + high) // 2
        ids = await chat_prompt(s, without(chat, spans[:middle]), tools.prompt_tools)
        if fits(ids):
            high, best = middle - 1, (middle, ids)
        else:
            low = middle + 1
    dropped, ids = best or (len(spans), None)
    chat.messages = without(chat, spans[:dropped]).messages
    return ids if ids is not None else await chat_prompt(s, chat, tools.prompt_tools)


async def queue_chat(s: ServerState, chat: ChatBody, fit: bool = False) -> tuple[list[Job], ChatReply, list[int]]:
    """A chat that another API's request became (Responses, Messages), checked and queued as a chat request's would
    be; with its prompt."""
    prompt_ids, checked, tools = await checked_chat(s, chat, fit)
    jobs, reply = await submit(s, chat, checked, [prompt_ids], True, tools=tools)
    return jobs, reply, prompt_ids


async def submit(s: ServerState, body: CommonBody, checked: Checked, prompts: list[list[int]], chat: bool,
                 echo: list[str] | None = None, tools: ToolUse | None = None
                 ) -> tuple[list[Job], ChatReply | CompletionReply]:
    """The request's sequences, queued for the engine, and the `Reply` that renders what they write."""
    structured, field = checked.output_format is not None, checked.format_field
    compiled = None
    if structured:  # once per request, off the event loop; each choice walks a copy
        what = "a tool's parameters cannot be followed" if field == "tools" else field
        compiled = await s.compiling(field, what, s.engine.compile_format, checked.output_format)
    banned = ()
    if body.bad_words:
        banned = await tokenize(s, sum(map(len, body.bad_words)), bad_words, body.bad_words, s.engine.tokenizer)
    reasoning = s.reasoning if chat else None
    sequences = [sequence for ids in prompts for sequence in make_sequences(
        body, checked, ids, s.engine, s.limits, compiled, answer_after(reasoning, s.engine.tokenizer, ids, field)
        if structured else None, tools.stop if tools else (), banned)]
    if body.r2r_policy != "slm" and ((await llm_health(s)) or {}).get("status") == "unavailable":
        s.engine_thread.metrics.refused()
        raise llm_away()
    jobs = [Job(sequence, asyncio.get_running_loop()) for sequence in sequences]
    s.engine_thread.submit(jobs)
    return jobs, reply_of(s, body, chat, echo, tools)


def reply_of(s: ServerState, body: CommonBody, chat: bool, echo: list[str] | None, tools: ToolUse | None
             ) -> ChatReply | CompletionReply:
    """What renders the request's answers (serving/replies.py)."""
    options = body.stream_options
    common = {"id": ("chatcmpl-" if chat else "cmpl-") + request_ids.get(), "created": int(time.time()),
              "model_name": s.model_name, "tokenizer": s.engine.tokenizer, "n": body.n, "echo": echo,
              "prompt_entries": body.prompt_logprobs is not None, "token_ids": body.return_tokens_as_token_ids,
              "with_ids": body.return_token_ids,
              "running_usage": bool(options and options.include_usage and options.continuous_usage_stats)}
    if not chat:
        return CompletionReply(**common, prompt_alone=body.prompt_alone())
    return ChatReply(**common, parser=s.reasoning, tools=tools.parser if tools else None,
                     one_call=bool(tools and tools.one), show_reasoning=body.include_reasoning)


def answer_after(parser: ReasoningParser | None, tokenizer, prompt_ids: list[int], field: str) -> int | None:
    """Where a structured output starts in a reply to these tokens: after the token that closes its thinking."""
    try:
        return thinking_until(parser, tokenizer, prompt_ids) if parser else None
    except R2RError as e:
        raise APIError(400, str(e), param=field) from None


def oldest_turns(chat: ChatBody) -> list[tuple[int, int]]:
    """`truncation: "auto"`: the spans of messages that go, oldest first, as the conversation is cut to fit: each
    turn but the system's (with a call's answers, which go with their call), never the last one."""
    roles = [m.role for m in chat.messages]
    turns = [i for i, role in enumerate(roles) if role not in ("system", "developer")]
    spans = []
    for first in turns[:-1]:
        if spans and first < spans[-1][1]:  # (a tool answer that went with its call)
            continue
        end = first + 1
        while end < len(roles) and roles[end] == "tool":
            end += 1
        if end > turns[-1]:
            break
        spans.append((first, end))
    return spans


def without(chat: ChatBody, spans: list[tuple[int, int]]) -> ChatBody:
    """The chat with these spans of messages left out."""
    gone = {i for first, end in spans for i in range(first, end)}
    return chat.model_copy(update={"messages": [m for i, m in enumerate(chat.messages) if i not in gone]})
