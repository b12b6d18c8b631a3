"""Reasoning models' thinking (`<think>…</think>`), apart from the answer: what vLLM's and llama.cpp's reasoning
parsers hand clients as `reasoning` / `reasoning_content`.

Two parsers, as vLLM names them. Both read the prompt's own tags first: a chat template that opens `<think>` (the
R1-Distill template's generation prompt ends with it) starts the reply inside the thinking; one that opens and closes
it (Qwen3 with thinking turned off) starts it in the answer. Where the prompt has no tag, they differ:
`deepseek_r1` takes the reply as thinking until `</think>` (R1 models may leave out the opening tag); `qwen3` takes
it as thinking only when it opens with `<think>`. A reply cut off inside its thinking has an empty answer."""

from __future__ import annotations

from dataclasses import dataclass

from roads_to_rome.errors import R2RError
from roads_to_rome.text import token_pieces

OPEN, CLOSE = "<think>", "</think>"
DEEPSEEK_ASSISTANT = "<｜Assistant｜>"  # DeepSeek's chat templates' turn marker
PARSERS = ("auto", "deepseek_r1", "qwen3", "none")


def check_parser(name: str) -> str:
    if name not in PARSERS:
        raise R2RError(f"--reasoning-parser takes {', '.join(PARSERS)}, not {name!r}")
    return name


def resolve_parser(name: str, tokenizer) -> str | None:
    """The parser a tokenizer's replies get: `auto` picks one from the chat template: deepseek_r1 when its
    generation prompt opens `<think>` or it is DeepSeek's (R1-Distill's first template mentions `</think>` only to
    drop earlier turns' thinking, and its models open the tag themselves, or not), qwen3 when it mentions the tags
    otherwise; none when it does not mention them."""
    check_parser(name)
    if name == "none":
        return None
    if name != "auto":
        return name
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or OPEN not in template and CLOSE not in template:
        return None
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                               tokenize=False)
    except Exception:  # a template that needs more than one user message: the mention alone decides
        prompt = ""
    return "deepseek_r1" if opens_thinking(prompt) or DEEPSEEK_ASSISTANT in template else "qwen3"


def opens_thinking(prompt: str) -> bool | None:
    """Whether a prompt leaves the reply inside `<think>` (True), closed it (False), or has no tag (None)."""
    opened, closed = prompt.rfind(OPEN), prompt.rfind(CLOSE)
    if opened < 0 and closed < 0:
        return None
    return opened > closed


@dataclass
class Split:
    reasoning: str | None  # None: the reply has no thinking
    content: str
    thinking: bool  # still inside the thinking at the end of the text


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (what a stream must hold back)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass(frozen=True)
class ReasoningParser:
    name: str  # deepseek_r1 or qwen3

    def start(self, prompt: str) -> str:
        """How a reply to this prompt starts: "thinking", "answer", or "maybe" (thinking if it opens the tag)."""
        state = opens_thinking(prompt)
        if state is None:
            return "thinking" if self.name == "deepseek_r1" else "maybe"
        return "thinking" if state else "answer"

    def split(self, text: str, start: str, final: bool = True) -> Split:
        """The thinking and the answer in a reply's text so far. Not `final`: the end of the text that may be a tag
        being written is held back, so that what a stream has sent is never taken back."""
        if start == "answer":
            return Split(None, text, False)
        stripped = text.lstrip()
        if stripped.startswith(OPEN):  # (in "thinking": a model that writes the tag its template already wrote)
            text = stripped[len(OPEN):]
        elif not final and OPEN.startswith(stripped):  # `<think>` may be forming
            return Split(None, "", False) if start == "maybe" else Split("", "", True)
        elif start == "maybe":
            return Split(None, text, False)
        end = text.find(CLOSE)
        if end < 0:
            held = 0 if final else partial_tag(text, CLOSE)
            return Split(text[:len(text) - held], "", True)
        return Split(text[:end], text[end + len(CLOSE):].lstrip(), False)


def parser_for(name: str | None) -> ReasoningParser | None:
    return ReasoningParser(name) if name else None


def thinking_tokens(parser: ReasoningParser, start: str, pieces: list[str]) -> int:
    """How many of a reply's tokens (given as their text pieces) belong to the thinking, its closing tag included."""
    text = "".join(pieces)
    split = parser.split(text, start)
    if split.reasoning is None:
        return 0
    if split.thinking:
        return len(pieces)
    end, length = text.find(CLOSE) + len(CLOSE), 0
    for n, piece in enumerate(pieces):
        length += len(piece)
        if length >= end:
            return n + 1
    return len(pieces)


def prompt_start(parser: ReasoningParser, tokenizer, prompt_ids) -> str:
    """How a reply to these prompt tokens starts (`ReasoningParser.start`): the tags sit at the prompt's end."""
    return parser.start(tokenizer.decode(list(prompt_ids)[-32:], skip_special_tokens=False))


def thinking_until(parser: ReasoningParser, tokenizer, prompt_ids) -> int | None:
    """The token that closes the thinking a reply to these prompt tokens starts inside, where a structured output
    begins (None: the reply starts in its answer; a qwen3 reply that could open a thinking itself is held to the
    format from its first token, so it answers at once)."""
    if prompt_start(parser, tokenizer, prompt_ids) != "thinking":
        return None
    token = tokenizer.convert_tokens_to_ids(CLOSE)
    if not isinstance(token, int) or token == tokenizer.unk_token_id:
        raise R2RError(f"this tokenizer writes {CLOSE} in several tokens: a structured output cannot tell where the "
                       "thinking ends; ask for it without the reasoning parser (--reasoning-parser none)")
    return token


@dataclass
class Reasoned:
    """A finished reply split into thinking and answer, with the LLM's share of each."""

    reasoning: str | None
    content: str
    reasoning_tokens: int
    llm_rate_thinking: float | None  # None: no tokens in that part
    llm_rate_answer: float | None

    def to_dict(self) -> dict:
        return {"reasoning": self.reasoning, "content": self.content, "reasoning_tokens": self.reasoning_tokens,
                "llm_rate_thinking": self.llm_rate_thinking, "llm_rate_answer": self.llm_rate_answer}


def llm_rate(sources: list[str]) -> float | None:
    return sum(s != "slm" for s in sources) / len(sources) if sources else None


def reason(parser: ReasoningParser, tokenizer, generation) -> Reasoned:
    start = prompt_start(parser, tokenizer, generation.prompt_ids)
    split = parser.split(generation.text, start)
    n = thinking_tokens(parser, start, token_pieces(tokenizer, generation.token_ids))
    return Reasoned(split.reasoning, split.content, n, llm_rate(generation.sources[:n]),
                    llm_rate(generation.sources[n:]))
