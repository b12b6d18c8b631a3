"""Structured outputs: a format the output must follow (a JSON schema, any JSON object, a regular expression, one of
several strings, a Lark or GBNF grammar, or free text holding structures such as tool calls: a structural tag), as
llguidance compiles and walks it (vLLM's `guidance` backend does the same).

`OutputFormat` is what a request asks for (immutable, checked when made). `GrammarWalk` is one sequence's walk
through it: the tokens allowed at any output index, given the tokens before it. R2R writes a token from either model
and verification may take tokens back, so a walk is asked about any index, not only the next one: it rolls the
matcher back to the longest prefix it shares with the output and forward from there, and keeps the last masks it
computed (a token is checked at the index it was proposed at). The masks apply to every model's logits alike
(`sampling.adjust_logits`), so strict verification under a format is still the LLM's own constrained output.

A reasoning model's thinking is not constrained: where the reply starts inside it, the format applies after the
token that closes it (`GrammarWalk.think_end`), as vLLM applies it once its reasoning parser sees the end."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch

from roads_to_rome.core.structural_tags import structural_tag_grammar
from roads_to_rome.errors import R2RError

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
KEEP_MASKS = 64  # masks a walk keeps: enough for every token a verification check may look back at


class FormatTooComplex(R2RError):
    """A format that compiled, but that the walk cannot follow: llguidance refused a token its own mask allowed, or
    could not make the next mask, as its limits on one step's work (which keep a mask to milliseconds: an Earley row
    of at most 2,000 items, a lexer's fuel) cut it short. The row ends with this error; the rows beside it go on."""


def limits():
    """llguidance's limits on a format's work, its defaults, with errors that leave out its state and the grammar it
    made (which can be the size of the schema) and hold the reason only."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


@dataclass(frozen=True)
class OutputFormat:
    """`kind`: json (`spec` a JSON schema, as text), json_object (any JSON object), regex, choice (`spec` a JSON
    list of the strings), grammar (Lark, or llama.cpp's GBNF), structural_tag (`structural_tag_grammar`).
    `any_whitespace`: JSON may hold any whitespace between its tokens (vLLM's default); off, it is written
    compactly. `whitespace`: a regular expression for the whitespace JSON may hold between its tokens instead
    (vLLM's `whitespace_pattern`; a bound such as `[ \n]{0,4}` keeps a small model from spacing out its answer
    until the length cuts it)."""

    kind: str
    spec: str = ""
    any_whitespace: bool = True
    whitespace: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise R2RError(f"a structured output is one of {', '.join(KINDS)}, not {self.kind!r}")
        if self.whitespace is not None and self.kind not in ("json", "json_object"):
            raise R2RError(f"a whitespace pattern is for JSON, not for a {self.kind} structured output")
        if not isinstance(self.spec, str):  # a schema or a list of choices given as such (a schema's properties
            object.__setattr__(self, "spec", json.dumps(self.spec))  # come in its order: keys are not sorted)

    @classmethod
    def json_schema(cls, schema: dict | str, any_whitespace: bool = True,
                    whitespace: str | None = None) -> OutputFormat:
        return cls("json", schema, any_whitespace, whitespace)

    def grammar(self) -> str:
        """The format as llguidance's grammar, or an error that says what is wrong with it (made once per format:
        a request's choices, and its check before it is queued, share it)."""
        if "_grammar" not in self.__dict__:  # (a frozen dataclass: its cache goes in past __setattr__)
            self.__dict__["_grammar"] = self._make_grammar()
        return self.__dict__["_grammar"]

    def _make_grammar(self) -> str:
        import llguidance

        whitespace = ({"whitespace_flexible": self.any_whitespace} if self.whitespace is None
                      else {"whitespace_pattern": self.whitespace})
        try:
            if self.kind == "json_object":
                grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=whitespace)
            elif self.kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(self.spec, defaults=whitespace)
            elif self.kind == "choice":
                choices = json.loads(self.spec)
                if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
                    raise ValueError("the choices must be a non-empty list of strings")
                grammar = llguidance.grammar_from("choice", choices)
            elif self.kind == "structural_tag":
                grammar = structural_tag_grammar(json.loads(self.spec))
            else:
                grammar = llguidance.grammar_from(self.kind, self.spec)
        except (ValueError, TypeError) as e:
            raise R2RError(f"the {self.kind} structured output is not valid: {one_line(str(e))}") from None
        except RecursionError:  # (a JSON schema nested past what its compiler recurses through)
            raise R2RError(f"the {self.kind} structured output is nested too deeply: nest it less") from None
        return grammar

    def validate(self) -> None:
        """Compile the format (without a tokenizer): a request whose format cannot be followed is refused before it
        is queued. Once per format: the server compiles it off its event loop, then makes the request from it."""
        if self.__dict__.get("_valid"):
            return
        try:
            error = __import__("llguidance").LLMatcher.validate_grammar(self.grammar(), None, limits=limits())
        except RecursionError:  # a structural tag nested past what a grammar can be built from
            raise R2RError(f"the {self.kind} structured output is nested too deeply: nest it less") from None
        if error:
            raise R2RError(f"the {self.kind} structured output is not valid: {one_line(error)}")
        self.__dict__["_valid"] = True


def one_line(error: str) -> str:
    """llguidance's error as one line: its source excerpts and carets left out (they point into the grammar it made
    of the format, not into what the client wrote), and so are a panic's backtrace and the state and grammar it may
    dump."""
    error = re.split(r"<(?:backtrace|state|grammar|non-verbose/)>", error, maxsplit=1)[0]
    lines = [line.strip() for line in error.splitlines()]
    kept = [line for line in lines if line and not set(line) <= {"^", " "} and not re.match(r"\d+ \|", line)]
    return " ".join(kept)


def grammar_tokenizer(tokenizer, vocab_size: int, eos_ids):
    """A tokenizer as llguidance reads it (built once per engine: a second or two for a 150k vocabulary): masks
    cover the models' `vocab_size` logits (ids beyond the tokenizer's are never allowed), and a finished format
    allows the end-of-sequence tokens only.

    llguidance reads a tokenizer's added tokens that look like tags (Qwen's `<tool_call>`) as special, and then
    allows one where a format spells its text, yet refuses it when it is taken; so the tokens are handed to it
    again with only the tokenizer's own special tokens marked special, and its encoder to tokenize with."""
    import llguidance
    import llguidance.hf
    import transformers

    if not isinstance(tokenizer, transformers.PreTrainedTokenizerFast):
        raise R2RError(f"structured outputs need a fast (Rust) tokenizer; this one is {type(tokenizer).__name__}")
    eos = sorted(eos_ids)
    read = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)

    class Tokens:
        eos_token_id, bos_token_id = eos[0], None
        tokens = [read.decode_bytes([i]) for i in range(vocab_size)]
        special_token_ids = sorted(i for i, t in tokenizer.added_tokens_decoder.items() if t.special
                                   and i < vocab_size)

        def __call__(self, text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Tokens()), n_vocab=vocab_size, eos_token=eos)


class GrammarWalk:
    """One sequence's walk through its format (`allowed`: the tokens allowed after any prefix of its output)."""

    def __init__(self, output_format: OutputFormat, tokenizer, think_end: int | None = None):
        """`tokenizer`: `grammar_tokenizer`'s. `think_end`: the reply starts inside a reasoning model's thinking,
        which this token closes; the format applies after it."""
        import llguidance

        matcher = llguidance.LLMatcher(tokenizer, output_format.grammar(), log_level=0, limits=limits())
        if matcher.is_error():
            raise R2RError(f"the {output_format.kind} structured output is not valid: {one_line(matcher.get_error())}")
        self._start(output_format, matcher, tokenizer.vocab_size, think_end)

    def copy(self, think_end: int | None = None) -> GrammarWalk:
        """A walk of its own through the same compiled format, from its start: a request's format is compiled once
        and each of its choices walks a copy."""
        if self.tokens:
            raise R2RError("internal: only a walk that has not started is copied")
        walk = GrammarWalk.__new__(GrammarWalk)
        walk._start(self.output_format, self.matcher.deep_copy(), self.vocab_size, think_end)
        return walk

    def _start(self, output_format: OutputFormat, matcher, vocab_size: int, think_end: int | None) -> None:
        self.output_format, self.matcher = output_format, matcher
        self.vocab_size, self.think_end = vocab_size, think_end
        self.tokens: list[int] = []  # the answer's tokens the matcher has walked
        self.consumed: list[bool] = []  # ... whether it took each (a finished format takes no more tokens)
        self.masks: dict[int, torch.Tensor] = {}  # packed mask per answer index, the most recent ones
        self.bits = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8)

    def answer_start(self, output_ids) -> int | None:
        """Where the constrained part of an output begins (None: still thinking)."""
        if self.think_end is None:
            return 0
        try:
            return list(output_ids).index(self.think_end) + 1
        except ValueError:
            return None

    def allowed(self, output_ids) -> torch.Tensor | None:
        """The tokens the format allows after these output tokens, as a boolean mask [V] (None: any token, the reply
        is still thinking)."""
        start = self.answer_start(output_ids)
        if start is None:
            return None
        answer = list(output_ids)[start:]
        index = len(answer)
        if index not in self.masks or self._shared(answer) < index:
            self._walk_to(answer)
            mask = self.matcher.compute_bitmask()
            if self.matcher.is_error():
                self._failed(f"at output token {index}")
            self.masks[index] = torch.frombuffer(bytearray(mask), dtype=torch.uint8)
            for old in sorted(self.masks)[:-KEEP_MASKS]:
                del self.masks[old]
        packed = self.masks[index]
        return ((packed[:, None] & self.bits) != 0).flatten()[: self.vocab_size]

    def _shared(self, answer: list[int]) -> int:
        """How many tokens `answer` and the walk share at their start."""
        n = min(len(answer), len(self.tokens))
        if answer[:n] == self.tokens[:n]:  # the usual case, compared at C speed
            return n
        return next(k for k in range(n) if answer[k] != self.tokens[k])

    def _walk_to(self, answer: list[int]) -> None:
        """Roll the matcher back to what it shares with `answer`, and forward through the rest."""
        shared = self._shared(answer)
        if shared < len(self.tokens):
            taken = sum(self.consumed[shared:])
            if taken and not self.matcher.rollback(taken):
                raise R2RError(f"internal: the structured output's matcher could not go back {taken} tokens: "
                               f"{one_line(self.matcher.get_error())}")
            del self.tokens[shared:], self.consumed[shared:]
            for old in [k for k in self.masks if k > shared]:
                del self.masks[old]
        for token in answer[len(self.tokens):]:
            take = not self.matcher.is_stopped()
            if take and not self.matcher.consume_token(token):
                self._failed(f"at output token {len(self.tokens)} (token id {token})")
            self.tokens.append(token)
            self.consumed.append(take)

    def _failed(self, where: str):
        # (every token the walk is given, its masks allowed: a refusal is llguidance's limits, `FormatTooComplex`)
        raise FormatTooComplex(f"the {self.output_format.kind} structured output could not be followed {where}: "
                               f"{one_line(self.matcher.get_error())}; simplify it")
