"""A prompt's own log-probabilities (core/scoring.py): each token under the model R2R routes its position to, on
every backend, and through the server as OpenAI's `echo` with `logprobs` gives them (what lm-evaluation-harness
reads for its loglikelihood tasks)."""

import math

import httpx
import openai
import pytest

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.request import Failure, Request
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.core.scheduler import PromptRead
from roads_to_rome.core.scoring import score_prompt
from roads_to_rome.errors import R2RError
from roads_to_rome.routing.policies import AlwaysLLM, AlwaysSLM, EntropyPolicy, entropy
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.limits import Limits
from roads_to_rome.serving.server import create_app

TEXT = "Bonjour! Paris is the capital of which country? Explain in a few words."


def reference(model, ids):
    """Each position's log-softmax under one model, read whole."""
    logits, hidden = model.forward_sequence(ids)
    return logits[:-1].float().log_softmax(-1), hidden[:-1]


def split_between(values):
    """A threshold with about half the values each side, midway across the widest gap among the middle half: no
    value lies within rounding of it (a padded read's last bits then cannot move a position across)."""
    ordered = sorted(values.tolist())
    quarter = len(ordered) // 4
    middle = ordered[quarter:len(ordered) - quarter]
    low, high = max(zip(middle, middle[1:]), key=lambda pair: pair[1] - pair[0])
    return (low + high) / 2


def scored(engine, ids, **request):
    sequence = engine.sequence(Request(ids, SamplingParams(max_new_tokens=1), prompt_logprobs=3, **request))
    read = PromptRead(engine.context, sequence)
    try:
        return score_prompt(engine.context, sequence, read.per_model)
    finally:
        read.release()


@pytest.mark.parametrize("overlap", [False, True])
def test_each_prompt_token_is_scored_by_the_model_its_position_is_routed_to(kind_pair, tokenizer, overlap):
    slm, llm = kind_pair
    ids = tokenizer.encode(TEXT)
    slm_lp, slm_hidden = reference(slm, ids)
    llm_lp, _ = reference(llm, ids)
    entropies = entropy(slm_lp)
    threshold = split_between(entropies)
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
    assert set(scored(engine, ids, threshold=0.0)[1]) == {"llm"}
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
    monkeypatch.setattr(llm, "scores_prompts", False)  # as llama.cpp's server
    with pytest.raises(R2RError, match="no prompt log-probabilities"):
        engine.sequence(Request([1, 2, 3], prompt_logprobs=1))
    assert engine.sequence(Request([1, 2, 3], prompt_logprobs=1, force="slm"))
    with pytest.raises(R2RError, match="0 or more"):
        Request([1, 2, 3], prompt_logprobs=-1)


def test_echo_with_logprobs_gives_the_prompts_entries_as_lm_eval_reads_them(slm, llm, tokenizer):
    """lm-evaluation-harness's loglikelihood request: token-id prompts, echo, max_tokens 1, logprobs 1; it sums
    `token_logprobs[ctxlen:-1]` and checks each against the best of `top_logprobs`."""
    ids = tokenizer.encode(TEXT)
    engine = Engine(slm, llm, tokenizer, EntropyPolicy(split_between(entropy(reference(slm, ids)[0]))))
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


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("prefill_chunk", [None, 4])
def test_a_scored_prompt_is_read_once_by_each_model_and_decoding_goes_on_from_that_read(kind_pair, tokenizer, overlap,
                                                                                       prefill_chunk, monkeypatch):
    """Scoring is the prompt's read: each model reads each column of a scored request at most once (the prompt,
    then what it writes), whether the LLM scored some positions, all, or none and reads the prompt later; each
    answer is the one the request gets unscored, beside rows that are not scored."""
    slm, llm = kind_pair
    ids = tokenizer.encode(TEXT)
    engine = Engine(slm, llm, tokenizer, EntropyPolicy(split_between(entropy(reference(slm, ids)[0]))),
                    verify="strict", overlap=overlap)
    requests = [Request(ids, SamplingParams(max_new_tokens=4), prompt_logprobs=1),
                Request(ids[2:], SamplingParams(max_new_tokens=3), prompt_logprobs=0, force="llm"),
                Request(ids[1:], SamplingParams(max_new_tokens=5), prompt_logprobs=2, force="slm", verify="off"),
                Request(ids[3:], SamplingParams(max_new_tokens=3), prompt_logprobs=2, force="slm"),
                Request(ids[:6], SamplingParams(max_new_tokens=3))]
    alone = [Engine(slm, llm, tokenizer, AlwaysSLM() if r.force == "slm" else AlwaysLLM()).generate(
        [r.prompt_ids], r.params)[0].token_ids for r in requests]  # (strict: a routed answer is the LLM's own)
    columns, inside = {"slm": 0, "llm": 0}, []

    def counting(name, original, width):
        def spy(*args, **kwargs):
            columns[name] += 0 if inside else width(*args, **kwargs)  # (a read that runs `forward` counts once)
            inside.append(1)
            try:
                return original(*args, **kwargs)
            finally:
                inside.pop()
        return spy

    for name, model in (("slm", slm), ("llm", llm)):
        for method in ("read", "forward", "forward_all"):
            monkeypatch.setattr(model, method, counting(name, getattr(model, method), lambda c, ids, mask, *a, **k:
                                                        int(mask[:, -ids.shape[1]:].sum())))  # (padding left out)
        monkeypatch.setattr(model, "forward_sequence", counting(name, model.forward_sequence,
                                                                lambda ids, *a, **k: len(ids)))
    scheduler = engine.scheduler(2, prefill_chunk=prefill_chunk)  # (two at once: rows join and leave)
    sequences = [engine.sequence(r) for r in requests]
    for s in sequences:
        scheduler.add(s)
    events = []
    while not scheduler.idle:
        events += scheduler.turn()
    assert not [e.error for e in events if isinstance(e, Failure)]
    assert [s.generation.token_ids for s in sequences] == alone
    for s, r in zip(sequences[:4], requests):
        assert len(s.generation.prompt_logprobs) == len(r.prompt_ids)
    assert set(sequences[1].generation.prompt_sources) == {"llm"}
    assert 0 < sequences[0].generation.prompt_sources.count("llm") < len(ids) - 1
    # Each model reads each token of a row once: the prompt, what is written, and what verification threw away, by
    # a rollback or (under overlap, the SLM writing on while a call is in flight) a deferred token's replacement (the
    # LLM skips the unverified request forced onto the SLM). Reading a scored prompt twice would pass these by its
    # length.
    tokens = [len(r.prompt_ids) + len(s.generation.token_ids) + s.generation.discarded + s.generation.deferred_discarded
              for r, s in zip(requests, sequences)]
    assert columns["slm"] <= sum(tokens)
    assert columns["llm"] <= sum(t for t, s in zip(tokens, sequences) if s.uses_llm)


def test_vllms_prompt_logprobs_field_and_echo_without_generation(slm, llm, tokenizer):
    """vLLM's `prompt_logprobs` (each choice's for completions, the reply's for chat: by token id, the prompt's
    token first, with its rank), and echo with max_tokens 0: the prompt alone, scored, nothing written after it."""
    ids = tokenizer.encode(TEXT)
    engine = Engine(slm, llm, tokenizer, EntropyPolicy(split_between(entropy(reference(slm, ids)[0]))))
    entries, _ = scored(engine, ids)
    with BackgroundServer(create_app(engine, "tiny", Limits(max_batch=4, max_tokens=16, context_length=256))) as srv:
        post = lambda path, **body: httpx.post(srv.url + path, json={"temperature": 0, **body}, timeout=60)  # noqa: E731
        out = post("/v1/completions", prompt=ids, max_tokens=2, prompt_logprobs=3).json()
        choice = out["choices"][0]
        shown = choice["prompt_logprobs"]
        assert choice["logprobs"] is None and shown[0] is None and len(shown) == len(ids)
        for token, entry, expected in zip(ids[1:], shown[1:], entries[1:]):
            first, *tops = entry.items()
            assert first[0] == str(token) and first[1]["logprob"] == pytest.approx(expected.logprob, abs=1e-4)
            assert first[1]["decoded_token"] == tokenizer.decode([token])
            ranked = sorted(entry.values(), key=lambda e: e["rank"])
            assert [e["logprob"] for e in ranked] == sorted((e["logprob"] for e in ranked), reverse=True)
            assert {e["rank"] for e in entry.values()} >= {1, 2, 3} and len(entry) in (3, 4)
            assert (first[1]["rank"] <= 3) == (len(entry) == 3)
        assert out["usage"]["completion_tokens"] == 2
        chat = post("/v1/chat/completions", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                    prompt_logprobs=0).json()
        assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
        assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
        # Echo with max_tokens 0, as older lm-evaluation-harness versions score a prompt
        alone = post("/v1/completions", prompt=[ids, ids[:4]], echo=True, max_tokens=0, logprobs=1).json()
        first, short = alone["choices"]
        assert first["text"] == tokenizer.decode(ids) and short["text"] == tokenizer.decode(ids[:4])
        assert len(first["logprobs"]["tokens"]) == len(ids) and len(short["logprobs"]["token_logprobs"]) == 4
        assert first["logprobs"]["token_logprobs"][1:] == pytest.approx([e.logprob for e in entries[1:]], abs=1e-4)
        assert alone["usage"]["completion_tokens"] == 0 and first["r2r"]["token_ids"] == []
        for body, param in (({"prompt": ids, "max_tokens": 0}, "max_tokens"),
                            ({"prompt": ids, "echo": True, "max_tokens": 0, "stream": True}, "stream"),
                            ({"prompt": ids, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                            ({"prompt": ids, "prompt_logprobs": 21}, "prompt_logprobs")):
            refused = post("/v1/completions", **body)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, body
