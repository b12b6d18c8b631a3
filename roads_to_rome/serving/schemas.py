"""What a client may send: the request bodies every API shares (`CommonBody`, the completions body, tokenizing)
and the types their fields are made of. Chat's are in chat_schemas.py; how a body becomes a `Sequence`, in
adapter.py."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from roads_to_rome.core.grammar import OutputFormat
from roads_to_rome.core.sampling import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    REPETITION_PENALTY_RANGE,
    parse_verify,
)
from roads_to_rome.errors import R2RError
from roads_to_rome.serving import request_ids
from roads_to_rome.serving.errors import APIError


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


# A salt is kept with the prompts it fences (prefix caching): a bound far above a secret's length
MAX_CACHE_SALT_CHARS = 1024


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


class NullIsDefault(BaseModel):
    """A request body whose optional fields, sent as null, take their default: OpenAI's API declares them nullable,
    vLLM reads them so, and clients written against either send `"temperature": null` for "unset"."""

    @model_validator(mode="before")
    @classmethod
    def null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaulted = {key for name, field in cls.model_fields.items() if not field.is_required()
                     and field.default is not None for key in (name, field.alias) if key}
        return {key: value for key, value in data.items() if value is not None or key not in defaulted}


class CommonBody(NullIsDefault):
    model_config = ConfigDict(extra="allow")  # kept, to refuse the unsupported ones by name (`check_body`)
    # The fields as the client's API names them, where it made this body from its own (`named`)
    _names: dict[str, tuple[str, bool]] = PrivateAttr(default_factory=dict)
    requested: str | None = Field(None, alias="model")  # the model id the client asks for
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int = Field(1, ge=1)  # choices per prompt, each its own sequence
    temperature: Number = Field(1.0, ge=0, le=2)  # OpenAI's range
    top_p: Number = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)  # 0 or vLLM's -1: no top-k cut
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
    cache_salt: Annotated[str, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
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

    @field_validator("top_k")
    @classmethod
    def top_k_off(cls, value: int) -> int:
        return max(value, 0)

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
            raise APIError(400, f"give {self.named('response_format')} or structured_outputs, not both",
                           param="structured_outputs")
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
            field = self.named("response_format.json_schema")
            raise APIError(400, f"{self.named('response_format')} of type json_schema needs its json_schema (name "
                                "and schema)", param=field)
        else:
            schema = response.json_schema.schema_
            return OutputFormat("json_object") if schema is None else OutputFormat.json_schema(schema)
        return fmt

    def format_field(self) -> str:
        """The field `output_format` reads the format from, for an error about it."""
        if self.structured_outputs:
            return "structured_outputs"
        return self.named("response_format.json_schema.schema" if self.response_format.json_schema
                          else "response_format")

    def named(self, field: str) -> str:
        """A field (dotted) as the request's own API names it, for an error's text and `param`: a Responses
        request's `max_output_tokens` for `max_tokens` (`renamed`, with the names its API gave this body)."""
        return renamed(field, self._names)

    def in_api(self, names: dict[str, tuple[str, bool]]) -> CommonBody:
        """This body, saying its fields as another API names them: chat field (dotted prefix) -> (the API's name,
        whether what follows the prefix stays)."""
        self._names = names
        return self


def renamed(field: str, names: dict[str, tuple[str, bool]]) -> str:
    """A dotted field as `names` (`CommonBody.in_api`) says it, the longest prefix first; else as it is."""
    for prefix in sorted(names, key=len, reverse=True):
        if field == prefix or field.startswith(prefix + "."):
            own, keeps_rest = names[prefix]
            return own + field[len(prefix):] if keeps_rest else own
    return field


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


class DetokenizeBody(BaseModel):
    """vLLM's /detokenize."""

    model_config = ConfigDict(extra="forbid")
    requested: str | None = Field(None, alias="model")
    tokens: list[TokenId]
