"""What a client may send: the server's limits, the request bodies, and how a body becomes a `Sequence` or an
OpenAI-style error naming what to fix. Everything a body's types cannot say is checked here, before the request
queues, so nothing a client sends can fail the batch."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.grammar import GrammarWalk, OutputFormat
from roads_to_rome.core.prefix_cache import PREFIX_TOKENS
from roads_to_rome.core.request import Request, Sequence
from roads_to_rome.core.sampling import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    REPETITION_PENALTY_RANGE,
    SamplingParams,
    parse_verify,
)
from roads_to_rome.errors import R2RError
from roads_to_rome.serving import request_ids
from roads_to_rome.tool_calls import CLOSE, ToolParser, call_format


@dataclass
class Limits:
    """Every limit one client's request meets. The defaults follow OpenAI's API and vLLM where they have one."""

    max_batch: int = 8  # requests decoding (or having their prompt read) at once
    max_queue: int = 64  # requests waiting for a slot; beyond that: 429
    max_tokens: int = 4096  # the most new tokens one request may ask for
    context_length: int = 32768  # prompt + new tokens of one request
    # Prompt tokens read per model between two decode steps: large enough to read a prompt near the best rate,
    # small enough that running streams keep getting tokens while it is read (README, "Serving").
    prefill_chunk: int = 64
    # Prompt tokens each model keeps read for newcomers whose prompt begins the same way (0: no prefix caching)
    prefix_cache_tokens: int = PREFIX_TOKENS
    # "fcfs": waiting requests are admitted in arrival order; "priority": by their `priority` (lower first), then so
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    max_body_bytes: int = 1 << 20  # a request body's limit (413 beyond): 8x what the longest context holds
    # OpenAI's limit. Every row decodes its tail and searches it for each stop string every step, on the engine
    # thread, and a stream holds back the longest one's length: both stay small.
    max_stop_strings: int = 4
    max_stop_chars: int = 256
    # vLLM's bad_words, each tokenized on arrival and looked up at every token of the row: as many as a long list of
    # slurs and misspellings holds, each a word or a phrase.
    max_bad_words: int = 1024
    max_bad_word_chars: int = 256
    # Token ids one list of a request may name (allowed_token_ids, stop_token_ids, logit_bias), and tools one chat
    # may offer (OpenAI's limit).
    max_token_ids: int = 16384
    max_tools: int = 128
    # A structured output is compiled off the event loop, one at a time; past this it is a 400 naming the field.
    max_compile_seconds: float = 10.0
    # A prompt whose log-probabilities are asked for is read whole as it is admitted, holding up the other streams
    # for as long: at most this many tokens (its logits are looked at in chunks, so memory is not what bounds it).
    max_scored_prompt_tokens: int = 8192
    # A chat template a request brings (--trust-request-chat-template) writes its chat in a process of its own,
    # within this time and this much memory beyond what the process holds (a 400 past either).
    max_template_seconds: float = 5.0
    max_template_bytes: int = 128 << 20
    # Long prompts waiting to be tokenized (or being tokenized) at once; beyond that: 429 before anything queues.
    # Short prompts have a lane of their own, so a flood of long ones cannot hold them up.
    max_tokenizing: int = 4
    max_head_seconds: float = 10.0  # a request's line and headers must arrive within this (408; connections.py)
    max_body_seconds: float = 30.0  # a body must arrive within this (408): a trickling client is cut off
    # Requests in the server at once, queued and streaming included (429 beyond); connections open at once, twice
    # this (closed as they open beyond: connections.py).
    max_connections: int = 256
    max_request_seconds: float = 600.0  # a whole (non-streamed) answer's deadline (408)
    drain_timeout: float = 30.0  # seconds in-flight requests get to finish after a shutdown signal
    # The Responses API's stored responses (their JSON), the least recently used dropped beyond it
    responses_store_bytes: int = 64 << 20


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.kind, self.headers)


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   kind: str = "invalid_request_error", headers: dict | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


MESSAGES_PATH = "/v1/messages"  # Anthropic's Messages API (serving/messages.py), whose errors have its shape
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                         429: "rate_limit_error", 503: "overloaded_error"}


def shaped(path: str, response: Response) -> Response:
    """An error answer as the API at `path` shapes errors: OpenAI's (`error_response`), or on the Messages API's
    routes Anthropic's (`{"type": "error", "error": {"type", "message"}}`)."""
    if not (path.startswith(MESSAGES_PATH) and isinstance(response, JSONResponse)):
        return response
    error = json.loads(response.body)["error"]
    body = {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(response.status_code, "api_error"),
                                       "message": error["message"]}}
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    return JSONResponse(body, status_code=response.status_code, headers=headers)


LLM_RETRY_AFTER_S = 5  # what a request refused while the LLM is away is told (Retry-After): the probe's pace
LLM_AWAY = "the LLM is unavailable at the moment; retry later (requests with r2r_policy 'slm' still run)"


def llm_away() -> APIError:
    """A request that needs a remote LLM which is away: 503, and when to try again."""
    return APIError(503, LLM_AWAY, code="llm_unavailable", kind="server_error",
                    headers={"Retry-After": str(LLM_RETRY_AFTER_S)})


# ---- request bodies (unknown fields are ignored, as OpenAI clients send many) -----------------

def utf8_text(text: str) -> str:
    """JSON can carry lone UTF-16 surrogates (\\ud800) that no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"is not valid Unicode text: it holds a lone surrogate ({text[e.start]!r}) at {e.start}") \
            from None
    return text


def verify_setting(value):
    try:
        return parse_verify(value)
    except R2RError as e:
        raise ValueError(str(e)) from None


Text = Annotated[str, AfterValidator(utf8_text)]
Number = Annotated[float, Field(allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0, lt=2**31)]
VerifySetting = Annotated[Number | str, AfterValidator(verify_setting)]

# Fields of OpenAI's API (and vLLM's extras) that would change the answer and that this server does not do, with
# the value that changes nothing: a request that sets one otherwise is refused, naming it, rather than answered as if
# it had not been sent.
UNSUPPORTED = {"best_of": 1, "functions": None, "function_call": None,
               "echo": False, "suffix": None, "guided_json": None, "guided_regex": None, "guided_choice": None,
               "guided_grammar": None, "use_beam_search": False,
               "length_penalty": 1.0,
               "logits_processors": None, "web_search_options": None, "audio": None, "modalities": None}
NEUTRAL = {"functions": ([],), "function_call": ("none",), "suffix": ("",), "logits_processors": ([],),
           "modalities": (["text"],)}


class StreamOptions(BaseModel):
    include_usage: bool = False  # OpenAI's: a last chunk with the usage of the whole request
    continuous_usage_stats: bool = False  # vLLM's (with include_usage): each token's chunk with its choice's so far


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # None: any JSON object
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: text (any), json_object (any JSON object) or json_schema; or vLLM's
    structural_tag (free text holding structures, in either of its forms: core/structural_tags.py)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    structures: list[Any] | None = None  # structural_tag's: each {begin, schema, end}
    triggers: list[Any] | None = None  # ... and where the text stops being free
    format: dict[str, Any] | None = None  # structural_tag's other form: xgrammar's format object


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of the formats, and how JSON is spaced. Fields it has that this
    server does not do (dropping additional properties) are refused by name rather than ignored."""

    model_config = ConfigDict(extra="forbid")
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None  # either form (core/structural_tags.py), or it as JSON text
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None

    def output_format(self) -> OutputFormat:
        given = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                 "json_object": self.json_object or None, "structural_tag": self.structural_tag}
        kinds = [k for k, v in given.items() if v is not None]
        if len(kinds) != 1:
            raise APIError(400, f"structured_outputs takes exactly one of {', '.join(given)}; got "
                                f"{', '.join(kinds) or 'none'}", param="structured_outputs")
        kind = kinds[0]
        try:
            return OutputFormat(kind, "" if kind == "json_object" else given[kind], not self.disable_any_whitespace,
                                self.whitespace_pattern)
        except R2RError as e:
            raise APIError(400, str(e), param=f"structured_outputs.{kind}") from None


class CommonBody(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept, to refuse the unsupported ones by name (`check_body`)
    requested: str | None = Field(None, alias="model")  # the model id the client asks for
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = Field(1, ge=1)  # choices per prompt, each its own sequence
    temperature: Number = Field(1.0, ge=0, le=2)  # OpenAI's range
    top_p: Number = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    presence_penalty: Number = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)  # OpenAI's range
    frequency_penalty: Number = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: Number = Field(1.0, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1])  # vLLM's
    min_p: Number = Field(0.0, ge=0, le=1)  # vLLM's
    logit_bias: dict[TokenId, Annotated[Number, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = None  # OpenAI's
    # vLLM's: tokens only these may be, tokens that end the output too, how long it is at least, and what ends it
    allowed_token_ids: list[TokenId] | None = None
    stop_token_ids: list[TokenId] | None = None
    bad_words: list[Text] | None = None  # words the output never holds
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # vLLM's: special tokens the model writes are left out of the text
    # vLLM's, for its slow tokenizers: transformers' tokenizers write special tokens as they are either way
    spaces_between_special_tokens: bool = True
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)  # what a 64-bit generator takes
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None  # OpenAI's structured outputs
    structured_outputs: StructuredOutputs | None = None  # vLLM's
    # vLLM's: each prompt token's log-probability, with this many most likely tokens (core/scoring.py)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_tokens_as_token_ids: bool = False  # vLLM's: log-probabilities name tokens `token_id:N`, not their text
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids beside the text
    # vLLM's: prompts kept for prefix caching are shared only with requests that give the same salt
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    priority: int = Field(0, ge=-(2**31), lt=2**31)  # vLLM's: lower is admitted first (--scheduling-policy priority)
    # vLLM's: names the request in the log and the reply's id where the client sends no X-Request-Id
    request_id: Annotated[str, Field(pattern=f"^{request_ids.USABLE.pattern}$")] | None = None
    # vLLM's: the prompt's last this many tokens only (-1: as many as the server holds per request)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # R2R routing knobs (extra body fields)
    r2r_threshold: Number | None = None
    r2r_llm_rate: Number | None = Field(None, ge=0, le=1)
    r2r_policy: Literal["slm", "llm"] | None = None
    r2r_verify: VerifySetting | None = None  # off, strict or a tolerance in nats (default: the server's)
    r2r_max_unverified: int | None = Field(None, ge=1)

    def top_count(self) -> int | None:
        """How many alternatives each token's log-probability comes with; None: no log-probabilities."""
        raise NotImplementedError

    def prompt_top_count(self) -> int | None:
        """How many alternatives each prompt token's log-probability comes with; None: none asked for."""
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(400, "prompt_logprobs come with the whole reply only: ask with stream: false",
                           param="prompt_logprobs")
        return self.prompt_logprobs

    def prompt_alone(self) -> bool:
        """Whether the reply shows the prompt alone, nothing written after it (completions' echo with max_tokens 0)."""
        return False

    def output_format(self) -> OutputFormat | None:
        """The format the output must follow (`response_format` or `structured_outputs`), or None; a 400 naming the
        field when it is not one. (Whether it can be followed is known once it compiles: server.compiled_format.)"""
        response = self.response_format if self.response_format and self.response_format.type != "text" else None
        if response and self.structured_outputs:
            raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs")
        if self.structured_outputs:
            fmt = self.structured_outputs.output_format()
        elif response is None:
            return None
        elif response.type == "json_object":
            fmt = OutputFormat("json_object")
        elif response.type == "structural_tag":
            given = {"format": response.format, "triggers": response.triggers, "structures": response.structures}
            fmt = OutputFormat("structural_tag", {"type": "structural_tag",
                                                  **{k: v for k, v in given.items() if v is not None}})
        elif response.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs its json_schema (name and schema)",
                           param="response_format.json_schema")
        else:
            schema = response.json_schema.schema_
            return OutputFormat("json_object") if schema is None else OutputFormat.json_schema(schema)
        return fmt

    def format_field(self) -> str:
        """The field `output_format` reads the format from, for an error about it."""
        if self.structured_outputs:
            return "structured_outputs"
        return "response_format.json_schema.schema" if self.response_format.json_schema else "response_format"


class TextPart(BaseModel):
    """A message's content given as parts: this server reads text only (an image part is a 400 naming it)."""

    type: Literal["text"]
    text: Text


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
            return "".join(part.text for part in self.content)
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
        """How the chat template ends the prompt (`Engine.encode_messages`), or a 400 naming what to change."""
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise APIError(400, "continue_final_message goes on writing the last message, add_generation_prompt "
                                    "opens a new one: set add_generation_prompt to false",
                               param="add_generation_prompt")
            last = self.messages[-1]
            if last.role != "assistant" or not last.text():
                raise APIError(400, "continue_final_message goes on writing the last message, which must be an "
                                    f"assistant message with text in it (the last one is a {last.role} message"
                                    f"{'' if last.text() else ' without text'})", param="messages")
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
                                "response_format and structured_outputs out", param="tool_choice")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools "
                                    f"({', '.join(names)})", param="tool_choice")
            functions, use.one = [t.function for t in tools if t.function.name == choice.function.name], True
        else:
            functions = [t.function for t in tools]
        use.output_format = call_format([f.model_dump(exclude_none=True) for f in functions], use.one, parser)
        return use  # (compiled, and checked, off the event loop: server.compiled_format)


PromptText = Annotated[Text, Field(min_length=1)]
PromptIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionBody(CommonBody):
    # A prompt or several, as text or token ids (OpenAI's four shapes); each prompt gets `n` choices.
    prompt: PromptText | Annotated[list[PromptText], Field(min_length=1)] | PromptIds | \
        Annotated[list[PromptIds], Field(min_length=1)]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Text | None = None  # what follows the completion: the model fills in the middle
    echo: bool = False  # the answer's text starts with the prompt's

    def top_count(self) -> int | None:
        if self.echo and self.logprobs is not None and self.stream:
            raise APIError(400, "echo with logprobs gives the prompt's log-probabilities in the whole reply only: "
                                "ask with stream: false", param="stream")
        return self.logprobs

    def prompt_top_count(self) -> int | None:
        """With echo, the logprobs cover the prompt's tokens too (vLLM's rule: prompt_logprobs where given)."""
        given = super().prompt_top_count()
        return given if given is not None or not self.echo else self.logprobs

    def prompt_alone(self) -> bool:
        """vLLM's echo without generation (scoring a prompt): one token is written, and not shown."""
        if not (self.echo and self.max_tokens == 0):
            return False
        if self.stream:
            raise APIError(400, "echo with max_tokens 0 (the prompt alone) comes as the whole reply only: ask with "
                                "stream: false", param="stream")
        return True

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: its text, or its token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


class TokenizeText(BaseModel):
    """vLLM's /tokenize for a text."""

    model_config = ConfigDict(extra="forbid")
    requested: str | None = Field(None, alias="model")
    prompt: Text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(ChatPrompt):
    """vLLM's /tokenize for messages, in the chat template as a chat request's prompt."""

    model_config = ConfigDict(extra="forbid")
    requested: str | None = Field(None, alias="model")
    add_special_tokens: bool = False  # special tokens beside the template's own (a BOS)
    return_token_strs: bool = False


class DetokenizeBody(BaseModel):
    """vLLM's /detokenize."""

    model_config = ConfigDict(extra="forbid")
    requested: str | None = Field(None, alias="model")
    tokens: list[TokenId]


def check_model(requested: str | None, model_name: str) -> None:
    if requested is not None and requested != model_name:
        raise APIError(404, f"the model {requested!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")


def check_body(body: CommonBody, model_name: str, limits: Limits) -> OutputFormat | None:
    """What a body's types cannot say: the model it names, the options this server supports and the stop strings'
    limits (before its prompt is tokenized). Returns the format its output must follow, built once here."""
    check_model(body.requested, model_name)
    for name, value in (body.model_extra or {}).items():
        if name in UNSUPPORTED and value is not None and value != UNSUPPORTED[name] \
                and value not in NEUTRAL.get(name, ()):
            raise APIError(400, f"{name}={value!r} is not supported by this server (it would change the answer); "
                                f"leave it out", param=name, code="unsupported_parameter")
    if body.priority and limits.scheduling_policy != "priority":
        raise APIError(400, "priority orders waiting requests only on a server started with --scheduling-policy "
                            "priority: leave it out (or 0)", param="priority")
    stop_strings(body, limits)
    capped_lists(body, limits)
    body.top_count()
    body.prompt_top_count()
    output_format = body.output_format()
    choices = body.n * (len(body.prompts()) if isinstance(body, CompletionBody) else 1)
    if choices > limits.max_batch + limits.max_queue:
        raise APIError(400, f"the request asks for {choices} choices (n for each prompt); this server holds at most "
                            f"{limits.max_batch + limits.max_queue} sequences at once (--max-batch + --max-queue)",
                       param="n")
    return output_format


def truncated(body: CommonBody, prompt_ids: list[int], limits: Limits) -> list[int]:
    """The prompt as vLLM's `truncate_prompt_tokens` leaves it: its last N tokens (-1: as many as a request holds)."""
    keep = body.truncate_prompt_tokens
    if keep is None:
        return prompt_ids
    if keep == 0:
        raise APIError(400, "truncate_prompt_tokens keeps the prompt's last N tokens: give N of 1 or more, or -1 for "
                            "as many as the server holds", param="truncate_prompt_tokens")
    return prompt_ids[-(limits.context_length if keep == -1 else keep):]


def stop_strings(body: CommonBody, limits: Limits) -> tuple[str, ...]:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > limits.max_stop_strings:
        raise APIError(400, f"stop holds {len(stop)} strings; this server takes at most {limits.max_stop_strings}",
                       param="stop")
    if any(len(s) > limits.max_stop_chars for s in stop):
        raise APIError(400, f"a stop string is at most {limits.max_stop_chars} characters on this server",
                       param="stop")
    return tuple(stop)


def capped_lists(body: CommonBody, limits: Limits) -> None:
    """Every list a body may send holds at most its limit (stop strings: `stop_strings`): what grows with them runs
    on the event loop or at every token."""
    words = body.bad_words or []
    if len(words) > limits.max_bad_words:
        raise APIError(400, f"bad_words holds {len(words)} words; this server takes at most {limits.max_bad_words}",
                       param="bad_words")
    if any(len(w) > limits.max_bad_word_chars for w in words):
        raise APIError(400, f"a bad word is at most {limits.max_bad_word_chars} characters on this server",
                       param="bad_words")
    for name in ("allowed_token_ids", "stop_token_ids", "logit_bias"):
        ids = getattr(body, name) or ()
        if len(ids) > limits.max_token_ids:
            raise APIError(400, f"{name} names {len(ids)} tokens; this server takes at most {limits.max_token_ids}",
                           param=name)
    tools = getattr(body, "tools", None) or ()
    if len(tools) > limits.max_tools:
        raise APIError(400, f"tools offers {len(tools)} tools; this server takes at most {limits.max_tools}",
                       param="tools")


def make_sequences(body: CommonBody, prompt_ids: list[int], engine: Engine, limits: Limits,
                   compiled: GrammarWalk | None = None, thinking_until: int | None = None,
                   stop: tuple[str, ...] = (), banned: tuple[tuple[int, ...], ...] = ()) -> list[Sequence]:
    """The request's `n` choices, each a sequence of its own; with a seed, choice i draws with seed + i (vLLM's
    rule), so that they differ and each can be reproduced. `compiled`: the format the output must follow
    (`check_body`'s, or the tool calls' grammar), compiled once for all choices (`Engine.compile_format`);
    `thinking_until`: the token that closes the reply's thinking, where it starts inside it (a structured output
    applies after it); `stop`: strings that end it beside the client's; `banned`: its bad words as tokens
    (`bad_words`)."""
    if body.n > 1 and body.seed is not None and body.seed + body.n > 2**64:
        raise APIError(400, "with n choices, seed + n - 1 must fit in 64 bits", param="seed")
    first = make_sequence(body, prompt_ids, engine, limits, compiled, thinking_until, stop, banned)
    if body.n == 1:
        return [first]
    params = first.params
    return [first] + [engine.sequence(dataclasses.replace(first.request, params=dataclasses.replace(
        params, seed=None if params.seed is None else params.seed + i)), compiled=compiled) for i in range(1, body.n)]


def make_sequence(body: CommonBody, prompt_ids: list[int], engine: Engine, limits: Limits,
                  compiled: GrammarWalk | None, thinking_until: int | None, stop: tuple[str, ...],
                  banned: tuple[tuple[int, ...], ...]) -> Sequence:
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if body.prompt_alone():
        max_tokens = 1  # (the reply leaves it out)
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1 (0 only with echo: the prompt alone), got {max_tokens}",
                       param="max_tokens")
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise APIError(400, f"max_tokens is at most {limits.max_tokens} on this server", param="max_tokens")
    context = limits.context_length
    room = context - len(prompt_ids)
    if room <= 0 or (max_tokens is not None and max_tokens > room):
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens and max_tokens is {max_tokens}, but this "
                            f"server holds at most {context} tokens per request", param="messages",
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(limits.max_tokens, room)
    if body.prompt_top_count() is not None and len(prompt_ids) > limits.max_scored_prompt_tokens:
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; this server scores prompts of at most "
                            f"{limits.max_scored_prompt_tokens} (echo with logprobs, prompt_logprobs): score it in "
                            "parts, or leave them out", param="prompt_logprobs" if body.prompt_logprobs is not None
                       else "echo")
    if body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens is {body.min_tokens}, beyond max_tokens ({max_tokens})", param="min_tokens")
    params = SamplingParams(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                            top_k=body.top_k, stop=stop_strings(body, limits) + stop, seed=body.seed,
                            logprobs=body.top_count(), presence_penalty=body.presence_penalty,
                            frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                            min_p=body.min_p, logit_bias=body.logit_bias or {}, min_tokens=body.min_tokens,
                            allowed_token_ids=body.allowed_token_ids, stop_token_ids=tuple(body.stop_token_ids or ()),
                            ignore_eos=body.ignore_eos, include_stop_str_in_output=body.include_stop_str_in_output,
                            skip_special_tokens=body.skip_special_tokens,
                            output_format=None if compiled is None else compiled.output_format, bad_words=banned)
    try:
        request = Request(prompt_ids, params, force=body.r2r_policy, threshold=body.r2r_threshold,
                          target_rate=body.r2r_llm_rate, verify=body.r2r_verify,
                          max_unverified=body.r2r_max_unverified, thinking_until=thinking_until,
                          prompt_logprobs=body.prompt_top_count(), cache_salt=body.cache_salt,
                          priority=body.priority)
        return engine.sequence(request, compiled=compiled)  # here, not in the engine thread
    except R2RError as e:
        raise APIError(400, str(e)) from None


def bad_words(words: list[str], tokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's `bad_words` as token sequences, read as vLLM reads them: each word as the tokenizer writes it at a
    text's start and, where that gives another first token of the same count, after a space (inside a text)."""
    sequences = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise APIError(400, f"the bad word {word!r} holds no token: give words with text in them",
                           param="bad_words")
        sequences.append(plain)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return tuple(sequences)


def type_label(part) -> bool:
    """Whether a part of an error's location names a type pydantic tried (a union's member), not a field."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


async def validation_error(http: HTTPRequest, e: RequestValidationError) -> JSONResponse:
    """FastAPI's body validation, as an OpenAI-style 400 naming the bad field: of a value that matches no member of
    a union (text or a list of parts, say), the failure that went deepest into it, which is the one the client
    meant."""
    errors = e.errors()
    first = max(errors, key=lambda error: sum(not type_label(x) for x in error["loc"]))
    loc = [str(x) for x in first["loc"] if x != "body" and not type_label(x)]
    param = ".".join(loc) if loc and first["type"] != "json_invalid" else None
    if first["type"] == "json_invalid":
        message = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
    elif not loc:
        message = "the request body must be a JSON object (sent with content-type: application/json)"
    else:
        message = f"{param}: {first['msg']}"
    return APIError(400, message, param=param).response()
