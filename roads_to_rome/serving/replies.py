"""A request's answer as OpenAI shapes it: a whole reply, or a stream of chunks, each with R2R's provenance (which
model wrote each token) and, when asked, each token's log-probability from the model that wrote it."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response
from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage, ChatCompletionTokenLogprob
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall, ChoiceDeltaToolCallFunction
from openai.types.chat.chat_completion_message_function_tool_call import ChatCompletionMessageFunctionToolCall, Function
from openai.types.chat.chat_completion_token_logprob import TopLogprob
from openai.types.completion_choice import Logprobs
from openai.types.completion_usage import CompletionTokensDetails, PromptTokensDetails
from pydantic import BaseModel

from roads_to_rome.core.request import Generation
from roads_to_rome.core.sampling import TokenLogprob
from roads_to_rome.reasoning import Reasoned, ReasoningParser, llm_rate, prompt_start, reason
from roads_to_rome.serving.engine_thread import ErrorReply, Job
from roads_to_rome.serving.errors import APIError, llm_away
from roads_to_rome.text import Detokenizer
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
class Reply:
    """The response bodies of one request, as the openai package's types (plus the "r2r" provenance)."""

    id: str
    created: int
    model_name: str
    chat: bool
    parser: ReasoningParser | None = None  # chat replies only: thinking apart from the answer
    tokenizer: object = None
    n: int = 1  # choices per prompt: choice i * n + j is prompt i's j-th
    # Each prompt's text, which its choices' text starts with: completions' `echo`; a chat reply's, the last
    # message when it is an assistant's (vLLM's chat `echo`)
    echo: list[str] | None = None
    tools: ToolParser | None = None  # chat replies whose tool calls are read
    one_call: bool = False  # parallel_tool_calls: false: the first call only
    prompt_entries: bool = False  # vLLM's `prompt_logprobs` field: completions' choices and a chat reply carry it
    prompt_alone: bool = False  # completions' echo with max_tokens 0: the prompt, nothing written after it
    running_usage: bool = False  # a stream's chunks each carry their choice's usage so far (vLLM's continuous stats)
    token_ids: bool = False  # log-probabilities name tokens `token_id:N` (vLLM's `return_tokens_as_token_ids`)
    # vLLM's `return_token_ids`: the prompt's token ids (a chat reply's beside its choices, a completion choice's in
    # it; a stream's in its first chunk) and each choice's (a stream's: each chunk's)
    with_ids: bool = False
    show_reasoning: bool = True  # vLLM's `include_reasoning`: false leaves a chat reply's thinking out (still counted)
    # Where the tokens given log-probabilities so far end, in tokens and in characters: a stream's next chunk
    # starts there, so its text offset is not summed again from the first token.
    logprobs_upto: tuple[int, int] = (0, 0)

    def reasoned(self, gen):
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

    def whole(self, gens: list[Generation]) -> dict:
        """The whole reply: one choice per generation (`n`). Its "r2r" provenance goes beside the choices for one,
        in each choice for several."""
        choices, reasoned = [], []
        if self.prompt_alone:
            gens = [dataclasses.replace(gen, token_ids=[], sources=[], scores=[], text="",
                                        logprobs=None if gen.logprobs is None else []) for gen in gens]
        for index, gen in enumerate(gens):
            self.logprobs_upto = (0, 0)
            logprobs = self.logprobs(gen, 0, len(gen.token_ids))
            r2r = {"r2r": provenance(gen)} if len(gens) > 1 else {}
            if self.with_ids:
                r2r["token_ids"] = list(gen.token_ids)
                if not self.chat:
                    r2r["prompt_token_ids"] = list(gen.prompt_ids)
            if self.chat:
                parts = self.parts(gen)
                reasoned.append(parts.reasoned)
                fields, content = {}, parts.content
                if parts.reasoned is not None and self.show_reasoning:  # both names: vLLM's, SGLang's and llama.cpp's
                    fields = {"reasoning": parts.reasoned.reasoning, "reasoning_content": parts.reasoned.reasoning}
                if parts.calls:
                    content = content or None
                    fields["tool_calls"] = [ChatCompletionMessageFunctionToolCall(
                        id=self.tools.call_id(), type="function",
                        function=Function(name=call.name, arguments=call.arguments))
                        for call in parts.calls]
                if self.echo:  # (the message a continued reply goes on writing)
                    content = self.echoed(index) + (content or "")
                message = ChatCompletionMessage(role="assistant", content=content, **fields)
                choices.append(ChatChoice(index=index, message=message, logprobs=logprobs,
                                          finish_reason=finish_reason(gen, len(parts.calls)),
                                          stop_reason=gen.stop_reason, **r2r))
            else:
                if logprobs is not None and gen.prompt_logprobs is not None:
                    logprobs = self.with_prompt(gen, logprobs, len(self.echoed(index)))
                scored = {"prompt_logprobs": self.prompt_entries_of(gen)} if self.prompt_entries else {}
                choices.append(CompletionChoice(index=index, text=self.echoed(index) + gen.text, logprobs=logprobs,
                                                finish_reason=gen.finish_reason, stop_reason=gen.stop_reason, **r2r,
                                                **scored))
        extra = {"r2r": provenance(gens[0])} if len(gens) == 1 else {}
        if self.chat and self.prompt_entries:  # (one prompt: vLLM gives its entries beside the choices)
            extra["prompt_logprobs"] = self.prompt_entries_of(gens[0])
        if self.chat and self.with_ids:
            extra["prompt_token_ids"] = list(gens[0].prompt_ids)
        kind = (ChatCompletion, "chat.completion") if self.chat else (Completion, "text_completion")
        out = kind[0](id=self.id, object=kind[1], created=self.created, model=self.model_name, choices=choices,
                      usage=usage(gens, reasoned if self.chat and reasoned[0] is not None else None, self.n), **extra)
        return out.model_dump(exclude_unset=True)

    def echoed(self, index: int) -> str:
        """The prompt's text choice `index` starts with (`echo`), or nothing."""
        return self.echo[index // self.n] if self.echo else ""

    def logprobs(self, gen: Generation, start: int, end: int) -> ChoiceLogprobs | Logprobs | None:
        """The log-probabilities of tokens start..end-1 in OpenAI's shape (chat: `content`; completions: parallel
        lists), or None when the request asked for none."""
        if gen.logprobs is None:
            return None
        tokens = gen.token_ids[start:end]
        entries = [(self._shown(token), entry) for token, entry in zip(tokens, gen.logprobs[start:end])]
        if self.chat:
            return ChoiceLogprobs(content=[ChatCompletionTokenLogprob(
                token=text, bytes=list(text.encode()), logprob=entry.logprob,
                top_logprobs=[TopLogprob(token=t, bytes=list(t.encode()), logprob=lp)
                              for t, lp in self._tops(entry)]) for text, entry in entries])
        upto, offset = self.logprobs_upto
        if start != upto:
            offset = sum(len(self._text(t)) for t in gen.token_ids[:start])
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(self._text(token))
        self.logprobs_upto = (end, offset)
        return Logprobs(tokens=[text for text, _ in entries], token_logprobs=[entry.logprob for _, entry in entries],
                        top_logprobs=[dict(self._tops(entry)) for _, entry in entries], text_offset=offsets)

    def with_prompt(self, gen: Generation, generated: Logprobs, echoed: int) -> Logprobs:
        """Completions' `echo` with `logprobs`: the prompt's entries (the first without a log-probability, as
        OpenAI's), then the generated tokens', whose offsets follow the echoed text's `echoed` characters."""
        offsets = list(itertools.accumulate((len(self._text(t)) for t in gen.prompt_ids[:-1]), initial=0))
        entries = gen.prompt_logprobs
        # (built as is: OpenAI's type has no room for the first token's null, which its API sends)
        return Logprobs.model_construct(tokens=[self._shown(t) for t in gen.prompt_ids] + generated.tokens,
                                        token_logprobs=[None if e is None else e.logprob for e in entries]
                                        + generated.token_logprobs,
                                        top_logprobs=[None if e is None else dict(self._tops(e)) for e in entries]
                                        + generated.top_logprobs,
                                        text_offset=offsets + [echoed + o for o in generated.text_offset])

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

    def chunk(self, delta: str | None, finish_reason=None, extra: dict | None = None, role: bool = False,
              reasoning: str | None = None, logprobs=None, index: int = 0,
              calls: list[ChoiceDeltaToolCall] = (), stop_reason: str | int | None = None,
              ids: dict | None = None) -> str:
        """One chunk of choice `index`'s stream; `calls`: what it adds to the reply's tool calls (`CallsSent`);
        the last one's `stop_reason` says which stop string or stop token ended it (vLLM's); `ids`: its
        `token_ids` and, in a choice's first chunk, its `prompt_token_ids` (`with_ids`)."""
        in_choice = {"stop_reason": stop_reason} if finish_reason is not None else {}
        ids = dict(ids or {})
        if self.chat and "prompt_token_ids" in ids:  # (a chat reply's prompt goes beside its choices)
            extra = {**(extra or {}), "prompt_token_ids": ids.pop("prompt_token_ids")}
        in_choice.update(ids)
        if self.chat:
            tool_calls = {"tool_calls": calls} if calls else {}
            if role:
                d = ChoiceDelta(role="assistant", content="")
            elif reasoning and self.show_reasoning:
                d = ChoiceDelta(reasoning=reasoning, reasoning_content=reasoning,
                                **({"content": delta} if delta else {}), **tool_calls)
            else:
                d = ChoiceDelta(**({"content": delta} if delta is not None else {}), **tool_calls)
            choice = ChunkChoice(index=index, delta=d, finish_reason=finish_reason, **in_choice,
                                 **({"logprobs": logprobs.model_dump()} if logprobs is not None else {}))
            out = ChatCompletionChunk(id=self.id, object="chat.completion.chunk", created=self.created,
                                      model=self.model_name, choices=[choice],
                                      **(extra or {})).model_dump(exclude_unset=True)
        else:
            # openai's CompletionChoice has no null finish_reason, which every chunk but the last needs.
            shown = logprobs.model_dump(exclude_unset=True) if logprobs is not None else None
            out = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model_name,
                   "choices": [{"index": index, "text": delta or "", "logprobs": shown,
                                "finish_reason": finish_reason, **in_choice}],
                   **{k: v.model_dump(exclude_unset=True) if isinstance(v, BaseModel) else v
                      for k, v in (extra or {}).items()}}
        return f"data: {json.dumps(out)}\n\n"

    def usage_chunk(self, gens: list[Generation], reasoned=None) -> str:
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model_name, "choices": [],
               "usage": usage(gens, reasoned, self.n).model_dump(exclude_unset=True)}
        return f"data: {json.dumps(out)}\n\n"


async def whole_answer(http, jobs: list[Job], seconds: float, render: Callable[[list[Generation]], dict]):
    """Wait for each choice's last step, then answer in one body, as `render` writes the generations (chat and
    completions: `Reply.whole`; the Responses and Messages APIs their own); 499 when the client left."""
    gens = await finished_generations(http, jobs, seconds)
    return Response(status_code=499) if gens is None else JSONResponse(render(gens))


async def finished_generations(http, jobs: list[Job], seconds: float) -> list[Generation] | None:
    """Each choice's generation once its last step is done; None when the client left first. Whatever ends the
    request early (an error, the deadline, the client gone) cancels every choice."""
    deadline, finished = time.monotonic() + seconds, False
    looked = time.monotonic()  # when the client's connection was last looked at
    try:
        for job in jobs:
            while True:
                try:
                    event = await asyncio.wait_for(job.events.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    event = None
                if event is None or time.monotonic() - looked >= 0.5:
                    looked = time.monotonic()
                    if await http.is_disconnected():
                        return None
                if isinstance(event, ErrorReply):
                    if event.code == "llm_unavailable":
                        raise llm_away()
                    raise APIError(event.status, event.message, code=event.code,
                                   kind="server_error" if event.status >= 500 else "invalid_request_error")
                if event is not None and event.finished:
                    break
                if time.monotonic() >= deadline:
                    raise APIError(408, f"the answer took longer than this server's limit of {seconds:g} s "
                                        "(--max-request-seconds): ask for fewer tokens, or stream",
                                   code="request_timeout", kind="server_error")
        finished = True
    finally:
        if not finished:  # free every choice's slot
            for job in jobs:
                job.sequence.cancelled = True
    return [job.sequence.generation for job in jobs]


async def stream_events(jobs: list[Job], reply: Reply, include_usage: bool):
    """Every choice's chunks as they come (`choice_chunks`), then the usage of them all when asked, then [DONE]. An
    error in one choice ends them all."""
    ended: list = [None] * len(jobs)  # per choice, once it is over: ("finished", its Reasoned or None) or ("error",)
    chunks = [choice_chunks(job, dataclasses.replace(reply), index, ended) for index, job in enumerate(jobs)]
    try:
        async for chunk in chunks[0] if len(chunks) == 1 else merged(chunks):
            yield chunk
            if any(e is not None and e[0] == "error" for e in ended):
                break
        if include_usage and all(e is not None and e[0] == "finished" for e in ended):
            reasoned = [e[1] for e in ended]
            yield reply.usage_chunk([job.sequence.generation for job in jobs],
                                    reasoned if reasoned[0] is not None else None)
        yield "data: [DONE]\n\n"
    finally:
        for job, e in zip(jobs, ended):
            if e is None or e[0] != "finished":
                job.sequence.cancelled = True  # the client went away (or an error): free the slot


async def merged(generators):
    """The items of several async generators, each as soon as it comes; closing this closes them all."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(generator):
        try:
            async for item in generator:
                queue.put_nowait(item)
        finally:
            queue.put_nowait(done)

    tasks = [asyncio.create_task(drain(g)) for g in generators]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


@dataclass
class Delta:
    """What one token adds to a choice's stream once it is final: the thinking and answer text it lets show, what it
    adds to the reply's tool calls, its provenance and log-probabilities; the last one its finish reason and usage."""

    token: int
    source: str
    score: float | None
    thinking: str | None  # thinking text (with a reasoning parser)
    content: str  # answer text
    calls: list[ChoiceDeltaToolCall]
    logprobs: ChoiceLogprobs | Logprobs | None
    in_answer: bool  # the token is the answer's, not the thinking's
    finished: bool = False
    finish_reason: str | None = None
    usage: CompletionUsage | None = None  # the last token's; each token's with `running_usage`


@dataclass
class StreamFailure:
    """A stream cut by an error, with what it had sent: where a client can resume from."""

    message: str
    code: str | None
    token_ids: list[int]
    text: str


async def choice_deltas(job: Job, reply: Reply, index: int, ended: list):
    """One choice's `Delta`s: one per token once it is final (at once without verification; with it, once the LLM
    has checked it); text that may still turn out to be a stop string, a thinking tag or a call's syntax is held
    back, so that nothing sent is taken back. Ends with a `StreamFailure` on an error. Sets `ended[index]` when it is
    over."""
    sequence = job.sequence
    gen, tokenizer = sequence.generation, reply.tokenizer
    detok = Detokenizer(tokenizer, skip_special_tokens=sequence.params.skip_special_tokens)
    hold = max((len(s) for s in sequence.params.stop), default=1) - 1  # a stop string may be forming
    text, sent, finished = "", 0, False
    parser = reply.parser
    start = prompt_start(parser, tokenizer, sequence.prompt_ids) if parser else None
    sent_thinking, sent_answer, streamed, calls_sent, made = 0, 0, 0, CallsSent(), 0
    call_stream = CallStream()
    in_answer = parser is None
    while not finished:
        event = await job.events.get()
        if isinstance(event, ErrorReply):
            ended[index] = ("error",)
            yield StreamFailure(event.message, event.code, gen.token_ids[:streamed], text[:sent])
            return
        for n, (token, source, score) in enumerate(event.final, 1):
            finished = event.finished and n == len(event.final)
            streamed += 1
            text += detok.push(token, final=finished)
            if finished:  # the final text has any stop string cut off
                shown = gen.text
            else:  # a stop string may be forming at the end
                sent = max(sent, len(text) - hold)
                shown = text[:sent]
            thinking, answer, calls, answering = None, shown, [], in_answer
            if parser:  # what is shown so far, split; a tag being written is held back
                split = parser.split(shown, start, finished)
                thinking, answer = (split.reasoning or "")[sent_thinking:], split.content
                sent_thinking += len(thinking)
                in_answer = not split.thinking
            if (tool_split := reply.calls(answer, finished, call_stream)) is not None:  # ... and so is a call's syntax
                answer, made = tool_split.content, len(tool_split.calls)
                calls = calls_sent.deltas(tool_split, reply.tools)
            delta = Delta(token, source, score, thinking, answer[sent_answer:], calls,
                          reply.logprobs(gen, streamed - 1, streamed), answering, finished)
            sent_answer = max(sent_answer, len(answer))
            if finished:
                reasoned = reply.reasoned(gen)
                delta.finish_reason, delta.usage = finish_reason(gen, made), usage([gen], reasoned and [reasoned])
                ended[index] = ("finished", reasoned)
            elif reply.running_usage:
                prompt = len(sequence.prompt_ids)
                delta.usage = CompletionUsage(prompt_tokens=prompt, completion_tokens=streamed,
                                              total_tokens=prompt + streamed)
            yield delta


async def choice_chunks(job: Job, reply: Reply, index: int, ended: list):
    """One choice's chunks: its `Delta`s as OpenAI's chunks, each with its token's provenance; the last carries its
    usage. An error ends them with one that says what the client has been sent, to resume from."""
    prompt = {"prompt_token_ids": list(job.sequence.prompt_ids)} if reply.with_ids else {}
    if reply.chat:
        yield reply.chunk(None, role=True, index=index, ids=prompt)
        prompt = {}
    if reply.echo:
        yield reply.chunk(reply.echoed(index), index=index, ids={**prompt, "token_ids": []} if reply.with_ids else None)
        prompt = {}
    async for delta in choice_deltas(job, reply, index, ended):
        if isinstance(delta, StreamFailure):
            error = {"error": {"message": delta.message, "type": "server_error", "param": None, "code": delta.code,
                               "r2r": {"index": index, "token_ids": delta.token_ids, "text": delta.text}}}
            yield f"data: {json.dumps(error)}\n\n"
            return
        extra = {"r2r": {"token_id": delta.token, "source": delta.source, "score": delta.score}}
        if delta.usage is not None:
            extra["usage"] = delta.usage
        yield reply.chunk(delta.content, delta.finish_reason if delta.finished else None, extra,
                          reasoning=delta.thinking, logprobs=delta.logprobs, index=index, calls=delta.calls,
                          stop_reason=job.sequence.generation.stop_reason if delta.finished else None,
                          ids={**prompt, "token_ids": [delta.token]} if reply.with_ids else None)
        prompt = {}


@dataclass
class CallsSent:
    """What a stream has sent of a reply's tool calls, as OpenAI streams them: a call's id, name and the start of
    its arguments once its name is known, then the rest of its arguments as they come (a client adds them up)."""

    ids: list[str] = dataclasses.field(default_factory=list)
    arguments: list[str] = dataclasses.field(default_factory=list)

    def deltas(self, split: ToolSplit, parser: ToolParser) -> list[ChoiceDeltaToolCall]:
        out = []
        for k, call in enumerate(split.calls + ([split.writing] if split.writing else [])):
            if k == len(self.ids):
                self.ids.append(parser.call_id())
                self.arguments.append(call.arguments)
                out.append(ChoiceDeltaToolCall(index=k, id=self.ids[k], type="function", function=(
                    ChoiceDeltaToolCallFunction(name=call.name, arguments=call.arguments))))
            elif len(call.arguments) > len(self.arguments[k]) and call.arguments.startswith(self.arguments[k]):
                more, self.arguments[k] = call.arguments[len(self.arguments[k]):], call.arguments
                out.append(ChoiceDeltaToolCall(index=k, function=ChoiceDeltaToolCallFunction(arguments=more)))
        return out


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
