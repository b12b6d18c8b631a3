"""A request's answer as OpenAI shapes it, whole or a chunk at a time: `ChatReply` renders chat completions,
`CompletionReply` completions, each with R2R's provenance (which model wrote each token) and, when asked, each token's
log-probability from the model that wrote it. A renderer holds no stream's state (serving/streams.py keeps that), so
one serves every choice of a request."""

from __future__ import annotations

import dataclasses
import itertools
import json
import secrets
from dataclasses import dataclass
from typing import ClassVar

from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage, ChatCompletionTokenLogprob
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall
from openai.types.chat.chat_completion_message_function_tool_call import ChatCompletionMessageFunctionToolCall, Function
from openai.types.chat.chat_completion_token_logprob import TopLogprob
from openai.types.completion_choice import Logprobs
from openai.types.completion_usage import CompletionTokensDetails, PromptTokensDetails
from pydantic import BaseModel

from roads_to_rome.core.request import Generation
from roads_to_rome.core.sampling import TokenLogprob
from roads_to_rome.reasoning import Reasoned, ReasoningParser, llm_rate, reason
from roads_to_rome.tool_calls import CallStream, ToolCall, ToolParser, ToolSplit


@dataclass
class ReplyParts:
    """A finished chat reply taken apart: what every API's whole answer is built from."""

    reasoned: Reasoned | None  # its thinking apart (with a reasoning parser)
    content: str  # its answer's text outside its calls
    calls: list[ToolCall]

    @property
    def thinking(self) -> str | None:
        return self.reasoned.reasoning if self.reasoned else None

    def shows_text(self) -> bool:
        """Whether the answer's text is shown as its own part: when it holds text, or when nothing else came."""
        return bool(self.content.strip()) or not (self.calls or self.thinking is not None)


@dataclass
class TextOffsets:
    """(completions' log-probabilities) Where a stream's entries so far end, in tokens and in characters: its next
    chunk's text offsets start there, not summed again from the first token."""

    tokens: int = 0
    chars: int = 0


@dataclass(frozen=True)
class Reply:
    """What one request's answers are rendered with: its ids, what it asked to be shown, and how a chat reply is
    read (thinking, tool calls). `ChatReply` and `CompletionReply` render them."""

    chat: ClassVar[bool]
    id: str
    created: int
    model_name: str
    tokenizer: object
    n: int = 1  # choices per prompt: choice i * n + j is prompt i's j-th
    # Each prompt's text, which its choices' text starts with: completions' `echo`; a chat reply's, the last
    # message when it is an assistant's (vLLM's chat `echo`)
    echo: list[str] | None = None
    prompt_entries: bool = False  # vLLM's `prompt_logprobs` field: completions' choices and a chat reply carry it
    token_ids: bool = False  # log-probabilities name tokens `token_id:N` (vLLM's `return_tokens_as_token_ids`)
    # vLLM's `return_token_ids`: the prompt's token ids (a chat reply's beside its choices, a completion choice's in
    # it; a stream's in its first chunk) and each choice's (a stream's: each chunk's)
    with_ids: bool = False
    running_usage: bool = False  # a stream's chunks each carry their choice's usage so far (vLLM's continuous stats)
    parser: ReasoningParser | None = None  # (chat) thinking apart from the answer
    tools: ToolParser | None = None  # (chat) tool calls read from the answer
    one_call: bool = False  # (chat) parallel_tool_calls: false: the first call only

    def reasoned(self, gen: Generation) -> Reasoned | None:
        return reason(self.parser, self.tokenizer, gen) if self.parser else None

    def parts(self, gen: Generation) -> ReplyParts:
        """A finished reply's thinking, its answer's text outside its calls, and its calls."""
        reasoned = self.reasoned(gen)
        content = reasoned.content if reasoned else gen.text
        split = self.calls(content, final=True)
        return ReplyParts(reasoned, split.content if split and split.calls else content, split.calls if split else [])

    def calls(self, answer: str, final: bool, stream: CallStream | None = None) -> ToolSplit | None:
        """The tool calls in a reply's answer (so far) and the content around them; None: calls are not read.
        `stream`: what a stream's reading keeps between its tokens."""
        if self.tools is None:
            return None
        split = self.tools.split(answer, final, stream)
        if self.one_call and split.calls:
            split.calls, split.writing = split.calls[:1], None
        return split

    def echoed(self, index: int) -> str:
        """The prompt's text choice `index` starts with (`echo`), or nothing."""
        return self.echo[index // self.n] if self.echo else ""

    def prompt_entries_of(self, gen: Generation) -> list[dict | None]:
        """vLLM's `prompt_logprobs`: for each prompt token after the first, that token's entry and the most likely
        tokens' there, by token id: log-probability, rank and text (None for the first token)."""
        shown = [None]
        for token, entry in zip(gen.prompt_ids[1:], gen.prompt_logprobs[1:]):
            ranked = {token: (entry.logprob, entry.rank)}
            for rank, (t, lp) in enumerate(entry.top, 1):
                ranked.setdefault(t, (lp, rank))
            shown.append({str(t): {"logprob": lp, "rank": rank, "decoded_token": self._text(t)}
                          for t, (lp, rank) in ranked.items()})
        return shown

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token])

    def _shown(self, token: int) -> str:
        """A token as log-probabilities name it: its text, or vLLM's `token_id:N` (`return_tokens_as_token_ids`)."""
        return f"token_id:{token}" if self.token_ids else self._text(token)

    def _tops(self, entry: TokenLogprob) -> list[tuple[str, float]]:
        return [(self._shown(t), lp) for t, lp in entry.top]

    def _r2r(self, gen: Generation, several: bool) -> dict:
        """A choice's own fields beside OpenAI's: its provenance where the reply has several choices, its token ids
        when asked."""
        r2r = {"r2r": provenance(gen)} if several else {}
        if self.with_ids:
            r2r["token_ids"] = list(gen.token_ids)
        return r2r

    def usage_chunk(self, gens: list[Generation], reasoned=None) -> str:
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model_name, "choices": [],
               "usage": usage(gens, reasoned, self.n).model_dump(exclude_unset=True)}
        return f"data: {json.dumps(out)}\n\n"


@dataclass(frozen=True)
class ChatReply(Reply):
    """A chat completion: messages with their thinking and tool calls apart."""

    chat: ClassVar[bool] = True
    show_reasoning: bool = True  # vLLM's `include_reasoning`: false leaves the thinking out (still counted)

    def whole(self, gens: list[Generation]) -> dict:
        """The whole reply: one choice per generation (`n`). Its "r2r" provenance goes beside the choices for one,
        in each choice for several."""
        choices, reasoned = [], []
        for index, gen in enumerate(gens):
            parts = self.parts(gen)
            reasoned.append(parts.reasoned)
            fields, content = {}, parts.content
            if parts.reasoned is not None and self.show_reasoning:  # both names: vLLM's, SGLang's and llama.cpp's
                fields = {"reasoning": parts.reasoned.reasoning, "reasoning_content": parts.reasoned.reasoning}
            if parts.calls:
                content = content or None
                fields["tool_calls"] = [ChatCompletionMessageFunctionToolCall(
                    id=self.tools.call_id(), type="function", function=Function(name=call.name,
                                                                                arguments=call.arguments))
                    for call in parts.calls]
            if self.echo:  # (the message a continued reply goes on writing)
                content = self.echoed(index) + (content or "")
            message = ChatCompletionMessage(role="assistant", content=content, **fields)
            choices.append(ChatChoice(index=index, message=message, logprobs=self.logprobs(gen, 0, len(gen.token_ids)),
                                      finish_reason=finish_reason(gen, len(parts.calls)), stop_reason=gen.stop_reason,
                                      **self._r2r(gen, len(gens) > 1)))
        extra = {"r2r": provenance(gens[0])} if len(gens) == 1 else {}
        if self.prompt_entries:  # (one prompt: vLLM gives its entries beside the choices)
            extra["prompt_logprobs"] = self.prompt_entries_of(gens[0])
        if self.with_ids:
            extra["prompt_token_ids"] = list(gens[0].prompt_ids)
        out = ChatCompletion(id=self.id, object="chat.completion", created=self.created, model=self.model_name,
                             choices=choices, usage=usage(gens, reasoned if reasoned[0] is not None else None, self.n),
                             **extra)
        return out.model_dump(exclude_unset=True)

    def logprobs(self, gen: Generation, start: int, end: int, offsets: TextOffsets | None = None
                 ) -> ChoiceLogprobs | None:
        """The log-probabilities of tokens start..end-1 in OpenAI's shape (`content`), or None when the request asked
        for none."""
        if gen.logprobs is None:
            return None
        entries = [(self._shown(token), entry) for token, entry in zip(gen.token_ids[start:end],
                                                                       gen.logprobs[start:end])]
        return ChoiceLogprobs(content=[ChatCompletionTokenLogprob(
            token=text, bytes=list(text.encode()), logprob=entry.logprob,
            top_logprobs=[TopLogprob(token=t, bytes=list(t.encode()), logprob=lp) for t, lp in self._tops(entry)])
            for text, entry in entries])

    def chunk(self, delta: str | None, finish_reason=None, extra: dict | None = None, role: bool = False,
              reasoning: str | None = None, logprobs=None, index: int = 0, calls: list[ChoiceDeltaToolCall] = (),
              stop_reason: str | int | None = None, ids: dict | None = None) -> str:
        """One chunk of choice `index`'s stream; `calls`: what it adds to the reply's tool calls (streams.CallsSent);
        the last one's `stop_reason` says which stop string or stop token ended it (vLLM's); `ids`: its
        `token_ids` and, in a choice's first chunk, its `prompt_token_ids` (`with_ids`: beside the choices)."""
        in_choice = {"stop_reason": stop_reason} if finish_reason is not None else {}
        ids = dict(ids or {})
        if "prompt_token_ids" in ids:
            extra = {**(extra or {}), "prompt_token_ids": ids.pop("prompt_token_ids")}
        in_choice.update(ids)
        tool_calls = {"tool_calls": calls} if calls else {}
        if role:
            d = ChoiceDelta(role="assistant", content="")
        elif reasoning and self.show_reasoning:
            d = ChoiceDelta(reasoning=reasoning, reasoning_content=reasoning, **({"content": delta} if delta else {}),
                            **tool_calls)
        else:
            d = ChoiceDelta(**({"content": delta} if delta is not None else {}), **tool_calls)
        choice = ChunkChoice(index=index, delta=d, finish_reason=finish_reason, **in_choice,
                             **({"logprobs": logprobs.model_dump()} if logprobs is not None else {}))
        out = ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                                  model=self.model_name, choices=[choice], **(extra or {}))
        return f"data: {json.dumps(out.model_dump(exclude_unset=True))}\n\n"


@dataclass(frozen=True)
class CompletionReply(Reply):
    """A completion: text, its log-probabilities as parallel lists with text offsets."""

    chat: ClassVar[bool] = False
    prompt_alone: bool = False  # echo with max_tokens 0: the prompt, nothing written after it

    def whole(self, gens: list[Generation]) -> dict:
        """The whole reply: one choice per generation (`n`); "r2r" provenance beside the choices for one, in each
        choice for several."""
        if self.prompt_alone:
            gens = [dataclasses.replace(gen, token_ids=[], sources=[], scores=[], text="",
                                        logprobs=None if gen.logprobs is None else []) for gen in gens]
        choices = []
        for index, gen in enumerate(gens):
            logprobs = self.logprobs(gen, 0, len(gen.token_ids))
            if logprobs is not None and gen.prompt_logprobs is not None:
                logprobs = self.with_prompt(gen, logprobs, len(self.echoed(index)))
            fields = self._r2r(gen, len(gens) > 1)
            if self.with_ids:
                fields["prompt_token_ids"] = list(gen.prompt_ids)
            if self.prompt_entries:
                fields["prompt_logprobs"] = self.prompt_entries_of(gen)
            choices.append(CompletionChoice(index=index, text=self.echoed(index) + gen.text, logprobs=logprobs,
                                            finish_reason=gen.finish_reason, stop_reason=gen.stop_reason, **fields))
        extra = {"r2r": provenance(gens[0])} if len(gens) == 1 else {}
        out = Completion(id=self.id, object="text_completion", created=self.created, model=self.model_name,
                         choices=choices, usage=usage(gens, None, self.n), **extra)
        return out.model_dump(exclude_unset=True)

    def logprobs(self, gen: Generation, start: int, end: int, offsets: TextOffsets | None = None) -> Logprobs | None:
        """The log-probabilities of tokens start..end-1 as parallel lists, with each token's text offset, or None when
        the request asked for none. `offsets`: where a stream's entries so far end (its next offsets start there)."""
        if gen.logprobs is None:
            return None
        tokens = gen.token_ids[start:end]
        entries = [(self._shown(token), entry) for token, entry in zip(tokens, gen.logprobs[start:end])]
        offset = offsets.chars if offsets is not None and offsets.tokens == start else sum(
            len(self._text(t)) for t in gen.token_ids[:start])
        text_offset = []
        for token in tokens:
            text_offset.append(offset)
            offset += len(self._text(token))
        if offsets is not None:
            offsets.tokens, offsets.chars = end, offset
        return Logprobs(tokens=[text for text, _ in entries], token_logprobs=[entry.logprob for _, entry in entries],
                        top_logprobs=[dict(self._tops(entry)) for _, entry in entries], text_offset=text_offset)

    def with_prompt(self, gen: Generation, generated: Logprobs, echoed: int) -> Logprobs:
        """`echo` with `logprobs`: the prompt's entries (the first without a log-probability, as OpenAI's), then the
        generated tokens', whose offsets follow the echoed text's `echoed` characters."""
        offsets = list(itertools.accumulate((len(self._text(t)) for t in gen.prompt_ids[:-1]), initial=0))
        entries = gen.prompt_logprobs
        # (built as is: OpenAI's type has no room for the first token's null, which its API sends)
        return Logprobs.model_construct(tokens=[self._shown(t) for t in gen.prompt_ids] + generated.tokens,
                                        token_logprobs=[None if e is None else e.logprob for e in entries]
                                        + generated.token_logprobs,
                                        top_logprobs=[None if e is None else dict(self._tops(e)) for e in entries]
                                        + generated.top_logprobs,
                                        text_offset=offsets + [echoed + o for o in generated.text_offset])

    def chunk(self, delta: str | None, finish_reason=None, extra: dict | None = None, role: bool = False,
              reasoning: str | None = None, logprobs=None, index: int = 0, calls: list[ChoiceDeltaToolCall] = (),
              stop_reason: str | int | None = None, ids: dict | None = None) -> str:
        """One chunk of choice `index`'s stream (`ChatReply.chunk`'s arguments; a completion has no role, thinking
        or calls); `ids` go in the choice."""
        in_choice = {"stop_reason": stop_reason} if finish_reason is not None else {}
        in_choice.update(ids or {})
        # openai's CompletionChoice has no null finish_reason, which every chunk but the last needs.
        shown = logprobs.model_dump(exclude_unset=True) if logprobs is not None else None
        out = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model_name,
               "choices": [{"index": index, "text": delta or "", "logprobs": shown, "finish_reason": finish_reason,
                            **in_choice}],
               **{k: v.model_dump(exclude_unset=True) if isinstance(v, BaseModel) else v
                  for k, v in (extra or {}).items()}}
        return f"data: {json.dumps(out)}\n\n"


def new_id(prefix: str) -> str:
    """An id for a response, message or item: its kind's prefix, then 32 random hex digits."""
    return f"{prefix}_{secrets.token_hex(16)}"


def finish_reason(gen: Generation, calls: int) -> str | None:
    """OpenAI's: `tool_calls` where a reply that ended by itself made calls."""
    return "tool_calls" if calls and gen.finish_reason == "stop" else gen.finish_reason


def provenance(gen: Generation) -> dict:
    """Which model wrote each token, the policy's scores, and R2R's counters."""
    scored = {} if gen.prompt_sources is None else {"prompt_sources": gen.prompt_sources}  # (echo with logprobs)
    return {"token_ids": gen.token_ids, "sources": gen.sources, "scores": gen.scores, **gen.counters(), **scored}


def usage(gens: list[Generation], reasoned: list | None = None, per_prompt: int = 1) -> CompletionUsage:
    """OpenAI's usage of one request's choices (`per_prompt` for each prompt, which is counted once, as are the
    tokens of it its first choice took from prefix caching, `cached_tokens`), plus R2R's
    figures (`Generation.counters`, summed; the LLM's rate and the activated parameters over all their tokens); with
    a reasoning parser (`reasoned`: each choice's split), the thinking's tokens and the LLM's share of the thinking
    and of the answer apart."""
    completion = sum(len(gen.token_ids) for gen in gens)
    counters = {name: sum(gen.counters()[name] for gen in gens) for name in gens[0].counters()}
    rate = counters["llm_tokens"] / max(completion, 1)
    slm, router, llm = gens[0].params_b
    thinking = {}
    if reasoned is not None:
        parts = [(gen.sources[: r.reasoning_tokens], gen.sources[r.reasoning_tokens :]) for gen, r in
                 zip(gens, reasoned)]
        thinking = {"completion_tokens_details": CompletionTokensDetails(
                        reasoning_tokens=sum(r.reasoning_tokens for r in reasoned)),
                    "llm_rate_thinking": llm_rate([s for think, _ in parts for s in think]),
                    "llm_rate_answer": llm_rate([s for _, answer in parts for s in answer])}
    prompt = sum(len(gen.prompt_ids) for gen in gens[::per_prompt])
    cached = sum(gen.cached_tokens for gen in gens[::per_prompt])
    return CompletionUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                           prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                           llm_rate=rate,
                           avg_activated_params_b=slm + router + rate * llm, **counters, **thinking)
