"""Structural tags (vLLM's `structural_tag` structured output) as llguidance grammars, in both of the forms vLLM takes:

- the first: `{"triggers": [...], "structures": [{"begin", "schema", "end"}, ...]}`: free text in which a structure,
  once its `begin` is written, holds JSON following its `schema` and then its `end` (`legacy_grammar`);
- xgrammar's `format` form, `{"type": "structural_tag", "format": {...}}`: formats that nest (const_string,
  json_schema, grammar, regex, any_text, sequence, or, tag, triggered_tags, tags_with_separator), as written in
  xgrammar's structural tag tutorial (`FormatGrammar`), into one Lark grammar of llguidance's.

Free text is matched lazily where something must follow it (a tag's any_text up to its end, text up to a trigger), so
formats that take text up to the end of the output (any_text outside a tag, triggered_tags) must come last. A
ValueError says what is wrong with a spec."""

from __future__ import annotations

import json

ANY_TEXT = "ANY_TEXT"  # the terminal every free text uses


def structural_tag_grammar(tag: object) -> str:
    """A structural tag, in either form, as an llguidance grammar."""
    if not isinstance(tag, dict):
        raise ValueError("a structural tag is a JSON object: {triggers, structures}, or {type: structural_tag, "
                         "format}")
    if "format" in tag:
        if set(tag) - {"type", "format"} or tag.get("type", "structural_tag") != "structural_tag":
            raise ValueError("a structural tag's `format` form has type structural_tag and format, nothing else")
        return FormatGrammar().grammar(tag["format"])
    return legacy_grammar(tag)


def legacy_grammar(tag: dict) -> str:
    """`{"triggers": [...], "structures": [{"begin", "schema", "end"}, ...]}`: each `begin` starts with one of the
    triggers, where the text stops being free. Triggers are matched as text, so one the tokenizer holds as an added
    token that is not special (Qwen's `<tool_call>`) works, and a special token (Llama's `<|python_tag|>`) cannot be
    one."""
    import llguidance

    if set(tag) - {"type", "triggers", "structures"}:
        raise ValueError("a structural tag is an object of triggers and structures, or of type and format")
    triggers, structures = check_triggers(tag.get("triggers"), "triggers"), tag.get("structures")
    if not isinstance(structures, list) or not structures:
        raise ValueError("structures must be a non-empty list of {begin, schema, end}")
    tags = []
    for n, structure in enumerate(structures):
        if not isinstance(structure, dict) or set(structure) != {"begin", "schema", "end"} \
                or not isinstance(structure["begin"], str) or not isinstance(structure["end"], str) \
                or not isinstance(structure["schema"], dict):
            raise ValueError(f"structure {n} must have exactly begin (a string), schema (a JSON schema) and end "
                             "(a string)")
        trigger = next((t for t in triggers if structure["begin"].startswith(t)), None)
        if trigger is None:
            raise ValueError(f"structure {n}'s begin {structure['begin']!r} starts with none of the triggers")
        tags.append(llguidance.StructTag(trigger=trigger, begin=structure["begin"], grammar=structure["schema"],
                                         end=structure["end"]))
    return llguidance.StructTag.to_grammar(tags, assume_special=False)


MAX_DEPTH = 32  # formats within formats in one structural tag


class FormatGrammar:
    """xgrammar's `format` objects as one Lark grammar: each format becomes an expression, helper rules gather in
    `rules`. `where` names the format being compiled in errors (`format.elements[1].content`)."""

    def __init__(self):
        self.rules: list[str] = []
        self.depth = 0  # formats within formats where `expression` is now

    def grammar(self, fmt: object) -> str:
        import llguidance

        start = self.expression(fmt, "format", last=True)
        lark = "\n".join(["%llguidance {}", f"start: {start or literal('')}", *self.rules,
                          f"{ANY_TEXT}: /(.|\\n)*/"])
        return llguidance.grammar_from("lark", lark)

    def rule(self, body: str, lazy: bool = False) -> str:
        name = f"st_{len(self.rules)}"
        self.rules.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name

    def expression(self, fmt: object, where: str, last: bool) -> str:
        """`fmt` as a Lark expression; `last`: nothing follows it in the output (free text may run to the end)."""
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        fields = FIELDS.get(kind)
        if fields is None:
            raise ValueError(f"{where} must be a format object with a type among {', '.join(FIELDS)}")
        required, optional = fields
        if not set(required) <= set(fmt) <= {"type", *required, *optional}:
            raise ValueError(f"{where} ({kind}) takes {', '.join(required) or 'nothing'}"
                             + (f", and optionally {', '.join(optional)}" if optional else ""))
        if self.depth >= MAX_DEPTH:  # (compiling recurses once per level: bounded before Python's own limit)
            raise ValueError(f"{where} lies {MAX_DEPTH} formats deep, the most a structural tag nests: nest it less")
        self.depth += 1
        try:
            return getattr(self, f"to_{kind}")(fmt, where, last)
        finally:
            self.depth -= 1

    def to_const_string(self, fmt: dict, where: str, last: bool) -> str:
        return literal(text(fmt["value"], f"{where}.value"))

    def to_json_schema(self, fmt: dict, where: str, last: bool) -> str:
        if not isinstance(fmt["json_schema"], dict | bool):
            raise ValueError(f"{where}.json_schema must be a JSON schema")
        return f"%json {json.dumps(fmt['json_schema'])}"

    def to_grammar(self, fmt: dict, where: str, last: bool) -> str:
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(text(fmt["grammar"], f"{where}.grammar"))
        except Exception as e:  # noqa: BLE001 - the converter raises its own kinds; the client's grammar is at fault
            raise ValueError(f"{where}.grammar is neither Lark nor GBNF: {e}") from None
        return f"%lark {{\n{lark}\n}}"

    def to_regex(self, fmt: dict, where: str, last: bool) -> str:
        from llguidance import regex_to_lark

        return f"/{regex_to_lark(text(fmt['pattern'], f'{where}.pattern'))}/"

    def to_any_text(self, fmt: dict, where: str, last: bool) -> str:
        no_excluded_str(fmt, where)
        if not last:
            raise ValueError(f"{where}: any_text takes the text to the end of the output; put it last, or in a tag "
                             "(which ends it at the tag's end)")
        return ANY_TEXT

    def to_sequence(self, fmt: dict, where: str, last: bool) -> str:
        elements = items(fmt["elements"], f"{where}.elements")
        parts = [self.expression(e, f"{where}.elements[{i}]", last and i == len(elements) - 1)
                 for i, e in enumerate(elements)]
        return "(" + " ".join(p for p in parts if p) + ")" if any(parts) else ""

    def to_or(self, fmt: dict, where: str, last: bool) -> str:
        elements = items(fmt["elements"], f"{where}.elements")
        return "(" + " | ".join(self.expression(e, f"{where}.elements[{i}]", last) or literal("")
                                for i, e in enumerate(elements)) + ")"

    def to_tag(self, fmt: dict, where: str, last: bool) -> str:
        begin, end = text(fmt["begin"], f"{where}.begin"), text(fmt["end"], f"{where}.end")
        content = fmt["content"]
        if isinstance(content, dict) and content.get("type") == "any_text" and end:
            no_excluded_str(content, f"{where}.content")
            body = self.rule(f"{ANY_TEXT} {literal(end)}", lazy=True)  # the text ends at the tag's first end
            return f"{literal(begin)} {body}" if begin else body
        inner = self.expression(content, f"{where}.content", last and not end)
        return " ".join(p for p in (literal(begin) if begin else "", inner, literal(end) if end else "") if p)

    def to_triggered_tags(self, fmt: dict, where: str, last: bool) -> str:
        triggers = check_triggers(fmt["triggers"], f"{where}.triggers")
        tags = self.tag_list(fmt["tags"], f"{where}.tags")
        at_least_one, stop_after_first = flags(fmt, where)
        if not last and not (at_least_one and stop_after_first):
            raise ValueError(f"{where}: triggered_tags take free text to the end of the output; put them last")
        # Free text up to a trigger (lazily), then the rest of the begin of one of the tags it starts.
        by_trigger: dict[str, list[str]] = {t: [] for t in triggers}
        for i, (begin, body) in enumerate(tags):
            matched = [t for t in triggers if begin.startswith(t)]
            if len(matched) != 1:
                raise ValueError(f"{where}.tags[{i}]'s begin {begin!r} must start with exactly one of the triggers "
                                 f"(it starts with {len(matched)})")
            rest = begin[len(matched[0]):]
            by_trigger[matched[0]].append(f"{literal(rest)} {body}" if rest else body)
        after_text = [f"{self.rule(f'{ANY_TEXT} {literal(t)}', lazy=True)} ({' | '.join(alts)})"
                      for t, alts in by_trigger.items() if alts]
        any_tag = "(" + " | ".join(f"{literal(begin)} {body}" for begin, body in tags) + ")"
        via_text = self.rule(" | ".join(after_text))
        if at_least_one and stop_after_first:
            return any_tag
        if stop_after_first:
            return f"({via_text} | {ANY_TEXT})"
        return f"{any_tag if at_least_one else ''} {via_text}* {ANY_TEXT}".strip()

    def to_tags_with_separator(self, fmt: dict, where: str, last: bool) -> str:
        tags = self.tag_list(fmt["tags"], f"{where}.tags")
        separator = text(fmt["separator"], f"{where}.separator")
        at_least_one, stop_after_first = flags(fmt, where)
        one = self.rule(" | ".join(f"{literal(begin)} {body}" if begin else body for begin, body in tags))
        many = one if stop_after_first else f"{one} ({literal(separator) if separator else ''} {one})*"
        return f"({many})" if at_least_one else f"({many})?"

    def tag_list(self, tags: object, where: str) -> list[tuple[str, str]]:
        """A list of tags (`type` tag, or no type): each as its begin and the rest of it (content, end)."""
        listed = items(tags, where)
        out = []
        for i, tag in enumerate(listed):
            if not isinstance(tag, dict) or tag.get("type", "tag") != "tag":
                raise ValueError(f"{where}[{i}] must be a tag: begin, content, end")
            whole = self.to_tag({**tag, "type": "tag", "begin": ""}, f"{where}[{i}]", last=False)
            out.append((text(tag.get("begin"), f"{where}[{i}].begin"), whole))
        return out


# Each format's fields: (required, optional); `FormatGrammar.to_<type>` compiles it.
FIELDS = {"const_string": (("value",), ()), "json_schema": (("json_schema",), ()), "grammar": (("grammar",), ()),
          "regex": (("pattern",), ()), "any_text": ((), ("excluded_str",)), "sequence": (("elements",), ()),
          "or": (("elements",), ()), "tag": (("begin", "content", "end"), ()),
          "triggered_tags": (("triggers", "tags"), ("at_least_one", "stop_after_first")),
          "tags_with_separator": (("tags", "separator"), ("at_least_one", "stop_after_first"))}


def literal(value: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(value, ensure_ascii=False)


def text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{where} must be a string")
    return value


def items(value: object, where: str) -> list:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where} must be a non-empty list")
    return value


def check_triggers(triggers: object, where: str) -> list[str]:
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ValueError(f"{where} must be a non-empty list of non-empty strings")
    return triggers


def no_excluded_str(any_text: dict, where: str) -> None:
    if any_text.get("excluded_str"):
        raise ValueError(f"{where}: any_text's excluded_str is not supported")


def flags(fmt: dict, where: str) -> tuple[bool, bool]:
    values = fmt.get("at_least_one", False), fmt.get("stop_after_first", False)
    if not all(isinstance(v, bool) for v in values):
        raise ValueError(f"{where}: at_least_one and stop_after_first are true or false")
    return values
