"""The Responses API's request (OpenAI's `/v1/responses`): its input items, tools, text format and reasoning settings,
the chat fields it says another way and what it refuses by name, and the chat it becomes
(`ResponsesBody.chat_request`); responses.py renders the answer."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, ValidationError

from roads_to_rome.serving.chat_schemas import ChatBody, json_object_text
from roads_to_rome.serving.errors import APIError
from roads_to_rome.serving.schemas import NullIsDefault, Number, Text, renamed

LOGPROBS = "message.output_text.logprobs"  # what `include` names to get the answer's log-probabilities
# What else `include` may name (OpenAI's values): outputs of hosted tools and images this server does not make, and
# encrypted thinking it does not keep (its reasoning items carry the thinking itself), so there is nothing to add. A
# value not among them is a 400 listing them: a misspelt one would otherwise leave out what was asked for.
Included = Literal["message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
                   "web_search_call.results", "web_search_call.action.sources", "code_interpreter_call.outputs",
                   "computer_call_output.output.image_url", "message.input_image.image_url"]


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


class ResponsesBody(NullIsDefault):
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
    include: list[Included] | None = None
    top_logprobs: int | None = None
    stream: bool = False
    store: bool = True
    background: bool = False  # answered at once, queued; the client fetches the response (GET) once it is done
    previous_response_id: str | None = None
    # OpenAI's limits: kept with the response and sent back with it
    metadata: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                        Field(max_length=16)] | None = None
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


# Chat fields as a Responses request names them (`CommonBody.in_api`): name, and whether what follows stays (an input
# item's index is not a message's: `input` alone)
NAMES = {"max_tokens": ("max_output_tokens", True), "max_completion_tokens": ("max_output_tokens", True),
         "response_format.json_schema": ("text.format", True), "response_format": ("text.format", True),
         "messages": ("input", False)}
