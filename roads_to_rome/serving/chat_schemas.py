"""What a chat request may send: messages and their parts, tools and the choice among them, and the chat body
(`ChatBody`) that Responses and Messages turn their bodies into."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from roads_to_rome.core.grammar import OutputFormat
from roads_to_rome.core.sampling import (
    MAX_LOGPROBS,
)
from roads_to_rome.serving.errors import APIError
from roads_to_rome.serving.schemas import CommonBody, Text
from roads_to_rome.tool_calls import CLOSE, ToolParser, call_format


class TextPart(BaseModel):
    """A message's content given as parts: text, or an assistant's refusal handed back (read as its text, as vLLM
    reads it). This server's models read text: an image, audio or file part is a 400 naming its type."""

    type: Literal["text", "refusal"]
    text: Text | None = None
    refusal: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def text_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind not in ("text", "refusal"):
            raise ValueError(f"a part of type {kind[:40]!r}: this server's models read text only, so a part is of "
                             "type text (or an assistant's refusal)")
        return data

    @model_validator(mode="after")
    def given(self):
        if getattr(self, self.type) is None:
            raise ValueError(f"a part of type {self.type} holds its {self.type}")
        return self

    def value(self) -> str:
        return getattr(self, self.type)


def json_object_text(text: str) -> str:
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ValueError(f"is not valid JSON ({e}): a call's arguments are a JSON object's text") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object's text")
    return text


class CalledFunction(BaseModel):
    name: str
    arguments: Annotated[str, AfterValidator(json_object_text)]


class MessageToolCall(BaseModel):
    """A call an earlier assistant message made, as the client hands it back."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer: to which call
    # An assistant's thinking, handed back (vLLM's names): templates that show it (Qwen3's, for the turns after the
    # last user message: a tool loop's) get it as `reasoning_content`; others leave it out.
    reasoning_content: Text | None = None
    reasoning: Text | None = None

    @model_validator(mode="after")
    def complete(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"only an assistant message holds tool_calls, not a {self.role} one")
        if (self.reasoning_content is not None or self.reasoning is not None) and self.role != "assistant":
            raise ValueError(f"only an assistant message holds its thinking, not a {self.role} one")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is missing (only an assistant message with tool_calls may leave it out)")
        return self

    def text(self) -> str | None:
        if isinstance(self.content, list):
            return "".join(part.value() for part in self.content)
        return self.content

    def for_template(self) -> dict:
        """The message as chat templates read it: its text; `developer` (OpenAI's newer name) as `system`; earlier
        calls' arguments as objects (templates write them with `tojson`)."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in self.tool_calls]
        thinking = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        out.update({k: v for k, v in (("name", self.name), ("tool_call_id", self.tool_call_id),
                                      ("reasoning_content", thinking)) if v is not None})
        return out


class FunctionDefinition(BaseModel):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]  # OpenAI's rule
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


@dataclass
class ToolUse:
    """How a chat request uses its tools: those its prompt shows, how its reply is read, what holds it to calls."""

    prompt_tools: list[dict] | None  # what the chat template gets (None: no tools in the prompt)
    parser: ToolParser | None  # reads calls out of the reply (None: not read)
    output_format: OutputFormat | None = None  # "required" or a named function: the reply is calls
    one: bool = False  # parallel_tool_calls: false, a single call
    stop: tuple[str, ...] = ()


class ChatPrompt(BaseModel):
    """A chat as the model's template writes it into a prompt: what a chat request and /tokenize share."""

    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: variables the chat template reads
    chat_template: Text | None = None  # vLLM's: the request's own template (a server that trusts them only)
    tools: list[Tool] | None = None
    # vLLM's: whether the prompt ends with the assistant's turn opened, or with the last message left open (the
    # reply goes on writing it: a prefill)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def template_in_kwargs(self):
        """vLLM takes the request's template from `chat_template_kwargs` too."""
        kwargs = self.chat_template_kwargs or {}
        if self.chat_template is None and isinstance(kwargs.get("chat_template"), str):
            self.chat_template = kwargs["chat_template"]
            self.chat_template_kwargs = {k: v for k, v in kwargs.items() if k != "chat_template"}
        return self

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template gets them (OpenAI's shape), or None."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def template_options(self) -> dict:
        """How the chat template ends the prompt (`Prompts.messages`), or a 400 naming what to change."""
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise APIError(400, "continue_final_message goes on writing the last message, add_generation_prompt "
                                    "opens a new one: set add_generation_prompt to false",
                               param="add_generation_prompt")
            last = self.messages[-1]
            if last.role != "assistant" or not last.text():
                raise APIError(400, "continue_final_message goes on writing the last message, which must be an "
                                    f"assistant message with text in it (the last one is a {last.role} message"
                                    f"{'' if last.text() else ' without text'})", param=self.named("messages"))
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "template": self.chat_template}


class ChatBody(CommonBody, ChatPrompt):
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    echo: bool = False  # vLLM's: the reply's content starts with the last message's, where that is an assistant's
    # OpenAI's, for reasoning models: handed to the chat template as `reasoning_effort` (as the Responses API's
    # `reasoning.effort`), for templates that read it; others ignore it, as their models have no such setting
    reasoning_effort: Text | None = None
    include_reasoning: bool = True  # vLLM's: false leaves the thinking out of the reply (a reasoning parser's)

    @model_validator(mode="after")
    def effort_to_template(self):
        if self.reasoning_effort is not None:
            self.chat_template_kwargs = {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}
        return self

    def echoed(self) -> list[str] | None:
        """What the reply's content starts with (`echo`): the last message's text, where it is an assistant's."""
        last = self.messages[-1]
        return [last.text()] if self.echo and last.role == "assistant" and last.text() else None

    def top_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_use(self, parser: str | None) -> ToolUse:
        """What the tools and tool_choice ask for, or a 400 naming the field: `parser` is the server's tool-call
        parser for its model (None: its chat template takes no tools)."""
        tools = self.tools or []
        choice = self.tool_choice or ("auto" if tools else "none")
        if not tools:
            if choice in ("none", "auto"):
                return ToolUse(None, None)
            raise APIError(400, "tool_choice asks for a tool call, but the request offers no tools",
                           param="tool_choice")
        names = [tool.function.name for tool in tools]
        if len(set(names)) < len(names):
            raise APIError(400, "two tools have the same name: each function's name must be its own", param="tools")
        if choice == "none":
            return ToolUse(None, None)
        if parser is None:
            raise APIError(400, "this model's chat template does not take tools (it shows neither hermes' <tool_call> "
                                "syntax, Llama 3's JSON calls nor Mistral's [TOOL_CALLS]), so the server cannot read "
                                "calls from its replies; if it does take them, start the server with "
                                "--tool-call-parser hermes, llama3_json or mistral", param="tools")
        use = ToolUse(self.template_tools(), ToolParser(frozenset(names), parser), one=not self.parallel_tool_calls)
        if choice == "auto":
            use.stop = (CLOSE,) if parser == "hermes" and not self.parallel_tool_calls else ()
            return use
        if self.structured_outputs or (self.response_format and self.response_format.type != "text"):
            raise APIError(400, "tool_choice required or a named function holds the reply to tool calls: leave "
                                f"{self.named('response_format')} and structured_outputs out", param="tool_choice")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools "
                                    f"({', '.join(names)})", param="tool_choice")
            functions, use.one = [t.function for t in tools if t.function.name == choice.function.name], True
        else:
            functions = [t.function for t in tools]
        use.output_format = call_format([f.model_dump(exclude_none=True) for f in functions], use.one, parser)
        return use  # (compiled, and checked, off the event loop: server.compiled_format)


class TokenizeChat(ChatPrompt):
    """vLLM's /tokenize for messages, in the chat template as a chat request's prompt."""

    model_config = ConfigDict(extra="forbid")
    requested: str | None = Field(None, alias="model")
    add_special_tokens: bool = False  # special tokens beside the template's own (a BOS)
    return_token_strs: bool = False
