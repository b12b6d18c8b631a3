"""Prefix caching: prompts read before, kept per model, so that a prompt that begins the same way reads only the
rest (core/prefix_cache.py, the scheduler's `PromptRead`), on every backend, in the LLM's queue (--overlap), and
through the server's three APIs."""

import httpx
import numpy as np
import openai
import pytest
import torch
from conftest import HAS_LLAMA, make_backend, tiny_llamacpp
from tiny import save_gguf

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.prefix_cache import PrefixCache, common_prefix
from roads_to_rome.core.request import Failure, Request
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.core.scheduler import PromptRead
from roads_to_rome.routing.policies import AlwaysLLM, AlwaysSLM, RandomPolicy
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.limits import Limits
from roads_to_rome.serving.server import create_app


def drive(scheduler, requests, engine):
    """Each request queued after the one before has finished (a conversation's turns): their generations."""
    gens = []
    for request in requests:
        s = engine.sequence(request)
        scheduler.add(s)
        for _ in range(10_000):
            if scheduler.idle:
                break
            failed = [e.error for e in scheduler.turn() if isinstance(e, Failure)]
            assert not failed, failed
        gens.append(s.generation)
    return gens


def settle(scheduler, engine) -> None:
    """Before another engine runs on the same backends: the scheduler lets its kept prompts go, and what its LLM's
    worker still has queued (rows given back) has run. A llama.cpp backend's sequences are shared by the engines on
    it."""
    scheduler.forget_kept()
    if engine.llm_side is not None:
        engine.llm_side.wait_idle()


def columns_read(model, monkeypatch) -> list[int]:
    """Each read's new columns, as the model is handed them from now on (a local model's `read` is its forward)."""
    read = []

    def spying(original):
        def spy(cache, new_ids, *args, **kwargs):
            read.append(new_ids.shape[1])
            return original(cache, new_ids, *args, **kwargs)
        return spy

    for name in ("forward", "forward_all"):
        monkeypatch.setattr(model, name, spying(getattr(model, name)))
    return read


@pytest.mark.parametrize("overlap", [False, True])
def test_a_prompt_that_begins_as_an_earlier_one_reads_only_the_rest_and_answers_the_same(kind_pair, tokenizer,
                                                                                         overlap, monkeypatch):
    """A conversation's second turn begins with the first turn's prompt and answer: each model starts from what it
    kept of them and reads only the rest, in chunks, and the answers are the ones a scheduler that keeps nothing gives
    (strict verification: the LLM's own, however the rows were routed). A third prompt shares only the first's first
    tokens and starts from them; a request forced onto the SLM takes nothing from the LLM."""
    slm, llm = kind_pair
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.4, seed=1), verify="strict", overlap=overlap)
    first = engine.prompts.raw("A conversation about the capital of France, its rivers and its bridges. " * 2)
    params = SamplingParams(max_new_tokens=8)
    alone = Engine(slm, llm, tokenizer, AlwaysLLM())
    answer = alone.generate([first], params)[0].token_ids
    second = first + answer + engine.prompts.raw(" And of Spain?")
    third = first[:10] + engine.prompts.raw(" something else entirely")
    scheduler = engine.scheduler(4, prefill_chunk=7, prefix_tokens=4096)
    writer_reads, llm_reads = columns_read(slm, monkeypatch), columns_read(llm, monkeypatch)
    gens = drive(scheduler, [Request(first, params)], engine)
    assert gens[0].token_ids == answer and gens[0].cached_tokens == 0
    del writer_reads[:], llm_reads[:]
    gens += drive(scheduler, [Request(second, params)], engine)
    # What each model read of the first turn: its prompt and answer, the SLM all but the answer's last token, the
    # LLM (lazy, and a rejected token's column forgotten) as far as it caught up: no further. The reported figure is
    # the fewer.
    slm_kept = len(first) + len(answer) - 1
    assert len(first) <= gens[1].cached_tokens <= slm_kept
    for reads, kept in ((writer_reads, slm_kept), (llm_reads, gens[1].cached_tokens)):
        rest = len(second) - 1 - kept  # read in chunks of 7 from there
        assert reads[: -(-rest // 7)] == [7] * (rest // 7) + ([rest % 7] if rest % 7 else [])
    gens += drive(scheduler, [Request(third, params), Request(second, params, force="slm")], engine)
    assert gens[2].cached_tokens == common_prefix(np.asarray(first), np.asarray(third)) > 0
    assert gens[3].cached_tokens == len(second) - 1  # the SLM's own kept read
    settle(scheduler, engine)
    assert [g.token_ids for g in gens[:3]] == [g.token_ids for g in
                                               alone.generate([first, second, third], params)]
    assert gens[3].token_ids == Engine(slm, llm, tokenizer, AlwaysSLM()).generate([second], params)[0].token_ids
    assert engine.counters.prefix_hits == sum(g.cached_tokens for g in gens)
    assert engine.counters.prefix_queries == sum(len(g.prompt_ids) - 1 for g in gens)


@pytest.mark.parametrize("overlap", [False, True])
def test_requests_arriving_together_with_one_prompt_read_it_once(kind_pair, tokenizer, overlap, monkeypatch):
    """The n choices of one prompt (and prompts that share most of theirs) arrive together: the first reads it, the
    others wait for that read and start from what it kept, so each model reads the prompt once; answers as each
    would read it alone (strict verification: the LLM's own). A prompt sharing less than half waits for nothing,
    nor does one with another cache_salt."""
    slm, llm = kind_pair
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.4, seed=1), verify="strict", overlap=overlap)
    prompt = engine.prompts.raw("Three answers to one question about the rivers of France, please. " * 2)
    longer = prompt + engine.prompts.raw(" And Spain?")
    apart = prompt[:8] + engine.prompts.raw(" a question of its own, long enough to read in several chunks")
    params = SamplingParams(max_new_tokens=6)
    scheduler = engine.scheduler(6, prefill_chunk=16, prefix_tokens=4096)  # (llama.cpp: 2 sequences to keep)
    read, advance = [], PromptRead.advance

    def counted(prefill, chunk):  # prompt tokens each chunk read, summed over the models
        before = sum(cache.length for _, cache, _ in prefill.models)
        advance(prefill, chunk)
        read.append(sum(cache.length for _, cache, _ in prefill.models) - before)

    monkeypatch.setattr(PromptRead, "advance", counted)
    asked = [Request(prompt, params)] * 3 + [Request(longer, params), Request(apart, params),
                                             Request(prompt, params, cache_salt="other")]
    sequences = [engine.sequence(r, i) for i, r in enumerate(asked)]
    for s in sequences:
        scheduler.add(s)
    while not scheduler.idle:
        assert not [e.error for e in scheduler.turn() if isinstance(e, Failure)]
    cached = [s.generation.cached_tokens for s in sequences]
    goal = len(prompt) - 1
    assert cached[:4] == [0, goal, goal, goal] and cached[4:] == [0, 0]
    # Each model read the prompt once, the longer one's rest, the apart one whole, the salted one whole
    assert sum(read) == 2 * (goal + (len(longer) - 1 - goal) + (len(apart) - 1) + goal)
    settle(scheduler, engine)
    expected = Engine(slm, llm, tokenizer, AlwaysLLM()).generate([prompt, longer, apart], params)
    assert [s.generation.token_ids for s in sequences] == [expected[i].token_ids for i in (0, 0, 0, 1, 2, 0)]


@pytest.mark.parametrize("overlap", [False, True])
def test_a_finished_row_kept_out_of_a_padded_batch_answers_as_read_afresh(kind_pair, tokenizer, overlap):
    """A short prompt decodes beside a long one (left-padded in the batch); each model keeps what it read of it, its
    padding trimmed. A next turn that begins with its prompt and answer starts from there and answers as it would read
    afresh: the LLM's own answer (strict verification), and the SLM's own when forced onto it."""
    slm, llm = kind_pair
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.4, seed=1), verify="strict", overlap=overlap)
    short, long = engine.prompts.raw("Count to five."), engine.prompts.raw("A much longer prompt about bridges. " * 3)
    params = SamplingParams(max_new_tokens=6)
    scheduler = engine.scheduler(4, prefill_chunk=5, prefix_tokens=4096)
    sequences = [engine.sequence(Request(p, params)) for p in (short, long)]
    for s in sequences:
        scheduler.add(s)
    while not scheduler.idle:
        assert not [e.error for e in scheduler.turn() if isinstance(e, Failure)]
    answer = sequences[0].generation.token_ids
    follow = short + answer + engine.prompts.raw(" and back")
    gens = drive(scheduler, [Request(follow, params), Request(follow + [5], params, force="slm")], engine)
    assert gens[0].cached_tokens >= len(short) + len(answer) - 3 and gens[1].cached_tokens >= len(follow) - 1
    settle(scheduler, engine)
    assert gens[0].token_ids == Engine(slm, llm, tokenizer, AlwaysLLM()).generate([follow], params)[0].token_ids
    assert gens[1].token_ids == Engine(slm, llm, tokenizer, AlwaysSLM()).generate([follow + [5]],
                                                                                  params)[0].token_ids


def test_what_a_model_keeps_one_prompt_beginning_another_the_budget_and_the_rows(slm, tokenizer):
    """A kept prompt that a newer one begins with goes (the newer holds it); one the newer begins stays alone; the
    least recently used goes first beyond the tokens or rows allowed; a copy taken holds exactly the shared tokens."""
    prefixes = PrefixCache(slm, max_tokens=40, max_rows=2)

    def read(ids):
        cache = slm.new_cache()
        slm.score_sequence(ids, cache, lambda *_: None)
        return cache

    a = list(range(5, 25))
    prefixes.keep(a, read(a))
    prefixes.keep(a[:12], read(a[:12]))  # begins the kept one: nothing new
    assert [len(k.tokens) for k in prefixes.kept.values()] == [20]
    longer = a + [40, 41]
    prefixes.keep(longer, read(longer))  # holds the kept one: takes its place
    assert [len(k.tokens) for k in prefixes.kept.values()] == [22] and prefixes.tokens == 22
    b = [7] * 10
    prefixes.keep(b, read(b))
    cache, n = prefixes.take(a[:15] + [99, 98])  # `longer` used last: `b` is the least recently used
    assert n == 15 and cache.length == 15
    whole, _ = slm.forward_sequence(a[:15] + [99, 98])
    logits, _ = slm.forward(cache, torch.tensor([[99, 98]]), torch.ones(1, 17, dtype=torch.long))
    assert (logits[0] - whole[-1]).abs().max() < 1e-4  # the copy reads on as the whole prompt would
    c = [9] * 12
    prefixes.keep(c, read(c))  # two rows at most: `b` goes
    assert sorted(len(k.tokens) for k in prefixes.kept.values()) == [12, 22] and prefixes.tokens == 34
    d = [11] * 30
    prefixes.keep(d, read(d))  # 40 tokens at most: both go
    assert [len(k.tokens) for k in prefixes.kept.values()] == [30]
    prefixes.keep([1] * 41, read([1] * 41))  # more than the budget: not kept
    assert prefixes.tokens == 30
    assert prefixes.take([2, 3]) == (None, 0)


def test_a_salted_prompt_is_found_only_with_its_salt(slm):
    """`cache_salt` fences kept prompts: one kept with a salt is found by that salt alone, one kept without by
    requests without one; a longer prompt with another salt does not take the place of the one it extends."""
    prefixes = PrefixCache(slm, max_tokens=200)

    def read(ids):
        cache = slm.new_cache()
        slm.score_sequence(ids, cache, lambda *_: None)
        return cache

    a = list(range(5, 25))
    prefixes.keep(a, read(a), salt="alice")
    assert prefixes.take(a) == (None, 0) and prefixes.take(a, "bob") == (None, 0)
    assert prefixes.take(a + [1], "alice")[1] == 20
    prefixes.keep(a + [1, 2], read(a + [1, 2]), salt="bob")  # extends alice's, but is bob's: both stay
    prefixes.keep(a[:10], read(a[:10]))
    assert sorted((k.salt or "", len(k.tokens)) for k in prefixes.kept.values()) == [("", 10), ("alice", 20),
                                                                                    ("bob", 22)]
    assert prefixes.take(a)[1] == 10 and prefixes.take(a + [1, 2], "bob")[1] == 22


@pytest.mark.skipif(not HAS_LLAMA, reason="llama-cpp-python is not installed")
def test_llamacpp_kept_prompts_hold_spare_sequences_and_give_their_kv_room_to_requests(slm, llm, tokenizer,
                                                                                      tmp_path):
    """On llama.cpp a kept prompt holds one of the context's sequences and its cells: the scheduler keeps as many
    prompts as there are sequences beyond its batch's, and lets kept prompts go when a request needs their room
    rather than make it wait for ever."""
    models = []
    for name, model in (("slm", slm.model), ("llm", llm.model)):
        save_gguf(model, tokenizer, tmp_path / f"{name}.gguf")
        models.append(tiny_llamacpp(tmp_path / f"{name}.gguf", name=name, n_ctx=256, max_rows=8,
                                    vocab_size=len(tokenizer)))
    engine = Engine(*models, tokenizer, RandomPolicy(0.3, seed=0))
    scheduler = engine.scheduler(6, prefill_chunk=16, prefix_tokens=4096)
    assert [p.max_rows for p in scheduler.prefixes] == [2, 2]
    prompts = [engine.prompts.raw(f"number {i} " * 3) for i in range(5)]
    params = SamplingParams(max_new_tokens=4)
    gens = drive(scheduler, [Request(p, params) for p in prompts] + [Request(prompts[4], params)], engine)
    assert [len(p.kept) for p in scheduler.prefixes] == [2, 2] and gens[-1].cached_tokens == len(prompts[4]) - 1
    prompt = engine.prompts.raw("x y " * 5)
    big = Request(prompt, SamplingParams(max_new_tokens=256 - len(prompt) - 2, ignore_eos=True))
    gens = drive(scheduler, [big], engine)  # admitted once kept prompts made room: its every cell is written
    assert len(gens[0].token_ids) == big.params.max_new_tokens
    assert max(p.tokens for p in scheduler.prefixes) > 200  # what the SLM read of it is kept, in turn
    gens = drive(scheduler, [Request(prompts[0], params)], engine)  # ... and goes to make room
    assert gens[0].cached_tokens == 0 and max(p.tokens for p in scheduler.prefixes) < 200


@pytest.mark.skipif(not HAS_LLAMA, reason="llama-cpp-python is not installed")
def test_a_server_that_stops_gives_its_kept_prompts_back(slm, llm, tokenizer, tmp_path):
    """The backends outlive a server (tests, benches): its kept prompts' llama.cpp sequences go back as it stops, so
    the next server on them has every row it counts on."""
    engine = Engine(make_backend("llamacpp", slm.model, tokenizer, tmp_path, "slm"),
                    make_backend("llamacpp", llm.model, tokenizer, tmp_path, "llm"), tokenizer,
                    RandomPolicy(0.3, seed=0))  # 8 sequences per model
    for _ in range(3):  # each server keeps up to 6 prompts beside its batch of 2
        app = create_app(engine, "tiny", Limits(max_batch=2, max_tokens=4, context_length=512))
        with BackgroundServer(app) as srv:
            for i in range(8):
                r = httpx.post(srv.url + "/v1/completions", json={"prompt": f"prompt {i} " * 4, "max_tokens": 4})
                assert r.status_code == 200, r.text
            assert [len(p.kept) for p in app.state.r2r.engine_thread.scheduler.prefixes] == [6, 6]
        assert not any(p.kept for p in app.state.r2r.engine_thread.scheduler.prefixes)


@pytest.fixture(scope="module")
def server(slm, llm, tokenizer):
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0))
    with BackgroundServer(create_app(engine, "tiny-r2r", Limits(max_tokens=16, context_length=512))) as srv:
        yield srv


def test_the_server_says_what_its_apis_took_from_kept_prompts(server):
    """Each API reports the prompt tokens prefix caching found as it names them: chat's
    `prompt_tokens_details.cached_tokens`, the Responses API's `input_tokens_details.cached_tokens` (a response
    gone on from), Anthropic's `cache_read_input_tokens` (apart from `input_tokens`); /metrics counts them."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    system = {"role": "system", "content": "You answer questions about capitals, rivers and bridges. " * 3}
    first = client.chat.completions.create(model="tiny-r2r", max_tokens=4, temperature=0,
                                           messages=[system, {"role": "user", "content": "France?"}])
    again = client.chat.completions.create(model="tiny-r2r", max_tokens=4, temperature=0,
                                           messages=[system, {"role": "user", "content": "Spain?"}])
    shared = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0 < shared < again.usage.prompt_tokens
    response = client.responses.create(model="tiny-r2r", input="Tell me about rivers " * 10, max_output_tokens=4)
    later = client.responses.create(model="tiny-r2r", input="And bridges?", previous_response_id=response.id,
                                    max_output_tokens=4)
    assert later.usage.input_tokens_details.cached_tokens >= response.usage.input_tokens - 1
    body = {"model": "tiny-r2r", "max_tokens": 4, "system": system["content"],
            "messages": [{"role": "user", "content": "Italy?"}]}
    usage = httpx.post(server.url + "/v1/messages", json=body).json()["usage"]
    assert usage["cache_read_input_tokens"] == shared
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == httpx.post(
        server.url + "/v1/messages/count_tokens", json=body).json()["input_tokens"]
    metrics = httpx.get(server.url + "/metrics").text
    hits = next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("r2r:prefix_cache_hits"))
    assert hits >= shared * 2


def test_a_request_shares_kept_prompts_only_with_requests_of_its_cache_salt(server):
    """vLLM's `cache_salt` on the server: a user who gives a secret salt neither finds what others read nor lets
    them find what it read (a kept prompt answers sooner and says so in `cached_tokens`); the same salt shares, on
    every API (the Responses and Messages APIs take it as an extra field). An empty salt is a 400."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    system = {"role": "system", "content": "Mountains, lakes and passes are what you answer about. " * 3}

    def cached(question, salt=None):
        out = client.chat.completions.create(model="tiny-r2r", max_tokens=2, temperature=0,
                                             messages=[system, {"role": "user", "content": question}],
                                             extra_body={} if salt is None else {"cache_salt": salt})
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached("Alps?", "alice-secret") == 0
    # alice's is hers alone (unsalted, the chat template's first tokens may be found kept by other tests' requests)
    assert cached("Andes?") < 20 and cached("Andes?", "bob-secret") == 0
    assert cached("Rockies?", "alice-secret") > 40 and cached("Urals?") > 40 and cached("Urals?", "bob-secret") > 40
    later = client.responses.create(model="tiny-r2r", instructions=system["content"], input="Atlas?",
                                    max_output_tokens=2, extra_body={"cache_salt": "carol-secret"})
    assert later.usage.input_tokens_details.cached_tokens == 0
    body = {"model": "tiny-r2r", "max_tokens": 2, "system": system["content"], "cache_salt": "carol-secret",
            "messages": [{"role": "user", "content": "Pyrenees?"}]}
    assert httpx.post(server.url + "/v1/messages", json=body).json()["usage"]["cache_read_input_tokens"] > 40
    for salt in ("", "s" * 1025):  # empty, or longer than a kept prompt should carry
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "cache_salt": salt})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_the_prefix_bench_pairs_each_turn_with_its_twin_and_finds_where_answers_part():
    """`r2r bench prefix`'s figures: per turn means over conversations, ratios of whole conversations, and the turn
    where each conversation's answers first differ between the two servers."""
    from roads_to_rome.bench.serving import conversation_figures

    def turn(ttft, text):
        return {"text": text, "ttft_s": ttft, "seconds": 2 * ttft, "prompt_tokens": 10, "cached_tokens": 5,
                "completion_tokens": 3}

    measured = {"kept": [[[turn(1, "a"), turn(1, "b")], [turn(2, "c"), turn(1, "d")]]],
                "none": [[[turn(2, "a"), turn(3, "x")], [turn(4, "y"), turn(1, "d")]]]}
    figures = conversation_figures(measured)
    assert figures["per_turn"]["kept"][0]["ttft_s"] == 1.5 and figures["per_turn"]["none"][1]["ttft_s"] == 2.0
    assert figures["x_ttft"] == 2.0 and figures["x_seconds"] == 2.0
    assert figures["x_ttft_per_turn"] == [2.0, 2.0]
    assert figures["first_difference"] == [2, 1] and (figures["same_answers"], figures["answers"]) == (2, 4)


def test_the_priority_bench_compares_each_urgent_request_under_both_policies():
    """`r2r bench priority`'s figures: each urgent request's means over rounds, the ratios of first come first served
    to priority, the batch job's tokens per second over both rounds, and how many urgent answers are alike."""
    from roads_to_rome.bench.serving import urgency_figures

    def run(ttfts, texts, preemptions, tokens):
        return {"urgent": [{"ttft_s": t, "seconds": 2 * t, "text": x} for t, x in zip(ttfts, texts)],
                "preemptions": preemptions, "batch_requests": 3, "batch_tokens": tokens, "urgent_tokens": 20,
                "seconds": 10.0}

    measured = {"fcfs": [run([4, 8], ["a", "b"], 0, 100), run([6, 2], ["a", "b"], 0, 60)],
                "priority": [run([1, 1], ["a", "c"], 2, 80), run([1, 3], ["a", "b"], 1, 40)]}
    figures = urgency_figures(measured)
    fcfs, priority = figures["by_scheduling"]["fcfs"], figures["by_scheduling"]["priority"]
    assert fcfs["ttft_s"] == [5.0, 5.0] and priority["ttft_s"] == [1.0, 2.0] and priority["worst_ttft_s"] == 2.0
    assert figures["x_ttft"] == 5.0 / 1.5 and figures["x_seconds"] == 5.0 / 1.5
    assert fcfs["batch_tokens_per_s"] == 8.0 and priority["batch_tokens_per_s"] == 6.0
    assert fcfs["tokens_per_s"] == 10.0 and priority["tokens_per_s"] == 8.0
    assert figures["throughput_kept"] == 0.8 and priority["preemptions"] == 3
    assert (figures["same_urgent_answers"], figures["urgent_answers"]) == (3, 4)
