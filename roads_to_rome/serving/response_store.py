"""The Responses API's kept responses (`store`, the default): for a later request to go on from
(`previous_response_id`), for GET, DELETE and cancel, and the background ones being written; in memory, as the
bytes of their JSON, the least recently used dropped beyond a budget."""

from __future__ import annotations

import asyncio
import json
import sys
from collections import OrderedDict
from dataclasses import dataclass

from roads_to_rome.serving.engine_thread import ErrorReply, Job
from roads_to_rome.serving.errors import APIError
from roads_to_rome.serving.replies import Reply, new_id
from roads_to_rome.serving.responses import Draft, failure, whole_response


def listed_items(given: list) -> list[dict]:
    """A request's input items as the API lists them back: each with an id, a message's content as parts."""
    items = []
    for item in given:
        listed = item.model_dump(by_alias=True, exclude_none=True)
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}[item.type]
        listed.setdefault("id", new_id(prefix))
        if item.type == "message" and isinstance(item.content, str):
            kind = "output_text" if item.role == "assistant" else "input_text"
            listed["content"] = [{"type": kind, "text": item.content}]
        items.append({"type": item.type, **listed})
    return items


def conversation_of(response: dict) -> list[dict]:
    """A response's output as chat messages, for a later request to go on from: its thinking, answer and calls in
    one assistant message (templates that show earlier thinking within a tool loop get it)."""
    text, calls, thinking = "", [], None
    for item in response["output"]:
        if item["type"] == "reasoning":
            thinking = (thinking or "") + "".join(part["text"] for part in item["content"])
        elif item["type"] == "message":
            text += "".join(part.get("text", "") for part in item["content"])
        elif item["type"] == "function_call":
            calls.append({"id": item["call_id"], "type": "function",
                          "function": {"name": item["name"], "arguments": item["arguments"]}})
    message = {"role": "assistant", "content": text if text or not calls else None}
    if thinking is not None:
        message["reasoning_content"] = thinking
    return [{**message, "tool_calls": calls} if calls else message]


@dataclass(frozen=True)
class Stored:
    """A kept response as the bytes of its JSON, beside the chat it ends (without its instructions: what a later
    request goes on from) and its request's input as the API lists it: the memory it holds is what the store's
    budget counts (parsed objects would take several times their JSON)."""

    blob: bytes

    @classmethod
    def of(cls, response: dict, conversation: list[dict], input_items: list[dict]) -> Stored:
        return cls(json.dumps([response, conversation, input_items], ensure_ascii=False).encode())

    @property
    def size(self) -> int:
        return sys.getsizeof(self.blob)

    @property
    def response(self) -> dict:
        return json.loads(self.blob)[0]

    @property
    def conversation(self) -> list[dict]:
        return json.loads(self.blob)[1]

    @property
    def input_items(self) -> list[dict]:
        return json.loads(self.blob)[2]


class ResponseStore:
    """Responses kept for `previous_response_id`, GET and DELETE: in memory, within `budget` bytes (what they hold
    there: `Stored`), the least recently used dropped first. A server's restart drops them all."""

    def __init__(self, budget: int):
        self.budget, self.size = budget, 0
        self.kept: OrderedDict[str, Stored] = OrderedDict()
        self.running: dict[str, tuple[asyncio.Task, Job, Draft]] = {}  # background responses being written

    def start(self, job: Job, reply: Reply, draft: Draft) -> dict:
        """A background response: kept as queued at once, written on (`in_progress` from its first token), and kept
        again once it is done (or failed)."""
        queued = draft.response("queued", [])
        self.put(queued, draft)
        self.running[draft.id] = (asyncio.create_task(self.finish(job, reply, draft, queued)), job, draft)
        return queued

    async def finish(self, job: Job, reply: Reply, draft: Draft, shown: dict) -> None:
        try:
            while True:
                event = await job.events.get()
                if isinstance(event, ErrorReply):
                    self.put(draft.response("failed", [], error=failure(event.message, event.status, event.code)),
                             draft)
                    return
                if shown["status"] != "in_progress":  # (what a GET meanwhile shows)
                    shown["status"] = "in_progress"
                    self.put(shown, draft)
                if event.finished:
                    break
            self.put(whole_response(draft, reply, job.sequence.generation), draft)
        finally:
            self.running.pop(draft.id, None)

    def cancel(self, response_id: str) -> dict:
        """A background response stopped where it is (one that is done is left as it is); a 404 or 400 naming it
        when there is none to cancel."""
        if response_id in self.running:
            task, job, draft = self.running.pop(response_id)
            job.sequence.cancelled = True  # its slot is freed at the engine's next step
            task.cancel()
            self.put(draft.response("cancelled", []), draft)
        stored = self.stored(response_id)
        if not stored.response["background"]:
            raise APIError(400, "only a background response can be cancelled: this one was answered when asked",
                           param="response_id")
        return stored.response

    def get(self, response_id: str) -> Stored | None:
        stored = self.kept.get(response_id)
        if stored is not None:
            self.kept.move_to_end(response_id)
        return stored

    def stored(self, response_id: str) -> Stored:
        """The response kept under this id, or the 404 naming it."""
        stored = self.get(response_id)
        if stored is None:
            raise APIError(404, f"no response {response_id!r} is kept on this server", param="response_id",
                           code="response_not_found")
        return stored

    def put(self, response: dict, draft: Draft) -> None:
        """Keep a response, in place of what was kept under its id (a background one's earlier state)."""
        self.forget(response["id"])
        stored = Stored.of(response, draft.conversation + conversation_of(response), listed_items(draft.body.input))
        if stored.size > self.budget:
            return
        self.kept[response["id"]] = stored
        self.size += stored.size
        while self.size > self.budget:
            self.size -= self.kept.popitem(last=False)[1].size

    def delete(self, response_id: str) -> bool:
        """Forget a response (a background one being written is cancelled first); False when none was kept."""
        if response_id in self.running:
            self.cancel(response_id)
        return self.forget(response_id)

    def forget(self, response_id: str) -> bool:
        stored = self.kept.pop(response_id, None)
        if stored is not None:
            self.size -= stored.size
        return stored is not None

    def history(self, response_id: str | None) -> list[dict]:
        """The conversation a request goes on from: the stored response's (a 404 naming it when it is not kept)."""
        if response_id is None:
            return []
        stored = self.get(response_id)
        if stored is None:
            raise APIError(404, f"previous_response_id {response_id!r} is not kept on this server (responses are "
                                "kept in memory when stored, the least recently used dropped beyond the server's "
                                "budget, all of them at a restart): send the conversation as input instead",
                           param="previous_response_id", code="previous_response_not_found")
        if stored.response["status"] in ("queued", "in_progress"):
            raise APIError(400, f"previous_response_id {response_id!r} is still being written: fetch it (GET "
                                "/v1/responses/{id}) until it is done, then go on from it",
                           param="previous_response_id")
        return stored.conversation
