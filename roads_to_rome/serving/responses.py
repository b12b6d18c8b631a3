"""OpenAI's Responses API (`/v1/responses`), as vLLM serves it: a request's input items become a chat, which the chat
path answers (tools, thinking, structured outputs and R2R's knobs alike), and the reply comes back as output items:
the thinking as a `reasoning` item, the answer as a `message`, each tool call as a `function_call`; whole, streamed
as the API's typed events, or in the background (answered at once as queued, fetched when done). The request's models:
responses_schemas.py; the responses kept for a later request, GET, DELETE and cancel: response_store.py."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field

from roads_to_rome.core.request import Generation
from roads_to_rome.serving.chat_schemas import ChatBody
from roads_to_rome.serving.engine_thread import Job
from roads_to_rome.serving.replies import Reply, new_id, provenance, usage
from roads_to_rome.serving.responses_schemas import FunctionChoice, ResponsesBody
from roads_to_rome.serving.streams import StreamFailure, choice_deltas

# ---- the response ------------------------------------------------------------------------------------------------

@dataclass
class Draft:
    """A response's fields beside its output: its id, and what its request asked for, as the API echoes it."""

    body: ResponsesBody
    chat: ChatBody
    conversation: list[dict]  # the chat without its instructions (what a stored response keeps)
    model_name: str
    max_output_tokens: int
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(self, status: str, output: list[dict], gen: Generation | None = None,
                 reasoned=None, error: dict | None = None) -> dict:
        body = self.body
        out = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
               "error": error, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
               else None, "instructions": body.instructions, "max_output_tokens": self.max_output_tokens,
               "model": self.model_name, "output": output, "parallel_tool_calls": body.parallel_tool_calls,
               "previous_response_id": body.previous_response_id,
               "reasoning": body.reasoning.model_dump(exclude={"generate_summary"}) if body.reasoning else None,
               "store": body.store,
               "temperature": self.chat.temperature, "top_p": self.chat.top_p,
               "text": body.text.model_dump(by_alias=True, exclude_none=True) if body.text
               else {"format": {"type": "text"}},
               "tool_choice": (body.tool_choice.model_dump() if isinstance(body.tool_choice, FunctionChoice)
                               else body.tool_choice or "auto"),
               "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
               "top_logprobs": body.top_logprobs, "truncation": body.truncation or "disabled",
               "usage": None, "user": body.user, "metadata": body.metadata or {}, "background": body.background}
        if gen is not None:
            out["usage"] = response_usage(usage([gen], reasoned and [reasoned]).model_dump(exclude_unset=True))
            out["r2r"] = provenance(gen)
        return out


def failure(message: str, status: int, code: str | None) -> dict:
    """A failed response's error: the reason a request's own settings ended it (below 500, as its 400 would say),
    else a server error."""
    return {"code": code if status < 500 and code else "server_error", "message": message}


def response_usage(chat: dict) -> dict:
    """A chat reply's usage as the Responses API counts it, R2R's figures beside."""
    details = chat.pop("completion_tokens_details", None) or {}
    cached = chat.pop("prompt_tokens_details")["cached_tokens"]
    return {"input_tokens": chat.pop("prompt_tokens"), "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat.pop("completion_tokens"),
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens") or 0},
            "total_tokens": chat.pop("total_tokens"), **chat}


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or new_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def text_part(text: str, logprobs: list[dict] | None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(text: str, logprobs: list[dict] | None, status: str = "completed",
                 item_id: str | None = None) -> dict:
    return {"id": item_id or new_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text, logprobs)]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {"id": item_id or new_id("fc"), "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def logprob_entries(logprobs) -> list[dict]:
    """Chat's per-token log-probabilities as the Responses API lists them (the same fields)."""
    return [entry.model_dump() for entry in logprobs.content] if logprobs is not None else []


def whole_response(draft: Draft, reply: Reply, gen: Generation) -> dict:
    """A finished reply as a response: its thinking, its answer's text, its calls. The answer's log-probabilities
    are its tokens' after the thinking."""
    parts = reply.parts(gen)
    status = "incomplete" if gen.finish_reason == "length" else "completed"
    output = [reasoning_item(parts.thinking)] if parts.thinking is not None else []
    if parts.shows_text():
        thought = parts.reasoned.reasoning_tokens if parts.reasoned else 0
        logprobs = logprob_entries(reply.logprobs(gen, thought, len(gen.token_ids)))
        output.append(message_item(parts.content, logprobs if gen.logprobs is not None else None, status))
    output += [call_item(reply.tools.call_id(), call.name, call.arguments) for call in parts.calls]
    return draft.response(status, output, gen, parts.reasoned)


# ---- the stream --------------------------------------------------------------------------------------------------

@dataclass
class Events:
    """A response's stream as the API's typed events (`event:` and `data:` lines, each numbered), and the output
    items they build: one item open at a time, closed when another kind of output starts."""

    draft: Draft
    sequence_number: int = 0
    output: list[dict] = field(default_factory=list)
    open: dict | None = None  # the item being written
    call_items: dict[int, dict] = field(default_factory=dict)  # a call's index in the reply -> its item
    held: str = ""  # answer text that is only whitespace so far: a message opens once text comes
    logprobs: list[dict] = field(default_factory=list)  # the open message's entries not yet sent

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def start(self, item: dict) -> list[str]:
        out = self.close()
        self.output.append(item)
        self.open = item
        out.append(self.event("response.output_item.added", output_index=len(self.output) - 1, item=item))
        if item["type"] == "reasoning":
            out.append(self.event("response.content_part.added", **self.where(), content_index=0,
                                  part={"type": "reasoning_text", "text": ""}))
        elif item["type"] == "message":
            out.append(self.event("response.content_part.added", **self.where(), content_index=0,
                                  part=text_part("", [])))
        return out

    def close(self, status: str = "completed") -> list[str]:
        item, out = self.open, []
        if item is None:
            return out
        where = self.where()
        item["status"] = status
        if item["type"] == "reasoning":
            part = item["content"][0]
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"]))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        elif item["type"] == "message":
            part = item["content"][0]
            part["logprobs"] += self.logprobs
            self.logprobs = []
            out.append(self.event("response.output_text.done", **where, content_index=0, text=part["text"],
                                  logprobs=part["logprobs"]))
            out.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        else:
            out.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                  arguments=item["arguments"]))
        out.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        self.open = None
        return out

    def thinking(self, text: str) -> list[str]:
        out = [] if self.open and self.open["type"] == "reasoning" else self.start(
            reasoning_item("", "in_progress"))
        self.open["content"][0]["text"] += text
        return out + [self.event("response.reasoning_text.delta", **self.where(), content_index=0, delta=text)]

    def answer(self, text: str, logprobs: list[dict]) -> list[str]:
        self.logprobs += logprobs
        if not (self.open and self.open["type"] == "message"):
            if not (self.held + text).strip():
                self.held += text
                return []
            text, self.held = self.held + text, ""
            out = self.start(message_item("", [], "in_progress"))
        else:
            out = []
        part = self.open["content"][0]
        part["text"] += text
        part["logprobs"] += self.logprobs
        out.append(self.event("response.output_text.delta", **self.where(), content_index=0, delta=text,
                              logprobs=self.logprobs))
        self.logprobs = []
        return out

    def call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> list[str]:
        out = []
        if index not in self.call_items:
            out += self.start(call_item(call_id, name, "", "in_progress"))
            self.call_items[index] = self.open
        item = self.call_items[index]
        if arguments and item is self.open:
            item["arguments"] += arguments
            out.append(self.event("response.function_call_arguments.delta", **self.where(), delta=arguments))
        return out

    def finish(self, status: str) -> list[str]:
        out = self.close(status if self.open and self.open["type"] == "message" else "completed")
        if not self.output:  # a reply with nothing in it still answers with a message
            out += self.start(message_item("", [], "in_progress"))
            self.open["content"][0]["text"] = self.held
            out += self.close(status)
        return out


async def response_events(job: Job, reply: Reply, draft: Draft, keep: Callable[[dict, Draft], None]):
    """A response streamed: created and in progress, then its items as the reply is written (thinking, answer text,
    calls: added, their deltas, done), then completed (or incomplete, at max_output_tokens), with the whole
    response; an error fails it, saying so."""
    events, logprobs = Events(draft), draft.chat.logprobs
    started = draft.response("in_progress", [])
    yield events.event("response.created", response=started)
    yield events.event("response.in_progress", response=started)
    async with aclosing(choice_deltas(job, reply)) as deltas:
        async for delta in deltas:
            if isinstance(delta, StreamFailure):
                for chunk in events.close("incomplete"):
                    yield chunk
                failed = draft.response("failed", events.output, error=failure(delta.message, delta.status,
                                                                                  delta.code))
                yield events.event("response.failed", response=failed)
                return
            if delta.thinking:
                for chunk in events.thinking(delta.thinking):
                    yield chunk
            entries = logprob_entries(delta.logprobs) if logprobs and delta.in_answer else []
            if delta.content or entries:
                for chunk in events.answer(delta.content, entries):
                    yield chunk
            for call in delta.calls:
                for chunk in events.call(call.index, call.id, call.function.name, call.function.arguments or ""):
                    yield chunk
            if delta.finished:
                status = "incomplete" if delta.finish_reason == "length" else "completed"
                for chunk in events.finish(status):
                    yield chunk
                response = draft.response(status, events.output, job.sequence.generation, delta.reasoned)
                if draft.body.store:
                    keep(response, draft)
                yield events.event(f"response.{status}", response=response)





