"""A prompt's own log-probabilities (core/scoring.py): each token under the model R2R routes its position to, on
every backend, and through the server as OpenAI's `echo` with `logprobs` gives them (what lm-evaluation-harness
reads for its loglikelihood tasks)."""

import math

import httpx
import openai
import pytest

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.request import Request
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.core.scoring import score_prompt
from roads_to_rome.errors import R2RError
from roads_to_rome.routing.policies import EntropyPolicy, entropy
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.schemas import Limits
from roads_to_rome.serving.server import create_app

TEXT = "Bonjour! Paris is the capital of which country? Explain in a few words."


def reference(model, ids):
    """Each position's log-softmax under one model, read whole."""
    logits, hidden = model.forward_sequence(ids)
    return logits[:-1].float().log_softmax(-1), hidden[:-1]


def scored(engine, ids, **request):
    sequence = engine.sequence(Request(ids, SamplingParams(max_new_tokens=1), prompt_logprobs=3, **request))
    return score_prompt(engine, sequence)


@pytest.mark.parametrize("overlap", [False, True])
def test_each_prompt_token_is_scored_by_the_model_its_position_is_routed_to(kind_pair, tokenizer, overlap):
    slm, llm = kind_pair
    ids = tokenizer.encode(TEXT)
    slm_lp, slm_hidden = reference(slm, ids)
    llm_lp, _ = reference(llm, ids)
    entropies = entropy(slm_lp)
    threshold = float(entropies.median())  # about half the positions each way
    engine = Engine(slm, llm, tokenizer, EntropyPolicy(threshold), overlap=overlap)
    for request, expected in (({"force": "slm"}, ["slm"] * (len(ids) - 1)),
                              ({"force": "llm"}, ["llm"] * (len(ids) - 1)),
                              ({}, ["llm" if e >= threshold else "slm" for e in entropies.tolist()])):
        entries, sources = scored(engine, ids, **request)
        assert sources == expected and entries[0] is None and len(entries) == len(ids)
        for t, (entry, source) in enumerate(zip(entries[1:], sources)):
            lp = (llm_lp if source == "llm" else slm_lp)[t]
            assert entry.logprob == pytest.approx(float(lp[ids[t + 1]]), abs=2e-3)
            assert [token for token, _ in entry.top] == lp.topk(3).indices.tolist()
    assert 0 < expected.count("llm") < len(expected)
    # A request's own threshold, and a target rate read position by position
    assert set(scored(engine, ids, threshold=1e9)[1]) == {"slm"}
    assert set(scored(engine, ids, threshold=-1.0)[1]) == {"llm"}
    assert set(scored(engine, ids, target_rate=0.5)[1]) <= {"slm", "llm"}


def test_one_model_alone_and_one_token_prompts(slm, llm, tokenizer):
    ids = tokenizer.encode(TEXT)
    entries, sources = scored(Engine.alone(llm, tokenizer, "llm"), ids)
    assert sources == ["llm"] * (len(ids) - 1)
    lp, _ = reference(llm, ids)
    assert entries[-1].logprob == pytest.approx(float(lp[-1, ids[-1]]), abs=2e-3)
    assert scored(Engine(slm, llm, tokenizer, EntropyPolicy(1.0)), ids[:1]) == ([None], [])


def test_a_model_that_gives_its_top_tokens_only_cannot_score_a_prompt(slm, llm, tokenizer, monkeypatch):
    engine = Engine(slm, llm, tokenizer, EntropyPolicy(1.0))
    monkeypatch.setattr(llm, "full_logits", False)  # as a remote LLM's
    with pytest.raises(R2RError, match="whole distribution"):
        engine.sequence(Request([1, 2, 3], prompt_logprobs=1))
    assert engine.sequence(Request([1, 2, 3], prompt_logprobs=1, force="slm"))
    with pytest.raises(R2RError, match="0 or more"):
        Request([1, 2, 3], prompt_logprobs=-1)


def test_echo_with_logprobs_gives_the_prompts_entries_as_lm_eval_reads_them(slm, llm, tokenizer):
    """lm-evaluation-harness's loglikelihood request: token-id prompts, echo, max_tokens 1, logprobs 1; it sums
    `token_logprobs[ctxlen:-1]` and checks each against the best of `top_logprobs`."""
    ids = tokenizer.encode(TEXT)
    engine = Engine(slm, llm, tokenizer, EntropyPolicy(float(entropy(reference(slm, ids)[0]).median())))
    expected = {force: scored(engine, ids, **({"force": force} if force else {})) for force in ("slm", "llm", None)}
    with BackgroundServer(create_app(engine, "tiny", Limits(max_batch=4, max_tokens=16, context_length=256))) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        for force, (entries, sources) in expected.items():
            out = client.completions.create(model="tiny", prompt=[ids, ids[:5]], echo=True, max_tokens=1, logprobs=1,
                                            temperature=0, extra_body={"r2r_policy": force} if force else None)
            first, short = (choice.logprobs for choice in out.choices)
            assert first.tokens[:-1] == [tokenizer.decode([t]) for t in ids] and len(first.tokens) == len(ids) + 1
            assert first.token_logprobs[0] is None and first.top_logprobs[0] is None
            for got, entry in zip(first.token_logprobs[1 : len(ids)], entries[1:]):
                assert got == pytest.approx(entry.logprob, abs=1e-4)
            assert all(len(top) == 1 for top in first.top_logprobs[1:])
            assert first.text_offset == sorted(first.text_offset) and first.text_offset[0] == 0
            assert out.choices[0].text.startswith(tokenizer.decode(ids))
            assert first.text_offset[len(ids)] == len(tokenizer.decode(ids))  # the generated token follows the echo
            assert len(short.tokens) == 6
            ctxlen = 3
            loglikelihood = sum(first.token_logprobs[ctxlen:-1])
            assert math.isfinite(loglikelihood) and loglikelihood < 0
            assert out.model_extra.get("r2r") is None  # (two choices: provenance goes in each)
            assert out.choices[0].model_extra["r2r"]["prompt_sources"] == sources
        streamed = httpx.post(srv.url + "/v1/completions", json={"prompt": TEXT, "echo": True, "logprobs": 1,
                                                                  "stream": True})
        assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "stream"
