"""Reasoning models' thinking apart from the answer: the parsers on text, `auto` on chat templates that open the
R1-Distill and Qwen3 ways, a tiny model that really writes `</think>`, through the server (the openai client, whole
and streamed) and `r2r generate`."""

import random

import openai
import pytest
import torch
from tiny import tiny_model, tiny_tokenizer

from roads_to_rome.backends.torch_backend import TorchBackend
from roads_to_rome.core.engine import Engine
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.errors import R2RError
from roads_to_rome.reasoning import ReasoningParser, resolve_parser, thinking_tokens
from roads_to_rome.routing.policies import RandomPolicy
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.limits import Limits
from roads_to_rome.serving.server import create_app

# The openings of the two families' templates (their full templates do more; these are what the parsers read):
# R1-Distill's generation prompt opens the thinking; Qwen3's leaves it to the model (and closes an empty one when
# thinking is turned off).
R1_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}{% else %}"
               "<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
               "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}")
QWEN3_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m.get('reasoning_content') %}<think>\n"
                  "{{ m['reasoning_content'] }}\n</think>\n\n{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
                  "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")

# R1-Distill's first template (the one in the GGUF files of the package index): it opens no tag; it names
# `</think>` to drop earlier turns' thinking.
R1_FIRST_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}<｜User｜>{{ m['content'] }}{% else %}"
                     "{% set content = m['content'].split('</think>')[-1] %}<｜Assistant｜>{{ content }}"
                     "<｜end▁of▁sentence｜>{% endif %}{% endfor %}"
                     "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")

R1, QWEN3 = ReasoningParser("deepseek_r1"), ReasoningParser("qwen3")


def think_tokenizer(template: str):
    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])  # as in R1-Distill and Qwen3: added, not special
    tokenizer.chat_template = template
    return tokenizer


@pytest.mark.parametrize("parser, prompt, text, reasoning, content", [
    (R1, "<｜Assistant｜><think>\n", "Add them.\n</think>\n\n72", "Add them.\n", "72"),
    (R1, "<｜Assistant｜><think>\n", "Add them and", "Add them and", ""),  # cut off inside: no answer
    (R1, "<｜Assistant｜>", "<think>Add.</think>72", "Add.", "72"),  # an older template: the model opens it
    (R1, "<｜Assistant｜>", "Add.</think>72", "Add.", "72"),  # ... or leaves the opening tag out
    (QWEN3, "<|im_start|>assistant\n", "<think>\nAdd.\n</think>\n\n72", "\nAdd.\n", "72"),
    (QWEN3, "<|im_start|>assistant\n", "72, since 48 + 24", None, "72, since 48 + 24"),  # no thinking
    (QWEN3, "<|im_start|>assistant\n<think>\n\n</think>\n\n", "<think>x</think>72", None, "<think>x</think>72"),
    (QWEN3, "<|im_start|>assistant\n<think>\n", "Add.</think>72", "Add.", "72"),  # a template that opens it
])
def test_split(parser, prompt, text, reasoning, content):
    split = parser.split(text, parser.start(prompt))
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize("parser, prompt, text", [
    (R1, "<think>\n", "Half of 48 is 24.\n</think>\n\nThe answer is 72."),
    (R1, "", "<think>Half of 48 is 24.</think>The answer is 72."),
    (QWEN3, "", "<think>\nHalf of 48 is 24.\n</think>\n\nThe answer is 72."),
    (QWEN3, "", "  The answer is 72. <think> is a tag"),
    (R1, "<think>\n", "Half of 48 is 24 < 25 </thin and still thinking"),
])
def test_a_stream_never_takes_back_what_it_sent(parser, prompt, text):
    """Cut anywhere, the splits of the text so far only ever grow, and end at the whole text's split."""
    start, rng = parser.start(prompt), random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), 8)) + [len(text)]
        sent_reasoning, sent_content = "", ""
        for cut in cuts:
            split = parser.split(text[:cut], start, final=cut == len(text))
            reasoning = split.reasoning or ""
            assert reasoning.startswith(sent_reasoning) and split.content.startswith(sent_content)
            sent_reasoning, sent_content = reasoning, split.content
        whole = parser.split(text, start)
        assert (sent_reasoning, sent_content) == (whole.reasoning or "", whole.content)


def test_thinking_tokens_count_the_closing_tag_even_split_across_tokens():
    pieces = ["Half", " of 48", "</", "think", ">", "\n\n", "72"]
    assert thinking_tokens(R1, "thinking", pieces) == 5
    assert thinking_tokens(R1, "thinking", pieces[:4]) == 4  # cut off inside the thinking
    assert thinking_tokens(QWEN3, "maybe", pieces) == 0  # no opening tag: all answer
    assert thinking_tokens(QWEN3, "maybe", ["<think>", "x", "</think>", "y"]) == 3


def test_auto_reads_the_chat_template():
    assert resolve_parser("auto", think_tokenizer(R1_TEMPLATE)) == "deepseek_r1"
    assert resolve_parser("auto", think_tokenizer(R1_FIRST_TEMPLATE)) == "deepseek_r1"
    assert resolve_parser("auto", think_tokenizer(QWEN3_TEMPLATE)) == "qwen3"
    assert resolve_parser("auto", tiny_tokenizer()) is None  # no <think> in its template
    assert resolve_parser("qwen3", tiny_tokenizer()) == "qwen3"
    assert resolve_parser("none", think_tokenizer(R1_TEMPLATE)) is None
    with pytest.raises(R2RError, match="deepseek_r1, qwen3, none"):
        resolve_parser("r1", tiny_tokenizer())


@pytest.fixture(scope="module")
def thinker():
    """A tiny model on an R1-style template that writes `</think>` a few tokens into its reply: its output head's
    row for the tag is the row of the token it would write fifth, scaled up, so the tag wins there (or earlier)."""
    tokenizer = think_tokenizer(R1_TEMPLATE)
    model = tiny_model(tokenizer, hidden=32, seed=0)
    engine = Engine(TorchBackend(model), None, tokenizer)
    prompt = engine.prompts.chat("What is 48 / 2?")
    first = engine.generate([prompt], SamplingParams(max_new_tokens=8))[0].token_ids
    close = tokenizer.convert_tokens_to_ids("</think>")
    with torch.no_grad():
        model.lm_head.weight[close] = model.lm_head.weight[first[4]] * 1.5
    reply = engine.generate([prompt], SamplingParams(max_new_tokens=24))[0].token_ids
    assert close in reply[1:8] and reply.index(close) < len(reply) - 3, reply
    return tokenizer, model


def test_the_server_hands_thinking_and_answer_apart(thinker):
    tokenizer, model = thinker
    slm = TorchBackend(model, name="thinker")
    engine = Engine(slm, TorchBackend(tiny_model(tokenizer, hidden=64, seed=1), name="llm"), tokenizer,
                    RandomPolicy(0.0, seed=0))  # routes nothing: the thinker's own tokens
    app = create_app(engine, "thinker", Limits(max_batch=2, max_tokens=64, context_length=256))
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "What is 48 / 2?"}]
        whole = client.chat.completions.create(model="thinker", messages=messages, max_tokens=24, temperature=0)
        chunks = list(client.chat.completions.create(model="thinker", messages=messages, max_tokens=24,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
        cut = client.chat.completions.create(model="thinker", messages=messages, max_tokens=2, temperature=0)
        two = client.chat.completions.create(model="thinker", messages=messages, max_tokens=24, temperature=0, n=2)
        raw = client.completions.create(model="thinker", prompt="What is", max_tokens=8, temperature=0)
        hidden = client.chat.completions.create(model="thinker", messages=messages, max_tokens=24, temperature=0,
                                                extra_body={"include_reasoning": False})
        hidden_chunks = list(client.chat.completions.create(model="thinker", messages=messages, max_tokens=24,
                                                            temperature=0, stream=True,
                                                            extra_body={"include_reasoning": False}))
    message = whole.choices[0].message
    reasoning = message.model_extra["reasoning"]
    assert reasoning and message.model_extra["reasoning_content"] == reasoning
    assert message.content and "</think>" not in reasoning
    text = tokenizer.decode(whole.model_extra["r2r"]["token_ids"])
    assert text.startswith(reasoning) and text.endswith(message.content)
    thinking = whole.usage.completion_tokens_details.reasoning_tokens
    assert 1 <= thinking < whole.usage.completion_tokens
    assert whole.usage.model_extra["llm_rate_thinking"] == 0 and whole.usage.model_extra["llm_rate_answer"] == 0
    assert [c.message.model_extra["reasoning"] for c in two.choices] == [reasoning, reasoning]
    assert two.usage.completion_tokens_details.reasoning_tokens == 2 * thinking

    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning") or "" for d in deltas) == reasoning
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == message.content
    # Provenance covers every token, the thinking's too.
    provenance = [c.model_extra["r2r"]["token_id"] for c in chunks if c.model_extra.get("r2r")]
    assert provenance == whole.model_extra["r2r"]["token_ids"]
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == thinking

    assert cut.choices[0].message.content == "" and cut.choices[0].message.model_extra["reasoning"]
    assert "reasoning" not in raw.choices[0].model_extra  # plain completions are not chat: no parser
    # vLLM's include_reasoning: false leaves the thinking out, whole and streamed; the answer and the counts stay
    assert hidden.choices[0].message.content == message.content
    assert not {"reasoning", "reasoning_content"} & set(hidden.choices[0].message.model_extra)
    assert hidden.usage.completion_tokens_details.reasoning_tokens == thinking
    deltas = [c.choices[0].delta for c in hidden_chunks if c.choices]
    assert not any(d.model_extra.get("reasoning") or d.model_extra.get("reasoning_content") for d in deltas)
    assert "".join(d.content or "" for d in deltas) == message.content


def test_chat_template_kwargs_reach_the_template_and_the_parser_reads_what_they_did():
    """Qwen3's `enable_thinking: false` closes an empty thinking in the prompt: the reply is all answer. Keys the
    server sets itself, and a template's own refusal, are 400s."""
    tokenizer = think_tokenizer(QWEN3_TEMPLATE + "{% if shout is defined %}{{ raise_exception('no shouting') }}"
                                                 "{% endif %}")
    engine = Engine(TorchBackend(tiny_model(tokenizer, hidden=32, seed=0)), None, tokenizer)
    app = create_app(engine, "qwen3ish", Limits(max_batch=2, max_tokens=16, context_length=256))
    messages = [{"role": "user", "content": "What is 48 / 2?"}]
    with BackgroundServer(app) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def ask(**kwargs):
            return client.chat.completions.create(model="qwen3ish", messages=messages, max_tokens=8, temperature=0,
                                                  extra_body=kwargs)

        plain, off = ask(), ask(chat_template_kwargs={"enable_thinking": False})
        assert off.usage.prompt_tokens == plain.usage.prompt_tokens + len(tokenizer.encode("<think>\n\n</think>\n\n"))
        assert off.choices[0].message.model_extra.get("reasoning") is None
        assert off.choices[0].message.content == tokenizer.decode(off.model_extra["r2r"]["token_ids"])
        for bad, says in (({"tokenize": False}, "may not set tokenize"), ({"self": 1}, "may not set self"),
                           ({"shout": 1}, "no shouting")):
            with pytest.raises(openai.BadRequestError, match=says) as refused:
                ask(chat_template_kwargs=bad)
            assert refused.value.status_code == 400


def test_generate_prints_thinking_apart(thinker, tmp_path, run_cli):
    tokenizer, model = thinker
    model.save_pretrained(tmp_path / "thinker")
    tokenizer.save_pretrained(tmp_path / "thinker")
    code, out, err = run_cli("generate", "What is 48 / 2?", "--slm", tmp_path / "thinker", "--router", "slm",
                             "--backend", "torch", "--max-new-tokens", "24", "--json")
    assert code == 0, err
    import json

    reply = json.loads(out)
    assert reply["reasoning"] and reply["content"] and reply["reasoning_tokens"] >= 1
    assert reply["llm_rate_thinking"] == 0.0
    code, out, _ = run_cli("generate", "What is 48 / 2?", "--slm", tmp_path / "thinker", "--router", "slm",
                           "--backend", "torch", "--max-new-tokens", "24", "--reasoning-parser", "none", "--json")
    assert code == 0 and "reasoning" not in json.loads(out)
    code, _, err = run_cli("generate", "hi", "--reasoning-parser", "r1")
    assert code == 2 and "--reasoning-parser takes" in err
