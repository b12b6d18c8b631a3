"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), as vLLM and llama.cpp's server serve it
for clients written against it (the `anthropic` package, agents built on it): a request's system prompt and messages
become a chat, which the chat path answers (tools, thinking, structured outputs and R2R's knobs alike), and the reply
comes back as content blocks: the thinking as a `thinking` block, the answer as `text`, each call as `tool_use`;
whole, or streamed as the API's events. Errors have Anthropic's shape (`errors.shaped`), and the API key
may come as its `x-api-key` header."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from roads_to_rome.core.request import Generation
from roads_to_rome.serving.chat_schemas import ChatBody
from roads_to_rome.serving.engine_thread import Job
from roads_to_rome.serving.errors import APIError
from roads_to_rome.serving.replies import Reply, StreamFailure, choice_deltas, new_id, provenance, usage
from roads_to_rome.serving.schemas import Number, Text

# ---- the request -------------------------------------------------------------------------------------------------

class TextBlock(BaseModel):
    model_config = ConfigDict(extra="allow")  # cache_control, citations: hints this server has no use for
    type: Literal["text"]
    text: Text


class ToolUseBlock(BaseModel):
    """A call an earlier reply made, handed back."""

    model_config = ConfigDict(extra="allow")
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    """A tool's answer to a call."""

    model_config = ConfigDict(extra="allow")
    type: Literal["tool_result"]
    tool_use_id: str
    content: Text | list[TextBlock] = ""
    is_error: bool = False  # (chat templates have no room for it: the result's text says what happened)


class ThinkingBlock(BaseModel):
    """An earlier reply's thinking, handed back: its message's `reasoning_content`, for templates that show it
    (Qwen3's, within a tool loop); others leave it out. Redacted thinking holds none."""

    model_config = ConfigDict(extra="allow")  # signature, data
    type: Literal["thinking", "redacted_thinking"]
    thinking: Text | None = None


def block_kind(block: Any) -> str | None:
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    return "thinking" if kind == "redacted_thinking" else kind


# Images and documents are refused by their type: this server reads text.
Block = Annotated[Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
                  | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")],
                  Discriminator(block_kind)]


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: Text | list[Block]


class Tool(BaseModel):
    """A tool the model may call. Anthropic's server tools (web search, code execution, ...) are refused by their
    type: this server runs none."""

    model_config = ConfigDict(extra="allow")  # cache_control
    type: Literal["custom"] | None = None
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(BaseModel):
    """Whether the model thinks first: `enabled` and `disabled` are handed to the chat template as `enable_thinking`
    (Qwen3's templates read it; others think as they do); `adaptive` leaves it to the template. The budget is not a
    cap here: max_tokens is."""

    model_config = ConfigDict(extra="allow")  # display
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None


class OutputFormat(BaseModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="allow")  # effort: a hint to Anthropic's models
    format: OutputFormat | None = None


# Chat fields the Messages API has no place for in its reply: a request that sends one is told where to go instead
CHAT_FIELDS = {"n": "send one request per answer", "logprobs": "ask /v1/chat/completions for them",
               "top_logprobs": "ask /v1/chat/completions for them", "echo": "ask /v1/completions for the prompt's",
               "prompt_logprobs": "ask /v1/completions for them"}
# Fields for what this server does not do, refused unless absent
UNDONE = {"mcp_servers": "MCP servers (give the tools themselves)", "container": "code execution containers",
          "context_management": "context editing (send the conversation as it should be read)"}


class MessagesBody(BaseModel):
    """A Messages request. Fields it does not name are vLLM's and R2R's extras (seed, min_p, r2r_policy, ...) and go
    to the chat path as they are."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    requested: str | None = Field(None, alias="model")
    messages: list[Message] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    max_tokens: int = Field(ge=1)
    stop_sequences: list[Text] | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_format: OutputFormat | None = None  # structured outputs
    output_config: OutputConfig | None = None  # ... as vLLM takes them
    stream: bool = False
    metadata: dict[str, Any] | None = None

    def checked(self) -> None:
        extra = self.model_extra or {}
        for name, instead in CHAT_FIELDS.items():
            if name in extra:
                raise APIError(400, f"{name} is a chat completions field, which the Messages API does not have: "
                                    f"{instead}", param=name, code="unsupported_parameter")
        for name, what in UNDONE.items():
            if extra.get(name) not in (None, [], {}):
                raise APIError(400, f"{name}: this server does not do {what}", param=name)

    def chat_request(self, stream: bool | None = None) -> ChatBody:
        """The chat that answers this request; a 400 names the Messages field."""
        extra = {k: v for k, v in (self.model_extra or {}).items() if k not in UNDONE and k != "service_tier"}
        system = self.system if isinstance(self.system, str) or self.system is None else \
            "".join(block.text for block in self.system)
        messages = ([{"role": "system", "content": system}] if system else []) + chat_messages(self.messages)
        chat: dict[str, Any] = {**extra, "messages": messages, "max_tokens": self.max_tokens,
                                "stream": self.stream if stream is None else stream}
        if self.requested is not None:
            chat["model"] = self.requested
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                chat[name] = getattr(self, name)
        if self.stop_sequences:
            chat["stop"] = self.stop_sequences
        if self.tools:
            chat["tools"] = [{"type": "function", "function": {
                "name": tool.name, "parameters": tool.input_schema,
                **({"description": tool.description} if tool.description is not None else {})}}
                for tool in self.tools]
        choice = self.tool_choice
        if choice is not None:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or {
                "type": "function", "function": {"name": choice.name}}
            if choice.type == "tool" and choice.name is None:
                raise APIError(400, "tool_choice of type tool names the tool: give its name", param="tool_choice")
            chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
        fmt = self.output_format or (self.output_config.format if self.output_config else None)
        if fmt is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
        if self.thinking is not None and self.thinking.type in ("enabled", "disabled"):
            chat["chat_template_kwargs"] = {**(extra.get("chat_template_kwargs") or {}),
                                            "enable_thinking": self.thinking.type == "enabled"}
        try:
            return ChatBody.model_validate(chat)
        except ValidationError as e:
            raise RequestValidationError([{**error, "loc": ("body", *error["loc"])} for error in e.errors()]) \
                from None


class CountTokensBody(MessagesBody):
    """A count_tokens request: a Messages request without max_tokens."""

    max_tokens: int | None = Field(None, ge=1)


def chat_messages(messages: list[Message]) -> list[dict]:
    """Messages as a chat: an assistant's thinking, text and calls in one message; in a user's, each tool result a
    `tool` message (in the order given) and its text a user message."""
    out: list[dict] = []
    for message in messages:
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
            continue
        if message.role == "assistant":
            text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
            calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                     for b in message.content if isinstance(b, ToolUseBlock)]
            thought = [b.thinking for b in message.content if isinstance(b, ThinkingBlock) and b.thinking]
            out.append({"role": "assistant", "content": text if text or not calls else None,
                        **({"tool_calls": calls} if calls else {}),
                        **({"reasoning_content": "".join(thought)} if thought else {})})
            continue
        text: list[str] = []
        for block in message.content:
            if isinstance(block, ToolResultBlock):
                if text:
                    out.append({"role": "user", "content": "".join(text)})
                    text = []
                result = block.content if isinstance(block.content, str) else "".join(b.text for b in block.content)
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": result})
            elif isinstance(block, TextBlock):
                text.append(block.text)
            elif isinstance(block, ToolUseBlock):
                raise APIError(400, "a tool_use block is an assistant's: a user message holds tool_result blocks",
                               param="messages")
        if text:
            out.append({"role": "user", "content": "".join(text)})
    return out


# ---- the reply ---------------------------------------------------------------------------------------------------

def stop_reason(gen: Generation, calls: int, sequences: tuple[str, ...]) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence: the token limit, calls made, one of the request's stop
    `sequences`, or the end."""
    if gen.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(gen.stop_reason, str) and gen.stop_reason in sequences:
        return "stop_sequence", gen.stop_reason
    return "end_turn", None


def message_usage(gen: Generation | None, prompt_tokens: int, reasoned=None) -> dict:
    """Anthropic's usage, R2R's figures beside: the prompt tokens prefix caching found are
    `cache_read_input_tokens`, apart from `input_tokens` (the API's rule: the three together are the prompt)."""
    if gen is None:
        return {"input_tokens": prompt_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0}
    chat = usage([gen], reasoned and [reasoned]).model_dump(exclude_unset=True)
    chat.pop("completion_tokens_details", None)
    cached = chat.pop("prompt_tokens_details")["cached_tokens"]
    return {"input_tokens": chat.pop("prompt_tokens") - cached, "output_tokens": chat.pop("completion_tokens"),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            **{k: v for k, v in chat.items() if k != "total_tokens"}}


@dataclass
class MessageDraft:
    model_name: str
    prompt_tokens: int
    stop_sequences: tuple[str, ...] = ()  # the request's
    id: str = field(default_factory=lambda: new_id("msg"))

    def message(self, content: list[dict], gen: Generation | None = None, reason: tuple = (None, None),
                reasoned=None) -> dict:
        out = {"id": self.id, "type": "message", "role": "assistant", "model": self.model_name, "content": content,
               "stop_reason": reason[0], "stop_sequence": reason[1],
               "usage": message_usage(gen, self.prompt_tokens, reasoned)}
        if gen is not None:
            out["r2r"] = provenance(gen)
        return out


def call_input(arguments: str) -> dict:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def whole_message(draft: MessageDraft, reply: Reply, gen: Generation) -> dict:
    """A finished reply as a message: its thinking, its answer's text, its calls."""
    parts = reply.parts(gen)
    blocks = [{"type": "thinking", "thinking": parts.thinking, "signature": ""}] if parts.thinking is not None else []
    if parts.shows_text():
        blocks.append({"type": "text", "text": parts.content})
    blocks += [{"type": "tool_use", "id": new_id("toolu"), "name": call.name, "input": call_input(call.arguments)}
               for call in parts.calls]
    return draft.message(blocks, gen, stop_reason(gen, len(parts.calls), draft.stop_sequences), parts.reasoned)


@dataclass
class Events:
    """A message's stream as the API's events, and the blocks they build: one block open at a time."""

    draft: MessageDraft
    blocks: list[dict] = field(default_factory=list)
    open: str | None = None  # the open block's kind
    held: str = ""  # answer text that is only whitespace so far: a text block opens once text comes
    calls: dict[int, int] = field(default_factory=dict)  # a call's index in the reply -> its block's

    @staticmethod
    def event(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    def start(self, block: dict, kind: str) -> list[str]:
        out = self.close()
        self.blocks.append(block)
        self.open = kind
        return out + [self.event("content_block_start", index=len(self.blocks) - 1, content_block=block)]

    def close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [self.event("content_block_stop", index=len(self.blocks) - 1)]

    def delta(self, **delta) -> str:
        return self.event("content_block_delta", index=len(self.blocks) - 1, delta=delta)

    def thinking(self, text: str) -> list[str]:
        out = [] if self.open == "thinking" else self.start({"type": "thinking", "thinking": "", "signature": ""},
                                                            "thinking")
        self.blocks[-1]["thinking"] += text
        return out + [self.delta(type="thinking_delta", thinking=text)]

    def text(self, text: str) -> list[str]:
        out = []
        if self.open != "text":
            if not (self.held + text).strip():
                self.held += text
                return []
            text, self.held = self.held + text, ""
            out = self.start({"type": "text", "text": ""}, "text")
        self.blocks[-1]["text"] += text
        return out + [self.delta(type="text_delta", text=text)]

    def call(self, index: int, name: str | None, arguments: str) -> list[str]:
        out = []
        if index not in self.calls:
            out = self.start({"type": "tool_use", "id": new_id("toolu"), "name": name, "input": {}}, "tool_use")
            self.calls[index] = len(self.blocks) - 1
            self.blocks[-1]["arguments"] = ""
        block = self.blocks[self.calls[index]]
        if arguments and self.calls[index] == len(self.blocks) - 1:
            block["arguments"] += arguments
            out.append(self.delta(type="input_json_delta", partial_json=arguments))
        return out

    def finish(self) -> list[str]:
        out = self.close()
        if not self.blocks:  # a reply with nothing in it still answers with a text block
            out += self.start({"type": "text", "text": ""}, "text")
            if self.held:
                self.blocks[-1]["text"] = self.held
                out.append(self.delta(type="text_delta", text=self.held))
            out += self.close()
        for block in self.blocks:
            if block["type"] == "tool_use":
                block["input"] = call_input(block.pop("arguments"))
        return out


async def message_events(job: Job, reply: Reply, draft: MessageDraft):
    """A message streamed: message_start, then its blocks as the reply is written (start, deltas, stop), then
    message_delta with the stop reason and usage, and message_stop; an error is an `error` event."""
    events, ended = Events(draft), [None]
    yield events.event("message_start", message=draft.message([]))
    try:
        async for delta in choice_deltas(job, reply, 0, ended):
            if isinstance(delta, StreamFailure):
                for chunk in events.close():
                    yield chunk
                yield events.event("error", error={"type": "api_error", "message": delta.message})
                return
            pieces = []
            if delta.thinking:
                pieces += events.thinking(delta.thinking)
            if delta.content:
                pieces += events.text(delta.content)
            for call in delta.calls:
                pieces += events.call(call.index, call.function.name, call.function.arguments or "")
            for chunk in pieces:
                yield chunk
            if delta.finished:
                for chunk in events.finish():
                    yield chunk
                gen = job.sequence.generation
                reason = stop_reason(gen, len(events.calls), draft.stop_sequences)
                whole = message_usage(gen, draft.prompt_tokens, ended[0][1])
                yield events.event("message_delta", delta={"stop_reason": reason[0], "stop_sequence": reason[1]},
                                   usage=whole, r2r=provenance(gen))
                yield events.event("message_stop")
    finally:
        if ended[0] is None or ended[0][0] != "finished":
            job.sequence.cancelled = True  # the client went away (or an error): free the slot
