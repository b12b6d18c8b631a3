"""Prefix caching on the real default pair (llama.cpp) behind the server: a conversation's second turn starts from
what both models kept of the first (its prompt and answer), and the distribution it answers from is the one a server
that keeps nothing gives, up to llama.cpp's own noise between ways of reading the same tokens."""

import dataclasses
import importlib.util
import math

import httpx
import pytest

from roads_to_rome.core.prefix_cache import KEPT_ROWS
from roads_to_rome.models import load_engine
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.limits import SERVER_SCHEDULING, Limits
from roads_to_rome.serving.server import create_app

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                                  reason="llama-cpp-python is not installed")]
FIRST = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
         "How many clips did Natalia sell altogether in April and May?")


def test_a_second_turn_reads_only_its_new_message_and_answers_from_the_same_distribution():
    engine = load_engine(device="cpu", backend="llamacpp", llama={"max_rows": 2 + KEPT_ROWS, "n_ctx": 8192})
    answers, turns = {}, [{"role": "user", "content": FIRST}]
    for kept in (16384, 0):
        scheduling = dataclasses.replace(SERVER_SCHEDULING, prefix_tokens=kept)
        with BackgroundServer(create_app(engine, "r2r", Limits(max_batch=2), scheduling=scheduling)) as srv:
            url = srv.url + "/v1/chat/completions"
            if kept:  # the first turn, answered here; the server that keeps nothing is asked the same second turn
                first = httpx.post(url, json={"messages": turns, "max_tokens": 64, "temperature": 0},
                                   timeout=600).json()
                turns += [first["choices"][0]["message"],
                          {"role": "user", "content": "And how many in June, if she sold twice as many as in May?"}]
            answers[kept] = httpx.post(url, json={"messages": turns, "max_tokens": 1, "temperature": 0,
                                                  "logprobs": True, "top_logprobs": 5}, timeout=600).json()
    with_cache, without = answers[16384], answers[0]
    assert without["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert with_cache["usage"]["prompt_tokens"] == without["usage"]["prompt_tokens"]
    # The first turn's prompt and most of its answer were kept: only the rest is read.
    assert with_cache["usage"]["prompt_tokens_details"]["cached_tokens"] > first["usage"]["prompt_tokens"] + 16
    top = [{t["token"]: t["logprob"] for t in a["choices"][0]["logprobs"]["content"][0]["top_logprobs"]}
           for a in (with_cache, without)]
    shared = set(top[0]) & set(top[1])
    assert len(shared) >= 4 and max(top[0], key=top[0].get) == max(top[1], key=top[1].get)
    # The same distribution, to a few hundredths of probability over the likeliest tokens (a row read from the wrong
    # cells or positions would be another distribution altogether)
    assert sum(abs(math.exp(top[0][t]) - math.exp(top[1][t])) for t in shared) < 0.05
