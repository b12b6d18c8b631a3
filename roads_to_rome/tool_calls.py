"""Tool calling (OpenAI's `tools`): the functions a chat request offers go to the chat template, and the calls the
model writes come back out of its reply as `tool_calls`, as vLLM's and llama.cpp's tool parsers hand them to clients.

Three call syntaxes, as vLLM names them. `hermes`, which Qwen2.5's, Qwen3's and Hermes' templates teach: each call a
JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`. Qwen2.5-Coder (the default
pair) writes the object without the tags, alone or in a ```json code fence: a reply that opens with such objects,
each naming an offered function, is read as calls too. `llama3_json`, which Llama 3.1's and 3.2's templates teach:
the reply is `{"name": ..., "parameters": {...}}` objects, separated by `;`, maybe after `<|python_tag|>`.
`mistral`, which Mistral's templates teach: the reply is a JSON list of `{"name": ..., "arguments": {...}}` objects
after `[TOOL_CALLS]` (a special token: usually gone from the decoded text), and a call's id is 9 letters and digits,
as those templates require of the ids handed back. Every parser reads every syntax's bare objects, with either key,
and lists of them. Text outside the calls is the message's content; a block that does not hold a call stays in the
content, so nothing the model wrote is lost.

`tool_choice`: "auto" parses what the model writes; "required" and a named function hold the reply to calls by a
grammar (core/grammar.py), tagged or bare as the model prefers under hermes, so that one parser reads every reply;
"none" leaves the tools out of the prompt. `parallel_tool_calls: false` allows one call: the grammar's, or the end of
the reply at the first call's closing tag (of bare calls, the first is kept)."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from roads_to_rome.core.grammar import OutputFormat
from roads_to_rome.errors import R2RError
from roads_to_rome.reasoning import partial_tag

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCE = re.compile(r"\s*```(?:json)?[ \t]*\n")  # a code fence around bare calls
FENCE_OPENINGS = ("```json\n", "```\n")
PYTHON_TAG = "<|python_tag|>"  # Llama 3's opening of a call (a special token: usually gone from the decoded text)
MISTRAL_TAG = "[TOOL_CALLS]"  # Mistral's opening of its list of calls (a special token too)
TAGS = (PYTHON_TAG, MISTRAL_TAG)
LLAMA_HINT = '"parameters": dictionary'  # Llama 3.1's and 3.2's templates: `Respond in the format {"name": ...`
PARSERS = ("auto", "hermes", "llama3_json", "mistral", "none")
ARGUMENT_KEYS = {"hermes": "arguments", "llama3_json": "parameters", "mistral": "arguments"}  # what calls write


def check_tool_parser(name: str) -> str:
    if name not in PARSERS:
        raise R2RError(f"--tool-call-parser takes {', '.join(PARSERS)}, not {name!r}")
    return name


def resolve_tool_parser(name: str, tokenizer) -> str | None:
    """The parser a tokenizer's replies get: `auto` picks hermes when the chat template teaches `<tool_call>`,
    llama3_json when it teaches Llama 3's JSON calls, none otherwise (its template would not show the model the
    tools)."""
    check_tool_parser(name)
    if name != "auto":
        return None if name == "none" else name
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str):
        return None
    if OPEN in template:
        return "hermes"
    if MISTRAL_TAG in template:
        return "mistral"
    return "llama3_json" if LLAMA_HINT in template or PYTHON_TAG in template else None


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI hands it


@dataclass
class ToolSplit:
    content: str  # the text outside the calls (so far: what may be shown)
    calls: list[ToolCall]
    # Not final: the call being written after those, once its name is known, with its arguments' text so far (a
    # prefix of what they will be, for a stream to send as they come).
    writing: ToolCall | None = None


# How models write a call: its name first, then its arguments as an object. A call written so is read as it is
# written, and its arguments' text is the model's own, compacted (`compact_json`), so that what a stream has sent of
# them is a prefix of the whole.
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)',
                       re.DOTALL)


def compact_json(text: str) -> str:
    """JSON text (or the start of it) spaced as json.dumps spaces it: no whitespace but a space after each `:` and
    `,`; strings as written. The compacted start of a text is the start of the compacted whole."""
    return Compactor()(text)


class Compactor:
    """`compact_json` of a text that grows (a call's arguments as a stream writes them): each call compacts only what
    was added since the one before, a text that does not extend the last starting afresh."""

    def __init__(self):
        self.raw, self.compacted, self.in_string, self.escaped = "", "", False, False

    def __call__(self, text: str) -> str:
        if not text.startswith(self.raw):
            self.__init__()
        out, in_string, escaped = [], self.in_string, self.escaped
        for char in text[len(self.raw):]:
            if in_string:
                escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
            elif char in " \t\r\n":
                continue
            elif char in ":,":
                char += " "
            else:
                in_string = char == '"'
            out.append(char)
        self.raw, self.in_string, self.escaped = text, in_string, escaped
        self.compacted += "".join(out)
        return self.compacted


class CallStream:
    """What one stream's reading of its reply's calls keeps between tokens (`ToolParser.split` with it): the split up
    to the end of the last call that closed, which a longer text only extends, and the compaction of the arguments
    of the call being written. Each token then costs what it added, not the whole reply again."""

    def __init__(self):
        self.prefix, self.settled = "", None  # the text up to where the split is settled, and (at, content, calls)
        self.compact = Compactor()

    def resume(self, text: str) -> tuple[int, list[str], list[ToolCall]] | None:
        if self.settled is None or not text.startswith(self.prefix):
            return None
        at, content, calls = self.settled
        return at, list(content), list(calls)

    def settle(self, text: str, at: int, content: list[str], calls: list[ToolCall]) -> None:
        self.prefix, self.settled = text[:at], (at, list(content), list(calls))


@dataclass(frozen=True)
class ToolParser:
    """Reads the calls out of a reply's answer. `names`: the functions offered; a bare object is a call only when
    it names one of them (a reply that is a JSON answer stays one). It reads either syntax."""

    names: frozenset[str]
    syntax: str = "hermes"  # the call syntax the server's parser names (the ids it gives calls)

    def call_id(self) -> str:
        """A new call's id: OpenAI's shape, or 9 letters and digits for Mistral's templates."""
        return secrets.token_hex(5)[:9] if self.syntax == "mistral" else "call_" + secrets.token_hex(12)

    def split(self, text: str, final: bool = True, stream: CallStream | None = None) -> ToolSplit:
        """The calls in `text` and the text around them. Not `final`: what may still turn out to be part of a call
        (a tag being written, an unclosed call, an opening JSON object, whitespace next to calls) is held back, so
        that what a stream has sent is never taken back: the split of a longer text extends this one's; the call
        being written comes as `writing` once its name is known. `stream`: what a stream keeps between its tokens'
        splits, to read only what each added."""
        content: list[str] = []
        calls: list[ToolCall] = []
        writing: list[ToolCall | None] = []  # (set by the part that reads the call being written)
        compact = stream.compact if stream is not None else compact_json
        resumed = stream.resume(text) if stream is not None else None
        if resumed is not None:
            at, content, calls = resumed
        else:
            at = self._bare_calls(text, final, content, calls, writing, compact)
        while at is not None:
            start = text.find(OPEN, at)
            if start < 0:  # the rest is text, maybe with a tag being written at its end
                segment = text[at:len(text) - (0 if final else partial_tag(text[at:], OPEN))]
                if segment.strip() or (final and not calls):
                    content.append(segment)
                break
            segment, end = text[at:start], text.find(CLOSE, start)
            if end < 0 and not final:  # a call being written
                if segment.strip():
                    content.append(segment)
                writing.append(self._written(text[start + len(OPEN):], tagged=True, compact=compact))
                break
            stop = len(text) if end < 0 else end + len(CLOSE)
            call = self._call(text[start + len(OPEN): end if end >= 0 else len(text)], tagged=True)
            if call is None:  # not a call: the model's text, as written
                content.append(segment + text[start:stop])
            else:  # whitespace between calls is the syntax's, not content
                if segment.strip():
                    content.append(segment)
                calls.append(call)
            at = None if end < 0 else stop
            if at is not None and stream is not None:
                stream.settle(text, at, content, calls)
        return ToolSplit("".join(content), calls, writing[0] if writing else None)

    def _bare_calls(self, text: str, final: bool, content: list[str], calls: list[ToolCall],
                    writing: list[ToolCall | None], compact=compact_json) -> int | None:
        """Calls written as bare JSON objects at the reply's start, maybe in a code fence (Qwen2.5-Coder's habits)
        or after Llama 3's `<|python_tag|>`, separated by whitespace or `;`, or as a JSON list (Mistral's, maybe
        after `[TOOL_CALLS]`): where the rest begins, or None while what comes may still be one (`writing`: the one
        being written, once it names an offered function)."""
        decoder, at = json.JSONDecoder(), 0
        fence, opening = FENCE.match(text), text.lstrip()
        tag = next((tag for tag in TAGS if opening.startswith(tag)), None)
        if fence:
            at = fence.end()
        elif tag:
            at = len(text) - len(opening) + len(tag)
        elif not final and opening and any(f.startswith(opening) for f in (*FENCE_OPENINGS, *TAGS)):
            return None  # a fence or a tag being opened
        start = len(text) - len(text[at:].lstrip())
        listed = text.startswith("[", start)  # Mistral's: the calls as a JSON list
        if listed:
            at = start + 1
        while True:
            start = len(text) - len(text[at:].lstrip())
            if calls and text.startswith("," if listed else ";", start):  # the separator: Mistral's or Llama 3's
                start = len(text) - len(text[start + 1 :].lstrip())
                if not final and start == len(text):
                    return None  # the next call may follow
            if listed and calls and text.startswith("]", start):  # the list's end
                at = start + 1
                break
            if listed and calls and not final and start == len(text):
                return None  # a separator or the list's end may follow
            if not text.startswith("{", start):
                break
            try:
                value, end = decoder.raw_decode(text, start)
            except ValueError:
                if final:
                    break
                writing.append(self._written(text[start:], tagged=False, compact=compact))
                return None  # an object being written, or not JSON at all: known once it ends
            call = self._call_object(value, tagged=False, text=text[start:end])
            if call is None:
                break
            calls.append(call)
            at = end
        if not calls:  # the text is the model's, as written (once it is more than whitespace)
            return None if not final and not text[at:].strip() else 0
        if fence:
            start = len(text) - len(text[at:].lstrip())
            if text.startswith("```", start):
                return start + 3
            if not final and "```".startswith(text[start:]):
                return None
        return at

    def _call(self, body: str, tagged: bool) -> ToolCall | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        return self._call_object(value, tagged, body)

    def _call_object(self, value, tagged: bool, text: str) -> ToolCall | None:
        """A call, from the JSON object a model wrote (`text`); None when it is not one. Tagged blocks may name any
        function (the client sees what the model called); bare objects only the offered ones."""
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        if written := self._written(text, tagged):  # written name first: read as one as it came, whatever follows
            return written
        keys = [key for key in dict.fromkeys(ARGUMENT_KEYS.values()) if key in value]  # under any syntax's key
        if len(keys) > 1 or (not tagged and (value["name"] not in self.names or len(value) > 1 + len(keys))):
            return None
        arguments = value[keys[0]] if keys else {}
        if isinstance(arguments, str):  # some models write the arguments' JSON as a string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))

    def _written(self, body: str, tagged: bool, compact=compact_json) -> ToolCall | None:
        """The call `body` starts, written name first (`CALL_HEAD`), with its arguments' text so far, compacted
        (by `compact`: a stream's `Compactor`); None when it is not written so or (bare) names no offered
        function."""
        head = CALL_HEAD.match(body)
        if head is None:
            return None
        try:
            name = json.loads(head[1])
        except ValueError:  # a bad escape in it
            return None
        if not tagged and name not in self.names:
            return None
        try:
            end = json.JSONDecoder().raw_decode(body, head.end())[1]
        except ValueError:
            end = len(body)  # the arguments being written
        return ToolCall(name, compact(body[head.end():end]))


def call_format(functions: list[dict], one: bool, syntax: str = "hermes") -> OutputFormat:
    """A grammar that holds a reply to calls of these functions (each {"name", "parameters"}), their arguments to
    each function's parameters' schema and spaced as templates write them; `one`: a single call. Under hermes calls
    are tagged, as the template teaches, or bare objects, as Qwen2.5-Coder writes them: the model takes the way it
    prefers (held to tags, that one goes on calling where it would have stopped). The tags are text to the grammar;
    where the tokenizer has a token for one, that token writes it. Under llama3_json, bare objects, `; ` between;
    under mistral, a JSON list of them (the grammar leaves out `[TOOL_CALLS]`, which the parser does not need)."""
    objects, key = [], ARGUMENT_KEYS[syntax]
    for function in functions:
        schema = {"type": "object", "properties": {"name": {"const": function["name"]},
                                                   key: function.get("parameters") or {"type": "object"}},
                  "required": ["name", key], "additionalProperties": False,
                  "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
        objects.append(f"%json{json.dumps(schema)}")
    object_rule = f"object: {' | '.join(objects)}"
    if syntax == "llama3_json":
        start = "start: object" if one else 'start: object ("; " object)*'
        return OutputFormat("grammar", f"{start}\n{object_rule}\n")
    if syntax == "mistral":
        start = 'start: "[" object "]"' if one else 'start: "[" object (", " object)* "]"'
        return OutputFormat("grammar", f"{start}\n{object_rule}\n")
    opening, closing = json.dumps(OPEN + "\n"), json.dumps("\n" + CLOSE)
    rules = [object_rule, f"tagged: {opening} object {closing}"]
    if one:
        return OutputFormat("grammar", "\n".join(["start: tagged | object", *rules]) + "\n")
    return OutputFormat("grammar", "\n".join(['start: tagged ("\\n" tagged)* | object ("\\n" object)*',
                                               *rules]) + "\n")
