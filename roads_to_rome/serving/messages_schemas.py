"""The Messages API's request (Anthropic's `/v1/messages`, `/v1/messages/count_tokens`): its blocks, tools, thinking
and output settings, the fields it refuses by name, and the chat it becomes (`MessagesBody.chat_request`);
messages.py renders the answer."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from roads_to_rome.serving.chat_schemas import ChatBody
from roads_to_rome.serving.errors import APIError
from roads_to_rome.serving.schemas import NullIsDefault, Number, Text, renamed


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
                  Discriminator(block_kind, custom_error_type="block_type",
                                custom_error_message="a content block here is text, tool_use, tool_result or thinking: "
                                                     "this server reads no images or documents")]


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


class MessagesBody(NullIsDefault):
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
        names = self.names()
        try:
            return ChatBody.model_validate(chat).in_api(names)
        except ValidationError as e:
            raise RequestValidationError([{**error, "loc": ("body", *renamed(".".join(map(str, error["loc"])),
                                                                             names).split("."))}
                                          for error in e.errors()]) from None

    def names(self) -> dict[str, tuple[str, bool]]:
        """Chat fields as this request named them (`CommonBody.in_api`): its stop sequences, the format it gave
        (`output_format` or vLLM's `output_config.format`), and its messages, whose indices are not the chat's (a
        system prompt and tool results are messages of their own there)."""
        given = "output_format" if self.output_format is not None else "output_config.format"
        return {"stop": ("stop_sequences", True), "response_format.json_schema.schema": (f"{given}.schema", True),
                "response_format": (given, False), "messages": ("messages", False)}


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
