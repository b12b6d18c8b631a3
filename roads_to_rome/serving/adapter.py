"""How a checked body becomes the engine's `Sequence`s: what a body's types cannot say is checked here, before
the request queues (the model it names, stop strings and every list's cap), then its sampling settings, format and
bad words go to a `Request` per choice. Nothing a client sends can fail the batch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.grammar import GrammarWalk, OutputFormat
from roads_to_rome.core.request import Request, Sequence
from roads_to_rome.core.sampling import (
    SamplingParams,
)
from roads_to_rome.errors import R2RError
from roads_to_rome.serving.errors import APIError
from roads_to_rome.serving.limits import Limits
from roads_to_rome.serving.schemas import NEUTRAL, UNSUPPORTED, CommonBody, CompletionBody


def check_model(requested: str | None, model_name: str) -> None:
    if requested is not None and requested != model_name:
        raise APIError(404, f"the model {requested!r} does not exist; this server serves {model_name!r}",
                       param="model", code="model_not_found")


@dataclass(frozen=True)
class Checked:
    """What `check_body` worked out of a body, kept for its sequences (`make_sequences`), not worked out again."""

    output_format: OutputFormat | None  # the format its output must follow
    format_field: str | None  # the field that format came from, for an error about it ("tools": a tool choice's)
    stop: tuple[str, ...]  # its stop strings
    logprobs: int | None  # alternatives each token's log-probability comes with (None: none)
    prompt_logprobs: int | None  # ... each prompt token's

    def for_tools(self, tools_format: OutputFormat | None) -> Checked:
        """With a tool choice's grammar (tool_choice required or named), which holds the reply to calls."""
        return self if tools_format is None else dataclasses.replace(self, output_format=tools_format,
                                                                     format_field="tools")


def check_body(body: CommonBody, model_name: str, limits: Limits, by_priority: bool) -> Checked:
    """What a body's types cannot say: the model it names, the options this server supports (`priority` where the
    scheduler orders `by_priority`) and the stop strings' limits (before its prompt is tokenized); what it asks for,
    worked out once."""
    check_model(body.requested, model_name)
    for name, value in (body.model_extra or {}).items():
        if name in UNSUPPORTED and value is not None and value != UNSUPPORTED[name] \
                and value not in NEUTRAL.get(name, ()):
            raise APIError(400, f"{name}={value!r} is not supported by this server (it would change the answer); "
                                f"leave it out", param=name, code="unsupported_parameter")
    if body.priority and not by_priority:
        raise APIError(400, "priority orders waiting requests only on a server started with --scheduling-policy "
                            "priority: leave it out (or 0)", param="priority")
    if body.stream_options is not None and not body.stream:  # (OpenAI's and vLLM's rule: it would be unread)
        raise APIError(400, "stream_options go with stream: true: stream, or leave them out", param="stream_options")
    stop = stop_strings(body, limits)
    capped_lists(body, limits)
    checked = Checked(None, None, stop, body.top_count(), body.prompt_top_count())
    output_format = body.output_format()
    if output_format is not None:
        checked = dataclasses.replace(checked, output_format=output_format, format_field=body.format_field())
    choices = body.n * (len(body.prompts()) if isinstance(body, CompletionBody) else 1)
    if choices > limits.max_batch + limits.max_queue:
        raise APIError(400, f"the request asks for {choices} choices (n for each prompt); this server holds at most "
                            f"{limits.max_batch + limits.max_queue} sequences at once (--max-batch + --max-queue)",
                       param="n")
    return checked


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
    capped_strings(stop, body.named("stop"), ("strings", "stop string"), limits.max_stop_strings, limits.max_stop_chars)
    return tuple(stop)


def capped_strings(strings: list[str], field: str, nouns: tuple[str, str], most: int, chars: int) -> None:
    """A list of texts holds at most `most` of them, each of at most `chars` characters (a 400 naming `field`)."""
    if len(strings) > most:
        raise APIError(400, f"{field} holds {len(strings)} {nouns[0]}; this server takes at most {most}", param=field)
    if any(len(s) > chars for s in strings):
        raise APIError(400, f"a {nouns[1]} is at most {chars} characters on this server", param=field)


def capped_lists(body: CommonBody, limits: Limits) -> None:
    """Every list a body may send holds at most its limit (stop strings: `stop_strings`): what grows with them runs
    on the event loop or at every token."""
    capped_strings(body.bad_words or [], "bad_words", ("words", "bad word"), limits.max_bad_words,
                   limits.max_bad_word_chars)
    for name in ("allowed_token_ids", "stop_token_ids", "logit_bias"):
        ids = getattr(body, name) or ()
        if len(ids) > limits.max_token_ids:
            raise APIError(400, f"{name} names {len(ids)} tokens; this server takes at most {limits.max_token_ids}",
                           param=name)
    tools = getattr(body, "tools", None) or ()
    if len(tools) > limits.max_tools:
        raise APIError(400, f"tools offers {len(tools)} tools; this server takes at most {limits.max_tools}",
                       param="tools")


def make_sequences(body: CommonBody, checked: Checked, prompt_ids: list[int], engine: Engine, limits: Limits,
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
    first = make_sequence(body, checked, prompt_ids, engine, limits, compiled, thinking_until, stop, banned)
    if body.n == 1:
        return [first]
    params = first.params
    return [first] + [engine.sequence(dataclasses.replace(first.request, params=dataclasses.replace(
        params, seed=None if params.seed is None else params.seed + i)), compiled=compiled) for i in range(1, body.n)]


def make_sequence(body: CommonBody, checked: Checked, prompt_ids: list[int], engine: Engine, limits: Limits,
                  compiled: GrammarWalk | None, thinking_until: int | None, stop: tuple[str, ...],
                  banned: tuple[tuple[int, ...], ...]) -> Sequence:
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if body.prompt_alone():
        max_tokens = 1  # (the reply leaves it out)
    name = "max_completion_tokens" if body.max_completion_tokens is not None else body.named("max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"{name} must be at least 1 (0 only with echo: the prompt alone), got {max_tokens}",
                       param=name)
    if max_tokens is not None and max_tokens > limits.max_tokens:
        raise APIError(400, f"{name} is at most {limits.max_tokens} on this server", param=name)
    context = limits.context_length
    room = context - len(prompt_ids)
    if room <= 0 or (max_tokens is not None and max_tokens > room):
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens and {name} is {max_tokens}, but this "
                            f"server holds at most {context} tokens per request", param=body.named("messages"),
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(limits.max_tokens, room)
    if checked.prompt_logprobs is not None and len(prompt_ids) > limits.max_scored_prompt_tokens:
        raise APIError(400, f"the prompt has {len(prompt_ids)} tokens; this server scores prompts of at most "
                            f"{limits.max_scored_prompt_tokens} (echo with logprobs, prompt_logprobs): score it in "
                            "parts, or leave them out", param="prompt_logprobs" if body.prompt_logprobs is not None
                       else "echo")
    if body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens is {body.min_tokens}, beyond {name} ({max_tokens})", param="min_tokens")
    params = SamplingParams(max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                            top_k=body.top_k, stop=checked.stop + stop, seed=body.seed,
                            logprobs=checked.logprobs, presence_penalty=body.presence_penalty,
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
                          prompt_logprobs=checked.prompt_logprobs, cache_salt=body.cache_salt,
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
