"""OpenAI's Responses API (`/v1/responses`), as vLLM serves it: a request's input items become a chat, which the chat
path answers (tools, thinking, structured outputs and R2R's knobs alike), and the reply comes back as output items:
the thinking as a `reasoning` item, the answer as a `message`, each tool call as a `function_call`; whole, streamed
as the API's typed events, or in the background (answered at once as queued, fetched when done). Responses are kept
(`store`, the default) for a later request to go on from (`previous_response_id`) and for GET, DELETE and cancel: in
memory, the least recently used dropped beyond a budget."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationError

from roads_to_rome.core.request import Generation
from roads_to_rome.serving.chat_schemas import ChatBody, json_object_text
from roads_to_rome.serving.engine_thread import ErrorReply, Job
from roads_to_rome.serving.errors import APIError
from roads_to_rome.serving.replies import Reply, StreamFailure, choice_deltas, new_id, provenance, usage
from roads_to_rome.serving.schemas import Number, Text, renamed

LOGPROBS = "message.output_text.logprobs"  # what `include` names to get the answer's log-probabilities


# ---- the request -------------------------------------------------------------------------------------------------

class ContentPart(BaseModel):
    """A message's text part. Parts that are not text (images, files, audio) are refused by their type."""

    model_config = ConfigDict(extra="allow")  # annotations and log-probabilities of an output handed back
    type: Literal["input_text", "output_text", "refusal"]
    text: Text | None = None
    refusal: Text | None = None

    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


def text_of(content: str | list[ContentPart]) -> str:
    return content if isinstance(content, str) else "".join(part.value() for part in content)


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="allow")  # id, status: an earlier output handed back
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[ContentPart]


class FunctionCallItem(BaseModel):
    """A call an earlier reply made, handed back."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: Annotated[str, AfterValidator(json_object_text)]


class FunctionCallOutputItem(BaseModel):
    """A tool's answer to a call."""

    model_config = ConfigDict(extra="allow")
    type: Literal["function_call_output"]
    call_id: str
    output: Text | list[ContentPart]


class ReasoningPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(BaseModel):
    """An earlier reply's thinking, handed back: it goes with the assistant's message after it, as its
    `reasoning_content`, for templates that show it (Qwen3's, within a tool loop); others leave it out."""

    model_config = ConfigDict(extra="allow")  # id, status, encrypted_content
    type: Literal["reasoning"]
    content: list[ReasoningPart] | None = None
    summary: list[ReasoningPart] = []

    def text(self) -> str:
        return "".join(part.text for part in (self.content or self.summary))


def one_message(given: Any) -> Any:
    """An input given as text is one user message."""
    return [{"role": "user", "content": given}] if isinstance(given, str) else given


def item_kind(item: Any) -> str | None:
    return item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(item_kind)]


class FunctionTool(BaseModel):
    """A function the model may call (the Responses API's flat shape). Hosted tools (web search, file search, code
    interpreter, MCP) are refused by their type: this server runs none."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # a hint to OpenAI's models; the default is what every model does


class ReasoningConfig(BaseModel):
    # Handed to the chat template as `reasoning_effort` (vLLM's rule): templates that read it (gpt-oss's) follow it.
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    # A summary of the thinking: this server hands the thinking itself (the reasoning item's `content`), none
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


# Chat fields that a Responses request says another way: a request that sends one is told which field to use.
CHAT_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
               "response_format": "text.format", "logprobs": f"include: [\"{LOGPROBS}\"]", "n": "one response per "
               "request", "echo": "input", "add_generation_prompt": "input",
               "continue_final_message": "input", "prompt_logprobs": "/v1/completions"}
# Responses fields for what this server does not do, refused unless absent
UNDONE = {"prompt": "stored prompt templates (give the input itself)",
          "conversation": "conversation objects (go on from a response with previous_response_id)",
          "max_tool_calls": "a cap on hosted tool calls (this server runs no hosted tools)"}


class ResponsesBody(BaseModel):
    """A Responses request. Fields it does not name are vLLM's and R2R's extras (top_k, seed, stop, r2r_policy, ...)
    and go to the chat path as they are."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    requested: str | None = Field(None, alias="model")
    input: Annotated[list[InputItem], BeforeValidator(one_message)]
    instructions: Text | None = None
    max_output_tokens: int | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    stream: bool = False
    store: bool = True
    background: bool = False  # answered at once, queued; the client fetches the response (GET) once it is done
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    user: str | None = None

    def checked(self) -> None:
        extra = self.model_extra or {}
        for name, instead in CHAT_FIELDS.items():
            if name in extra:
                raise APIError(400, f"{name} is a chat completions field; the Responses API says it as {instead}",
                               param=name)
        for name, what in UNDONE.items():
            if extra.get(name) not in (None, False):
                raise APIError(400, f"{name}: this server does not do {what}", param=name,
                               code="unsupported_parameter")
        if self.background and not self.store:
            raise APIError(400, "a background response is kept for the client to fetch: leave store true",
                           param="store")
        if self.background and self.stream:
            raise APIError(400, "a background response is fetched when it is done (GET /v1/responses/{id}), not "
                                "streamed: leave stream out, or background", param="stream")

    def chat_request(self, history: list[dict]) -> tuple[ChatBody, list[dict]]:
        """The chat that answers this request: its instructions, the conversation it goes on from (`history`: a
        stored response's), its input; its tools, choice, format and sampling. A 400 names the Responses field.
        With it, the conversation without the instructions (what a stored response keeps)."""
        extra = {k: v for k, v in (self.model_extra or {}).items() if k not in UNDONE and k not in (
            "stream_options", "service_tier", "safety_identifier", "prompt_cache_key")}  # (these change no answer)
        conversation = history + input_messages(self.input)
        instructions = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        messages = instructions + conversation
        chat: dict[str, Any] = {**extra, "messages": messages, "stream": self.stream,
                                "parallel_tool_calls": self.parallel_tool_calls}
        if self.requested is not None:
            chat["model"] = self.requested
        if self.max_output_tokens is not None:
            chat["max_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p"):
            if getattr(self, name) is not None:
                chat[name] = getattr(self, name)
        if self.tools:
            chat["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                             for tool in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text else None
        if fmt is not None and fmt.type == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "output", "schema": fmt.schema_, "strict": fmt.strict}}
        elif fmt is not None:
            chat["response_format"] = {"type": fmt.type}
        if LOGPROBS in (self.include or []):
            chat["logprobs"], chat["top_logprobs"] = True, self.top_logprobs or 0
        elif self.top_logprobs:
            raise APIError(400, f"top_logprobs comes with the answer's log-probabilities: add \"{LOGPROBS}\" to "
                                "include", param="top_logprobs")
        effort = self.reasoning.effort if self.reasoning else None
        if effort is not None:
            chat["chat_template_kwargs"] = {**(extra.get("chat_template_kwargs") or {}), "reasoning_effort": effort}
        try:
            return ChatBody.model_validate(chat).in_api(NAMES), conversation
        except ValidationError as e:
            errors = [{**error, "loc": ("body", *renamed(".".join(map(str, error["loc"])), NAMES).split("."))}
                      for error in e.errors()]
            raise RequestValidationError(errors) from None


def input_messages(given: list) -> list[dict]:
    """Input items as chat messages: calls in a row go into one assistant message (after its text, where the item
    before them is an assistant's message), a tool's answer is a `tool` message, thinking goes with the assistant's
    message after it."""
    messages: list[dict] = []
    thinking: str | None = None  # a reasoning item's, for the next assistant message
    for item in given:
        if isinstance(item, ReasoningItem):
            thinking = (thinking or "") + item.text()
            continue
        last = messages[-1] if messages else None
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": text_of(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if last is not None and last["role"] == "assistant" and thinking is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": text_of(item.output)})
        if thinking is not None and messages[-1] is not last and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning_content"], thinking = thinking, None
    return messages


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


# Chat fields as a Responses request names them (`CommonBody.in_api`): name, and whether what follows stays (an input
# item's index is not a message's: `input` alone)
NAMES = {"max_tokens": ("max_output_tokens", True), "max_completion_tokens": ("max_output_tokens", True),
         "response_format.json_schema": ("text.format", True), "response_format": ("text.format", True),
         "messages": ("input", False)}


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


def listed_items(given: list) -> list[dict]:
    """A request's input items as the API lists them back: each with an id, a message's content as parts."""
    items = []
    for item in given:
        listed = item.model_dump(by_alias=True, exclude_none=True)
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}[item.type]
        listed.setdefault("id", new_id(prefix))
        if item.type == "message" and isinstance(item.content, str):
            kind = "output_text" if item.role == "assistant" else "input_text"
            listed["content"] = [{"type": kind, "text": item.content}]
        items.append({"type": item.type, **listed})
    return items


def conversation_of(response: dict) -> list[dict]:
    """A response's output as chat messages, for a later request to go on from: its thinking, answer and calls in
    one assistant message (templates that show earlier thinking within a tool loop get it)."""
    text, calls, thinking = "", [], None
    for item in response["output"]:
        if item["type"] == "reasoning":
            thinking = (thinking or "") + "".join(part["text"] for part in item["content"])
        elif item["type"] == "message":
            text += "".join(part.get("text", "") for part in item["content"])
        elif item["type"] == "function_call":
            calls.append({"id": item["call_id"], "type": "function",
                          "function": {"name": item["name"], "arguments": item["arguments"]}})
    message = {"role": "assistant", "content": text if text or not calls else None}
    if thinking is not None:
        message["reasoning_content"] = thinking
    return [{**message, "tool_calls": calls} if calls else message]


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


async def response_events(job: Job, reply: Reply, draft: Draft, store: ResponseStore):
    """A response streamed: created and in progress, then its items as the reply is written (thinking, answer text,
    calls: added, their deltas, done), then completed (or incomplete, at max_output_tokens), with the whole
    response; an error fails it, saying so."""
    events, ended, logprobs = Events(draft), [None], draft.chat.logprobs
    started = draft.response("in_progress", [])
    yield events.event("response.created", response=started)
    yield events.event("response.in_progress", response=started)
    try:
        async for delta in choice_deltas(job, reply, 0, ended):
            if isinstance(delta, StreamFailure):
                for chunk in events.close("incomplete"):
                    yield chunk
                failed = draft.response("failed", events.output, error={
                    "code": "server_error", "message": delta.message})
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
                response = draft.response(status, events.output, job.sequence.generation, ended[0][1])
                if draft.body.store:
                    store.put(response, draft)
                yield events.event(f"response.{status}", response=response)
    finally:
        if ended[0] is None or ended[0][0] != "finished":
            job.sequence.cancelled = True  # the client went away (or an error): free the slot


# ---- the store ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Stored:
    """A kept response as the bytes of its JSON, beside the chat it ends (without its instructions: what a later
    request goes on from) and its request's input as the API lists it: the memory it holds is what the store's
    budget counts (parsed objects would take several times their JSON)."""

    blob: bytes

    @classmethod
    def of(cls, response: dict, conversation: list[dict], input_items: list[dict]) -> Stored:
        return cls(json.dumps([response, conversation, input_items], ensure_ascii=False).encode())

    @property
    def size(self) -> int:
        return sys.getsizeof(self.blob)

    @property
    def response(self) -> dict:
        return json.loads(self.blob)[0]

    @property
    def conversation(self) -> list[dict]:
        return json.loads(self.blob)[1]

    @property
    def input_items(self) -> list[dict]:
        return json.loads(self.blob)[2]


class ResponseStore:
    """Responses kept for `previous_response_id`, GET and DELETE: in memory, within `budget` bytes (what they hold
    there: `Stored`), the least recently used dropped first. A server's restart drops them all."""

    def __init__(self, budget: int):
        self.budget, self.size = budget, 0
        self.kept: OrderedDict[str, Stored] = OrderedDict()
        self.running: dict[str, tuple[asyncio.Task, Job, Draft]] = {}  # background responses being written

    def start(self, job: Job, reply: Reply, draft: Draft) -> dict:
        """A background response: kept as queued at once, written on (`in_progress` from its first token), and kept
        again once it is done (or failed)."""
        queued = draft.response("queued", [])
        self.put(queued, draft)
        self.running[draft.id] = (asyncio.create_task(self.finish(job, reply, draft, queued)), job, draft)
        return queued

    async def finish(self, job: Job, reply: Reply, draft: Draft, shown: dict) -> None:
        try:
            while True:
                event = await job.events.get()
                if isinstance(event, ErrorReply):
                    self.put(draft.response("failed", [], error={"code": "server_error", "message": event.message}),
                             draft)
                    return
                if shown["status"] != "in_progress":  # (what a GET meanwhile shows)
                    shown["status"] = "in_progress"
                    self.put(shown, draft)
                if event.finished:
                    break
            self.put(whole_response(draft, reply, job.sequence.generation), draft)
        finally:
            self.running.pop(draft.id, None)

    def cancel(self, response_id: str) -> dict:
        """A background response stopped where it is (one that is done is left as it is); a 404 or 400 naming it
        when there is none to cancel."""
        if response_id in self.running:
            task, job, draft = self.running.pop(response_id)
            job.sequence.cancelled = True  # its slot is freed at the engine's next step
            task.cancel()
            self.put(draft.response("cancelled", []), draft)
        stored = self.stored(response_id)
        if not stored.response["background"]:
            raise APIError(400, "only a background response can be cancelled: this one was answered when asked",
                           param="response_id")
        return stored.response

    def get(self, response_id: str) -> Stored | None:
        stored = self.kept.get(response_id)
        if stored is not None:
            self.kept.move_to_end(response_id)
        return stored

    def stored(self, response_id: str) -> Stored:
        """The response kept under this id, or the 404 naming it."""
        stored = self.get(response_id)
        if stored is None:
            raise APIError(404, f"no response {response_id!r} is kept on this server", param="response_id",
                           code="response_not_found")
        return stored

    def put(self, response: dict, draft: Draft) -> None:
        """Keep a response, in place of what was kept under its id (a background one's earlier state)."""
        self.forget(response["id"])
        stored = Stored.of(response, draft.conversation + conversation_of(response), listed_items(draft.body.input))
        if stored.size > self.budget:
            return
        self.kept[response["id"]] = stored
        self.size += stored.size
        while self.size > self.budget:
            self.size -= self.kept.popitem(last=False)[1].size

    def delete(self, response_id: str) -> bool:
        """Forget a response (a background one being written is cancelled first); False when none was kept."""
        if response_id in self.running:
            self.cancel(response_id)
        return self.forget(response_id)

    def forget(self, response_id: str) -> bool:
        stored = self.kept.pop(response_id, None)
        if stored is not None:
            self.size -= stored.size
        return stored is not None

    def history(self, response_id: str | None) -> list[dict]:
        """The conversation a request goes on from: the stored response's (a 404 naming it when it is not kept)."""
        if response_id is None:
            return []
        stored = self.get(response_id)
        if stored is None:
            raise APIError(404, f"previous_response_id {response_id!r} is not kept on this server (responses are "
                                "kept in memory when stored, the least recently used dropped beyond the server's "
                                "budget, all of them at a restart): send the conversation as input instead",
                           param="previous_response_id", code="previous_response_not_found")
        if stored.response["status"] in ("queued", "in_progress"):
            raise APIError(400, f"previous_response_id {response_id!r} is still being written: fetch it (GET "
                                "/v1/responses/{id}) until it is done, then go on from it",
                           param="previous_response_id")
        return stored.conversation
