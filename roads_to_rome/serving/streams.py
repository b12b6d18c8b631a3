"""A request's answers as they are written: each choice's deltas once its tokens are final (`choice_deltas`, which
every API streams from), OpenAI's chunks of them (`stream_events`), and the wait for a whole answer
(`whole_answer`). A choice's stream ends by itself and says how (its last `Delta`, or a `StreamFailure`); a stream
closed before that cancels its choice."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass

from fastapi.responses import JSONResponse, Response
from openai.types import CompletionUsage
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import ChoiceDeltaToolCall, ChoiceDeltaToolCallFunction
from openai.types.completion_choice import Logprobs

from roads_to_rome.core.request import Generation
from roads_to_rome.reasoning import Reasoned, prompt_start
from roads_to_rome.serving.engine_thread import ErrorReply, Job
from roads_to_rome.serving.errors import APIError, error_type, llm_away
from roads_to_rome.serving.replies import ChatReply, CompletionReply, Reply, TextOffsets, finish_reason, usage
from roads_to_rome.text import Detokenizer
from roads_to_rome.tool_calls import CallStream, ToolParser, ToolSplit


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
                                   kind=error_type(event.status))
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




@dataclass
class Delta:
    """What one token adds to a choice's stream once it is final: the thinking and answer text it lets show, what it
    adds to the reply's tool calls, its provenance and log-probabilities; the last one how the choice ended."""

    token: int
    source: str
    score: float | None
    thinking: str | None  # thinking text (with a reasoning parser)
    content: str  # answer text
    calls: list[ChoiceDeltaToolCall]
    logprobs: ChoiceLogprobs | Logprobs | None
    in_answer: bool  # the token is the answer's, not the thinking's
    finished: bool = False  # the choice's last: then its finish reason, usage and thinking apart
    finish_reason: str | None = None
    usage: CompletionUsage | None = None  # the last token's; each token's with `running_usage`
    reasoned: Reasoned | None = None


@dataclass
class StreamFailure:
    """A stream cut by an error, with what it had sent: where a client can resume from."""

    message: str
    code: str | None
    token_ids: list[int]
    text: str
    status: int = 500  # what a whole reply would have answered: below 500, the request's own settings failed it


async def choice_deltas(job: Job, reply: Reply):
    """One choice's `Delta`s: one per token once it is final (at once without verification; with it, once the LLM
    has checked it); text that may still turn out to be a stop string, a thinking tag or a call's syntax is held
    back, so that nothing sent is taken back. Ends with a finished `Delta`, or a `StreamFailure` on an error; closed
    before either (the client left), it cancels the choice, freeing its slot."""
    finished = False
    try:
        async for delta in _deltas(job, reply):
            finished = isinstance(delta, Delta) and delta.finished
            yield delta
    finally:
        if not finished:
            job.sequence.cancelled = True


async def _deltas(job: Job, reply: Reply):
    sequence = job.sequence
    gen, tokenizer, parser = sequence.generation, reply.tokenizer, reply.parser
    detok = Detokenizer(tokenizer, skip_special_tokens=sequence.params.skip_special_tokens)
    hold = max((len(s) for s in sequence.params.stop), default=1) - 1  # a stop string may be forming
    start = prompt_start(parser, tokenizer, sequence.prompt_ids) if parser else None
    text, sent, sent_thinking, sent_answer, streamed, made = "", 0, 0, 0, 0, 0
    calls_sent, call_stream, offsets, in_answer = CallsSent(), CallStream(), TextOffsets(), parser is None
    while True:
        event = await job.events.get()
        if isinstance(event, ErrorReply):
            yield StreamFailure(event.message, event.code, gen.token_ids[:streamed], text[:sent], event.status)
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
                          reply.logprobs(gen, streamed - 1, streamed, offsets), answering, finished)
            sent_answer = max(sent_answer, len(answer))
            if finished:
                delta.reasoned = reply.reasoned(gen)
                delta.finish_reason = finish_reason(gen, made)
                delta.usage = usage([gen], delta.reasoned and [delta.reasoned])
            elif reply.running_usage:
                prompt = len(sequence.prompt_ids)
                delta.usage = CompletionUsage(prompt_tokens=prompt, completion_tokens=streamed,
                                              total_tokens=prompt + streamed)
            yield delta
            if finished:
                return


@dataclass
class ChoiceEnd:
    """How one choice's chunks ended (`choice_chunks`' last item): finished, with its thinking apart, or failed."""

    index: int
    failed: bool
    reasoned: Reasoned | None = None


async def stream_events(jobs: list[Job], reply: ChatReply | CompletionReply, include_usage: bool):
    """Every choice's chunks as they come (`choice_chunks`), then the usage of them all when asked, then [DONE]. An
    error in one choice ends them all."""
    ends: dict[int, ChoiceEnd] = {}
    chunks = [choice_chunks(job, reply, index) for index, job in enumerate(jobs)]
    async with aclosing(merged(chunks)) as items:
        async for item in items:
            if not isinstance(item, ChoiceEnd):
                yield item
            elif item.failed:
                break
            else:
                ends[item.index] = item
    if include_usage and len(ends) == len(jobs):
        reasoned = [ends[i].reasoned for i in range(len(jobs))]
        gens = [job.sequence.generation for job in jobs]
        yield reply.usage_chunk(gens, reasoned if reasoned[0] is not None else None)
    yield "data: [DONE]\n\n"


async def choice_chunks(job: Job, reply: ChatReply | CompletionReply, index: int):
    """One choice's chunks: its `Delta`s as OpenAI's chunks, each with its token's provenance; the last carries its
    usage. An error ends them with one that says what the client has been sent, to resume from. Its last item is its
    `ChoiceEnd`."""
    prompt = {"prompt_token_ids": list(job.sequence.prompt_ids)} if reply.with_ids else {}
    if reply.chat:
        yield reply.chunk(None, role=True, index=index, ids=prompt)
        prompt = {}
    if reply.echo:
        yield reply.chunk(reply.echoed(index), index=index, ids={**prompt, "token_ids": []} if reply.with_ids else None)
        prompt = {}
    async with aclosing(choice_deltas(job, reply)) as deltas:
        async for delta in deltas:
            if isinstance(delta, StreamFailure):
                error = {"error": {"message": delta.message, "type": error_type(delta.status), "param": None,
                                   "code": delta.code,
                                   "r2r": {"index": index, "token_ids": delta.token_ids, "text": delta.text}}}
                yield f"data: {json.dumps(error)}\n\n"
                yield ChoiceEnd(index, failed=True)
                return
            extra = {"r2r": {"token_id": delta.token, "source": delta.source, "score": delta.score}}
            if delta.usage is not None:
                extra["usage"] = delta.usage
            yield reply.chunk(delta.content, delta.finish_reason if delta.finished else None, extra,
                              reasoning=delta.thinking, logprobs=delta.logprobs, index=index, calls=delta.calls,
                              stop_reason=job.sequence.generation.stop_reason if delta.finished else None,
                              ids={**prompt, "token_ids": [delta.token]} if reply.with_ids else None)
            prompt = {}
            if delta.finished:
                yield ChoiceEnd(index, failed=False, reasoned=delta.reasoned)


async def merged(generators):
    """The items of several async generators, each as soon as it comes; closing this closes them all (each choice's
    stream then cancels its choice, if it had not ended)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(generator):
        try:
            async with aclosing(generator):
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
