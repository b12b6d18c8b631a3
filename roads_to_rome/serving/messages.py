"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`), as vLLM and llama.cpp's server serve it
for clients written against it (the `anthropic` package, agents built on it): a request's system prompt and messages
become a chat, which the chat path answers (tools, thinking, structured outputs and R2R's knobs alike), and the reply
comes back as content blocks: the thinking as a `thinking` block, the answer as `text`, each call as `tool_use`;
whole, or streamed as the API's events. Errors have Anthropic's shape (`errors.shaped`), and the API key
may come as its `x-api-key` header. The request's models: messages_schemas.py; here, the answer."""

from __future__ import annotations

import json
from contextlib import aclosing
from dataclasses import dataclass, field

from roads_to_rome.core.request import Generation
from roads_to_rome.serving.engine_thread import Job
from roads_to_rome.serving.errors import ANTHROPIC_ERROR_TYPES
from roads_to_rome.serving.replies import Reply, new_id, provenance, usage
from roads_to_rome.serving.streams import StreamFailure, choice_deltas


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
    events = Events(draft)
    yield events.event("message_start", message=draft.message([]))
    async with aclosing(choice_deltas(job, reply)) as deltas:
        async for delta in deltas:
            if isinstance(delta, StreamFailure):
                for chunk in events.close():
                    yield chunk
                kind = ANTHROPIC_ERROR_TYPES.get(delta.status, "api_error")  # (as the whole reply's error says)
                yield events.event("error", error={"type": kind, "message": delta.message})
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
                whole = message_usage(gen, draft.prompt_tokens, delta.reasoned)
                yield events.event("message_delta", delta={"stop_reason": reason[0], "stop_sequence": reason[1]},
                                   usage=whole, r2r=provenance(gen))
                yield events.event("message_stop")
