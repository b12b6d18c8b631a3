"""Every request on its own (issue "Every request on its own"): a row whose own settings fail it ends alone, with an
error that names them, while the rows beside it go on token for token as they would have without it; what the door
can see is a 400."""

import json
import threading

import httpx
import pytest
import torch
from conftest import assert_idle_soon
from helpers import encode

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.grammar import OutputFormat
from roads_to_rome.core.request import Failure, Request
from roads_to_rome.core.sampling import LogitRules, NothingToWrite, SamplingParams, adjust_logits
from roads_to_rome.core.scheduler import Scheduler
from roads_to_rome.errors import R2RError
from roads_to_rome.routing.policies import RandomPolicy
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.schemas import Limits
from roads_to_rome.serving.server import create_app

CHAT = "/v1/chat/completions"


def only_token(tokenizer, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == 1, f"{text!r} is {ids} in the tiny tokenizer"
    return ids[0]


def test_settings_that_leave_nothing_say_which_they_are(tokenizer):
    eos = tokenizer.eos_token_id
    params = SamplingParams(max_new_tokens=4, allowed_token_ids=(eos,), min_tokens=2)
    rules = LogitRules.of(params, [1, 2], [eos])
    with pytest.raises(NothingToWrite, match="allowed_token_ids.*min_tokens=2"):
        adjust_logits(torch.zeros(len(tokenizer)), rules, [])
    assert adjust_logits(torch.zeros(len(tokenizer)), rules, [5, 6])[eos] == 0  # long enough: the end is allowed
    banned = SamplingParams(max_new_tokens=4, allowed_token_ids=(7, 8), bad_words=((3, 7), (8,)))
    rules = LogitRules.of(banned, [1], [eos])
    assert adjust_logits(torch.zeros(len(tokenizer)), rules, [1, 2])[7] == 0  # (3, 7) bans 7 only after a 3
    with pytest.raises(NothingToWrite, match="allowed_token_ids allows 2.*bad_words bans 2"):
        adjust_logits(torch.zeros(len(tokenizer)), rules, [1, 3])


def test_contradictions_visible_at_the_door_are_refused_there(slm, llm, tokenizer):
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0))
    eos, prompt = tokenizer.eos_token_id, encode(engine)[0]
    cases = [(SamplingParams(allowed_token_ids=(eos,), min_tokens=2), "only tokens that end the output"),
             (SamplingParams(allowed_token_ids=(7, 8), bad_words=((7,), (8,))), "bans every token allowed"),
             (SamplingParams(bad_words=tuple((t,) for t in range(len(tokenizer)))), "every token of the vocabulary")]
    for params, said in cases:
        with pytest.raises(R2RError, match=said):
            engine.sequence(Request(prompt, params))
    engine.sequence(Request(prompt, SamplingParams(allowed_token_ids=(eos, 7), min_tokens=2)))  # 7 can be written


def test_a_row_its_settings_leave_nothing_fails_alone(kind_pair, tokenizer):
    slm, llm = kind_pair
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0))
    prompts = encode(engine)[:2]
    greedy = SamplingParams(max_new_tokens=12, ignore_eos=True)
    # (strict verification: each row's output is the LLM's greedy one, whichever rows random routing sends it)
    alone = engine.run([Request(p, greedy, verify="strict") for p in prompts])
    a = only_token(tokenizer, "a")
    # A format whose only answer bad_words bans: the door cannot see it; the first step can.
    doomed = Request(prompts[1], SamplingParams(max_new_tokens=12, output_format=OutputFormat("choice", ["a"]),
                                                bad_words=((a,),)))
    scheduler = Scheduler(engine, max_batch=4)
    sequences = [engine.sequence(Request(p, greedy, verify="strict"), i) for i, p in enumerate(prompts)]
    sequences.insert(1, engine.sequence(doomed, 2))
    for s in sequences:
        scheduler.add(s)
    failures = []
    while not scheduler.idle:
        failures += [e for e in scheduler.turn() if isinstance(e, Failure)]
    assert [f.sequence for f in failures] == [sequences[1]]
    assert isinstance(failures[0].error, NothingToWrite)
    assert "bad_words" in str(failures[0].error) and "choice structured output" in str(failures[0].error)
    assert [sequences[0].generation.token_ids, sequences[2].generation.token_ids] == [g.token_ids for g in alone]
    assert scheduler.kv_in_use == 0


@pytest.fixture(scope="module")
def kind_server(kind_pair, tokenizer):
    slm, llm = kind_pair
    app = create_app(Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0)), "tiny-r2r",
                     Limits(max_batch=4, max_queue=16, max_tokens=400, context_length=512))
    with BackgroundServer(app) as srv:
        yield srv.url


def chat(content="What is 48 / 2?", **kw):
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 8, "temperature": 0, **kw}


class Stream:
    """A greedy stream in a thread: its text, and the finish_reason of its last chunk."""

    def __init__(self, url, payload):
        self.text, self.finish_reason, self.error = "", None, None
        self.thread = threading.Thread(target=self._run, args=(url, payload), daemon=True)
        self.thread.start()

    def _run(self, url, payload):
        with httpx.stream("POST", url + CHAT, json={**payload, "stream": True}, timeout=120) as response:
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.error = event["error"]
                    continue
                for choice in event["choices"]:
                    self.text += choice["delta"].get("content") or ""
                    self.finish_reason = choice.get("finish_reason") or self.finish_reason


def test_beside_two_streams_each_bad_request_gets_its_own_answer(kind_server, tokenizer):
    url, eos, a = kind_server, tokenizer.eos_token_id, only_token(tokenizer, "a")
    # (strict verification: each stream writes the LLM's greedy text, whichever rows random routing sends it)
    long_ones = [chat("Tell me a story.", max_tokens=200, ignore_eos=True, r2r_verify="strict"),
                 chat("Count to ten.", max_tokens=150, ignore_eos=True, stop=["zzzz"], r2r_verify="strict")]
    expected = [httpx.post(url + CHAT, json=p, timeout=120).json()["choices"][0]["message"]["content"]
                for p in long_ones]
    streams = [Stream(url, p) for p in long_ones]
    refused = httpx.post(url + CHAT, json=chat(allowed_token_ids=[eos], min_tokens=2), timeout=60)
    assert refused.status_code == 400 and "min_tokens" in refused.json()["error"]["message"], refused.text
    doomed = chat(structured_outputs={"choice": ["a"]}, bad_words=["a"])
    whole = httpx.post(url + CHAT, json=doomed, timeout=60)
    assert whole.status_code == 400, whole.text
    assert "bad_words" in whole.json()["error"]["message"] and "loosen" in whole.json()["error"]["message"]
    streamed = Stream(url, doomed)
    streamed.thread.join(60)
    assert streamed.error is not None and "bad_words" in streamed.error["message"]
    for stream, text in zip(streams, expected):
        stream.thread.join(120)
        assert stream.error is None and stream.finish_reason == "length" and stream.text == text
    assert a < len(tokenizer)
    assert_idle_soon(url)
