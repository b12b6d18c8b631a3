"""Structured outputs (core/grammar.py): the walk's masks after any roll-back are a fresh walk's, every kind of
format holds for R2R's output under greedy decoding and sampling, and what cannot be followed is refused."""

import json
import re

import pytest
import torch

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.grammar import GrammarWalk, OutputFormat, grammar_tokenizer
from roads_to_rome.core.request import Request
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.errors import R2RError
from roads_to_rome.routing.policies import RandomPolicy

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
FORMATS = {
    "json": (OutputFormat.json_schema(SCHEMA, any_whitespace=False),
             lambda text: set(json.loads(text)) == {"ok", "n"} and isinstance(json.loads(text)["ok"], bool)
             and 0 <= json.loads(text)["n"] <= 99),
    "json_object": (OutputFormat("json_object", any_whitespace=False), lambda text: isinstance(json.loads(text), dict)),
    "regex": (OutputFormat("regex", r"[a-c]{2,4}x"), lambda text: re.fullmatch(r"[a-c]{2,4}x", text)),
    "choice": (OutputFormat("choice", ["yes", "no", "maybe so"]), lambda text: text in ("yes", "no", "maybe so")),
    # (bounded: a random model repeats a token as long as it may)
    "grammar": (OutputFormat("grammar", 'start: "a" ("b" | "c") ("b" | "c")? "d"'),
                lambda text: re.fullmatch("a[bc]{1,2}d", text)),
    "gbnf": (OutputFormat("grammar", 'root ::= "(" [0-9] [0-9]? ")"'), lambda text: re.fullmatch(r"\(\d{1,2}\)", text)),
}


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer, llm):
    return grammar_tokenizer(tokenizer, llm.vocab_size, {tokenizer.eos_token_id})


def test_masks_after_any_roll_back_are_a_fresh_walks(tokenizer, ll_tokenizer):
    """Verification rewrites the output behind the walk: asked about any prefix, in any order, the walk's mask is
    that of a walk made for that prefix alone (stopped formats included: they allow the end only)."""
    fmt = OutputFormat.json_schema(SCHEMA, any_whitespace=False)
    text = '{"ok":true,"n":42}'  # the schema's order
    ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
    other = tokenizer.encode('{"ok":false,"n":7}')
    walk = GrammarWalk(fmt, ll_tokenizer)
    order = [len(ids), 3, len(ids) - 1, 0, 5, len(ids), 2]
    for k in order:
        fresh = GrammarWalk(fmt, ll_tokenizer).allowed(ids[:k])
        assert torch.equal(walk.allowed(ids[:k]), fresh), k
    for k in range(len(other) + 1):  # another output from a shared prefix on
        assert torch.equal(walk.allowed(other[:k]), GrammarWalk(fmt, ll_tokenizer).allowed(other[:k])), k
    end = walk.allowed(ids[:-1])  # the object is closed: only the end may follow
    assert end.nonzero().flatten().tolist() == [tokenizer.eos_token_id]
    assert walk.allowed([])[tokenizer.encode("{")[0]] and not walk.allowed([])[tokenizer.encode("x")[0]]


def test_the_thinking_before_its_closing_token_is_free(tokenizer, ll_tokenizer):
    close = tokenizer.encode("Paris")[0]
    walk = GrammarWalk(OutputFormat("regex", "[a-c]+"), ll_tokenizer, think_end=close)
    assert walk.allowed([]) is None and walk.allowed(tokenizer.encode("x y")) is None
    after = walk.allowed([*tokenizer.encode("x y"), close])
    assert after[tokenizer.encode("a")[0]] and not after[tokenizer.encode("x")[0]]


@pytest.mark.parametrize("kind", list(FORMATS))
def test_every_kind_of_format_holds_for_r2rs_output_greedy_and_sampled(slm, llm, tokenizer, kind):
    fmt, holds = FORMATS[kind]
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0), verify="1")
    prompts = [engine.prompts.chat(p) for p in ("What is 48 / 2?", "def add(a, b):")]
    sources, examined = [], 0
    sampled = [SamplingParams(max_new_tokens=40, output_format=fmt, temperature=1.0, top_p=0.95, seed=s)
               for s in range(3)]
    for params in [SamplingParams(max_new_tokens=40, output_format=fmt), *sampled]:
        for gen in engine.generate(prompts, params):
            sources += gen.sources
            if kind == "json_object" and gen.finish_reason == "length":  # a free string a random model never ends
                assert gen.text.startswith('{"'), gen.text
                examined += 1  # (its opening, the most a cut object shows)
                continue
            assert gen.finish_reason == "stop" and holds(gen.text), (kind, gen.text)
            examined += 1
    assert examined, f"every {kind} output ended on its length: none was held to its format"
    assert "slm" in sources and ("llm" in sources or "fix" in sources)  # both models wrote them


@pytest.mark.parametrize("form", ["structures", "format"])
def test_a_structural_tag_holds_its_structures_in_free_text(slm, llm, tokenizer, form):
    """vLLM's structural tag, in either form: the text is free until a trigger; a structure begun there holds JSON
    following its schema, then its end. The trigger here is a letter the random pair writes often, so structures do
    come."""
    number = {"type": "integer", "minimum": 0, "maximum": 99}
    fmt = OutputFormat("structural_tag", {"triggers": ["a"], "structures": [
        {"begin": "a=", "schema": number, "end": ";"}]} if form == "structures" else {
        "type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["a"], "tags": [
            {"begin": "a=", "content": {"type": "json_schema", "json_schema": number}, "end": ";"}]}})
    space = "[ \t\n]*"
    whole = f"a={space}\\d{{1,2}}{space};"
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0), verify="1")
    prompts = [engine.prompts.chat(p) for p in ("What is 48 / 2?", "def add(a, b):")]
    structures = 0
    for seed in (None, 0, 1, 2, 3):
        sampled = {} if seed is None else {"temperature": 1.0, "seed": seed}
        for gen in engine.generate(prompts, SamplingParams(max_new_tokens=40, output_format=fmt, ignore_eos=True,
                                                           **sampled)):
            # every "a" begins a whole structure, but for one the length may cut at the end
            assert re.fullmatch(f"(?:[^a]|{whole})*(?:a(?:={space}\\d{{0,2}}{space})?)?", gen.text), gen.text
            structures += len(re.findall(whole, gen.text))
    assert structures >= 2


NUMBER = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
CALL = {"type": "triggered_tags", "triggers": ["<function="], "tags": [
    {"begin": f"<function={name}>", "content": {"type": "json_schema", "json_schema": NUMBER}, "end": "</function>"}
    for name in ("f1", "f2")]}
THINK_THEN_ANSWER = {"type": "sequence", "elements": [
    {"type": "tag", "begin": "<think>", "content": {"type": "any_text"}, "end": "</think>"},
    {"type": "const_string", "value": "A:"},
    {"type": "or", "elements": [{"type": "regex", "pattern": "[0-9]+"}, {"type": "const_string", "value": "none"}]}]}
LIST = {"type": "tags_with_separator", "separator": ",", "tags": [
    {"begin": "[", "content": {"type": "grammar", "grammar": "root ::= [a-c]+"}, "end": "]"}]}


@pytest.mark.parametrize("fmt, text, holds", [
    (CALL, "hello", True),
    (CALL, 'hi <function=f1>{"n": 1}</function> bye <function=f2>{"n":2}</function>', True),
    (CALL, 'x <function=f3>{"n":1}</function>', False),  # the trigger starts no tag of these
    (CALL, 'x <function=f1>{"m":1}</function>', False),  # the content breaks its schema
    ({**CALL, "at_least_one": True}, 'hello', False),
    ({**CALL, "at_least_one": True}, '<function=f1>{"n": 1}</function> bye', True),
    ({**CALL, "at_least_one": True}, 'x<function=f1>{"n": 1}</function>', False),  # the first tag comes first
    ({**CALL, "stop_after_first": True}, "hello", True),
    ({**CALL, "stop_after_first": True}, 'a <function=f1>{"n": 1}</function>', True),
    ({**CALL, "stop_after_first": True}, 'a <function=f1>{"n": 1}</function> more', False),
    (THINK_THEN_ANSWER, "<think>so x is</think>A:42", True),
    (THINK_THEN_ANSWER, "<think>a</think>A:none", True),
    (THINK_THEN_ANSWER, "<think>a</think>A:x", False),
    (THINK_THEN_ANSWER, "A:1", False),
    (THINK_THEN_ANSWER, "<think>a</think></think>A:1", False),  # the thinking ends at its first end
    (LIST, "", True),
    (LIST, "[ab],[c]", True),
    (LIST, "[ab][c]", False),
    ({**LIST, "at_least_one": True}, "", False),
    ({**LIST, "stop_after_first": True}, "[ab],[c]", False),
])
def test_a_structural_tags_format_form_holds_what_xgrammars_tutorial_says(tokenizer, ll_tokenizer, fmt, text, holds):
    """xgrammar's `format` objects (as its structural tag tutorial describes them), nested: a text the format allows
    walks to its end; one it does not is refused at some token or does not end there."""
    import llguidance

    matcher = llguidance.LLMatcher(ll_tokenizer, OutputFormat("structural_tag", {"type": "structural_tag",
                                                                                  "format": fmt}).grammar())
    assert not matcher.is_error(), matcher.get_error()
    walked = all(matcher.consume_token(t) for t in tokenizer.encode(text))
    assert (walked and matcher.is_accepting()) == holds


def test_min_tokens_does_not_outlast_a_finished_format(slm, tokenizer):
    """A format that allows nothing but its end ends the output even before min_tokens (else no token is left)."""
    engine = Engine.alone(slm, tokenizer, "slm")
    gen = engine.generate([engine.prompts.chat("Hi")], SamplingParams(
        max_new_tokens=20, min_tokens=10, output_format=OutputFormat("choice", ["yes", "no"])))[0]
    assert gen.text in ("yes", "no") and gen.finish_reason == "stop"


def test_a_reasoning_reply_thinks_freely_then_follows_the_format(slm, tokenizer):
    """`thinking_until`: before the closing token any token may come (here a bias makes it come first), after it
    the format holds; without it the format holds from the first token."""
    engine = Engine.alone(slm, tokenizer, "slm")
    close = tokenizer.encode("Paris")[0]
    params = SamplingParams(max_new_tokens=20, logit_bias={close: 100.0},
                            output_format=OutputFormat("regex", "[a-c]{1,3}x"))
    prompt = engine.prompts.chat("Hi")
    thinking = engine.run([Request(prompt, params, thinking_until=close)])[0]
    answer = tokenizer.decode(thinking.token_ids[1:], skip_special_tokens=True)
    assert thinking.token_ids[0] == close and re.fullmatch("[a-c]{1,3}x", answer)
    plain = engine.run([Request(prompt, params)])[0]
    assert close not in plain.token_ids and re.fullmatch("[a-c]{1,3}x", plain.text)


@pytest.mark.parametrize("fmt, message", [
    (lambda: OutputFormat("regex", "[a-"), "regex structured output is not valid"),
    (lambda: OutputFormat("json", '{"type": "foo"}'), "json structured output is not valid"),
    (lambda: OutputFormat("json", "{not json"), "json structured output is not valid"),
    (lambda: OutputFormat("choice", "[]"), "non-empty list"),
    (lambda: OutputFormat("grammar", "start: undefined_rule"), "grammar structured output is not valid"),
    (lambda: OutputFormat("xml", "<a/>"), "one of json, json_object"),
    (lambda: OutputFormat("structural_tag", {"triggers": [], "structures": []}), "triggers must be a non-empty"),
    (lambda: OutputFormat("structural_tag", {"triggers": ["<f"], "structures": [{"begin": "<g>", "schema": {},
                                                                                "end": ""}]}), "none of the trig"),
    (lambda: OutputFormat("structural_tag", {"triggers": ["<f"], "structures": [{"begin": "<f>", "end": ""}]}),
     "structure 0 must have exactly begin"),
    (lambda: OutputFormat("structural_tag", {"type": "structural_tag", "format": {}}), "format must be a format"),
    (lambda: OutputFormat("structural_tag", {"format": {"type": "qwen_xml_parameter", "json_schema": {}}}),
     "format must be a format object with a type among const_string"),
    (lambda: OutputFormat("structural_tag", {"format": {"type": "sequence", "elements": [
        {"type": "any_text"}, {"type": "const_string", "value": "x"}]}}), r"elements\[0\]: any_text takes the text"),
    (lambda: OutputFormat("structural_tag", {"format": {"type": "tag", "begin": "<a>", "content": {
        "type": "any_text", "excluded_str": ["b"]}, "end": "</a>"}}), "excluded_str is not supported"),
    (lambda: OutputFormat("structural_tag", {"format": {"type": "sequence", "elements": [
        {"type": "triggered_tags", "triggers": ["<"], "tags": [{"begin": "<a>", "content": {
            "type": "const_string", "value": "x"}, "end": ">"}]}, {"type": "const_string", "value": "."}]}}),
     "put them last"),
    (lambda: OutputFormat("structural_tag", {"format": {"type": "triggered_tags", "triggers": ["<", "<a"], "tags": [
        {"begin": "<a>", "content": {"type": "const_string", "value": "x"}, "end": ">"}]}}),
     "exactly one of the triggers"),
    (lambda: OutputFormat("structural_tag", {"format": {"type": "tag", "begin": "<a>", "end": ">"}}),
     r"format \(tag\) takes begin, content, end"),
    (lambda: OutputFormat("structural_tag", {"format": {"type": "regex", "pattern": "[a-"}}),
     "structural_tag structured output is not valid"),
    (lambda: OutputFormat("structural_tag", {"triggers": ["<f"], "structures": [
        {"begin": "<f>", "schema": {"type": "foo"}, "end": "</f>"}]}), "structural_tag structured output is not"),
])
def test_a_format_that_cannot_be_followed_is_refused_naming_what_is_wrong(fmt, message):
    with pytest.raises(R2RError, match=message):
        SamplingParams(output_format=fmt()).validate()


def test_allowed_tokens_and_a_format_together_are_refused():
    with pytest.raises(R2RError, match="give one of them"):
        SamplingParams(allowed_token_ids=(1, 2), output_format=OutputFormat("json_object")).validate()


def test_a_format_llguidance_panics_on_is_refused_in_one_line_without_its_backtrace(ll_tokenizer):
    with pytest.raises(R2RError) as refused:
        GrammarWalk(OutputFormat("choice", ["a"] * 100_000), ll_tokenizer)  # past its 65,525 symbols a grammar
    said = str(refused.value)
    assert said.startswith("the choice structured output is not valid: panic: ") and "\n" not in said
    assert "backtrace" not in said and len(said) < 300, said
