"""The one scheduler every client drives, and the split between a client's request and the engine's sequence."""

import dataclasses
import gc

import pytest
from conftest import HAS_LLAMA, tiny_llamacpp
from tiny import save_gguf, tiny_model

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.request import Cancelled, Failure, Request, Step
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.core.scheduler import Scheduler
from roads_to_rome.errors import R2RError
from roads_to_rome.routing.policies import AlwaysLLM, AlwaysSLM, RandomPolicy

PROMPTS = ["What is 48 / 2?", "def add(a, b):", "Bonjour! Paris is the capital of which country? Explain.",
           "Count to five."]


def drive(scheduler):
    """Turns to the end: every event, in order."""
    events = []
    while not scheduler.idle:
        events += scheduler.turn()
    return events


@pytest.fixture
def engine(slm, llm, tokenizer):
    return Engine(slm, llm, tokenizer, RandomPolicy(0.4, seed=1), verify="1")


def test_a_request_is_checked_when_made_and_never_written_to(engine):
    with pytest.raises(R2RError, match="at least one token"):
        Request([], SamplingParams())
    with pytest.raises(R2RError, match="max new tokens"):
        Request([1, 2], SamplingParams(max_new_tokens=0))
    with pytest.raises(R2RError, match="force 'slm' or 'llm'"):
        Request([1, 2], force="big")
    with pytest.raises(R2RError, match="target LLM rate"):
        Request([1, 2], target_rate=1.5)
    with pytest.raises(R2RError, match="verify takes off, strict or a tolerance"):
        Request([1, 2], verify="sometimes")
    with pytest.raises(R2RError, match="max unverified"):
        Request([1, 2], max_unverified=0)
    request = Request([1, 2, 3], SamplingParams(max_new_tokens=4), verify="0.5")
    assert request.verify.value == 0.5 and request.prompt_ids == (1, 2, 3)  # parsed once, when made
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.verify = "off"
    plain = Request([1, 2, 3])
    sequence = engine.sequence(plain)
    assert sequence.verify.value == 1.0 and plain.verify is None  # the sequence has the engine's default
    engine.run([plain])
    assert plain == Request([1, 2, 3])


def test_at_most_max_batch_sequences_run_and_each_leaves_once(engine):
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    alone = engine.generate([engine.prompts.chat(p) for p in PROMPTS], params)
    scheduler = engine.scheduler(max_batch=2)
    sequences = [engine.sequence(Request(engine.prompts.chat(p), params), i) for i, p in enumerate(PROMPTS)]
    for s in sequences:
        scheduler.add(s)
    events, most = [], 0
    while not scheduler.idle:
        events += scheduler.turn()
        most = max(most, scheduler.admitted)
    assert most == 2
    last = [e.sequence.index for e in events if isinstance(e, Step) and e.finished]
    assert sorted(last) == [0, 1, 2, 3] and not [e for e in events if isinstance(e, Failure)]
    assert [s.generation.token_ids for s in sequences] == [g.token_ids for g in alone]
    assert scheduler.kv_in_use == 0


@pytest.mark.parametrize("by_priority", [False, True])
def test_waiting_sequences_are_admitted_by_arrival_or_by_priority(engine, by_priority):
    """First come first served; with `by_priority`, the lowest priority first and arrival order among equals (vLLM's
    order): the running one is preempted for the more urgent newcomer, and goes back ahead of those as urgent that
    came after it."""
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    priorities = [0, 5, -1, 5, 0]
    scheduler = engine.scheduler(max_batch=1, by_priority=by_priority)
    first = engine.sequence(Request(engine.prompts.raw("running"), params), 9)
    scheduler.add(first)
    scheduler.turn()  # it runs; then the others arrive
    for i, priority in enumerate(priorities):
        scheduler.add(engine.sequence(Request(engine.prompts.raw(f"prompt {i}"), params, priority=priority), i))
    done = [e.sequence.index for e in drive(scheduler) if isinstance(e, Step) and e.finished]
    assert done == ([2, 9, 0, 4, 1, 3] if by_priority else [9, 0, 1, 2, 3, 4])
    assert engine.counters.preemptions == by_priority


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("prefix_tokens", [0, 4096])
def test_a_more_urgent_request_preempts_a_running_one_which_resumes_as_if_never_stopped(kind_pair, tokenizer, overlap,
                                                                                       prefix_tokens):
    """Priority scheduling with one slot: a request more urgent than the running one takes the slot at the next turn.
    The preempted one waits, then reads its prompt and shown output again (from what each model kept of them, with
    prefix caching) and goes on. Each answers as it would alone (strict verification: the LLM's own), and a stream
    of the preempted one shows each of its tokens once."""
    slm, llm = kind_pair
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.4, seed=1), verify="strict", overlap=overlap)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    prompts = [engine.prompts.raw(t) for t in ("A long answer about the bridges of Paris, please.", "Quick: 2+2?")]
    scheduler = engine.scheduler(max_batch=1, prefill_chunk=8, prefix_tokens=prefix_tokens, by_priority=True)
    running, urgent = (engine.sequence(Request(p, params, priority=priority), i)
                       for i, (p, priority) in enumerate(zip(prompts, (5, -1))))
    scheduler.add(running)
    events = []
    while running.checks.final < 3 or len(running.generation.token_ids) == running.checks.final:  # (some unchecked)
        events += scheduler.turn()
    shown = running.checks.final
    scheduler.add(urgent)
    events += scheduler.turn()
    assert running.preemptions == 1 and engine.counters.preemptions == 1
    assert list(scheduler.waiting) == [running] and scheduler.admitted == 1
    assert len(running.generation.token_ids) == shown  # what awaited the LLM's word is written again later
    hits = engine.counters.prefix_hits
    events += drive(scheduler)
    assert not [e.error for e in events if isinstance(e, Failure)]
    assert [e.sequence.index for e in events if isinstance(e, Step) and e.finished] == [1, 0]
    expected = [g.token_ids for g in Engine(slm, llm, tokenizer, AlwaysLLM()).generate(prompts, params)]
    assert [running.generation.token_ids, urgent.generation.token_ids] == expected
    stream = [token for e in events if isinstance(e, Step) and e.sequence is running for token, _, _ in e.final]
    assert stream == expected[0]
    # The resumed read started from what each model kept of the preempted row (the LLM's: what it had caught up on)
    assert engine.counters.prefix_hits - hits >= (len(prompts[0]) - 1 if prefix_tokens else 0)
    assert scheduler.kv_in_use == 0 and running.generation.cached_tokens == 0


def test_preemption_takes_the_least_urgent_and_only_for_a_more_urgent_newcomer(engine):
    """Two slots, sequences of priority 0 and 3 running: a newcomer of priority 3 waits (no more urgent than
    either), one of 1 preempts the 3 (the least urgent; among equals, the latest to arrive), and the preempted one
    resumes before the other 3, which came after it. First come first served preempts nothing."""
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    for by_priority, order in ((True, [0, 3, 1, 2]), (False, [0, 1, 2, 3])):
        scheduler = engine.scheduler(max_batch=2, by_priority=by_priority)
        before = engine.counters.preemptions
        sequences = [engine.sequence(Request(engine.prompts.raw(f"prompt {i}"), params, priority=priority), i)
                     for i, priority in enumerate((0, 3, 3, 1))]
        scheduler.add(sequences[0])
        scheduler.add(sequences[1])
        events = scheduler.turn()
        scheduler.add(sequences[2])
        events += scheduler.turn()
        assert engine.counters.preemptions == before and scheduler.waiting[0] is sequences[2]
        scheduler.add(sequences[3])
        events += drive(scheduler)
        assert [s.preemptions for s in sequences] == [0, by_priority, 0, 0]
        finished = [e.sequence.index for e in events if isinstance(e, Step) and e.finished]
        assert finished == order
        assert all(len(s.generation.token_ids) == 4 for s in sequences)


def test_admission_waits_for_kv_room_and_refuses_what_can_never_fit(slm, llm, tokenizer):
    engine = Engine(slm, llm, tokenizer, AlwaysLLM())
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompts = [engine.prompts.chat(p) for p in PROMPTS[:3]]
    alone = engine.generate(prompts, params)
    engine.kv_capacity = max(len(p) for p in prompts) + 8  # room for one sequence at a time
    scheduler = engine.scheduler()
    sequences = [engine.sequence(Request(p, params), i) for i, p in enumerate(prompts)]
    for s in sequences:
        scheduler.add(s)
    while not scheduler.idle:
        scheduler.turn()
        assert scheduler.admitted <= 1 and scheduler.kv_in_use <= engine.kv_capacity
    assert [s.generation.token_ids for s in sequences] == [g.token_ids for g in alone]
    too_long = Request(prompts[0], SamplingParams(max_new_tokens=engine.kv_capacity))
    room = engine.kv_capacity - len(prompts[0])
    with pytest.raises(R2RError, match=f"the KV cache holds: ask for at most {room} new tokens"):
        engine.run([too_long])
    # Where the prompt alone is too long, fewer new tokens would not help: the advice is to shorten it.
    engine.kv_capacity = len(prompts[0]) - 1
    with pytest.raises(R2RError, match=f"shorten the prompt \\({len(prompts[0])} tokens\\)"):
        engine.run([Request(prompts[0], SamplingParams(max_new_tokens=1))])


def test_a_request_past_the_models_context_is_refused_with_what_to_cut(slm, llm, tokenizer):
    """Past their trained context a model's positions mean nothing, and torch would run on without a word: a request
    that needs more tokens than the models read is refused as one past the KV cache is, whatever the cache holds."""
    engine = Engine(slm, llm, tokenizer, AlwaysLLM())
    assert engine.kv_capacity is None and engine.max_context == 512  # the tiny models' trained context
    prompt = engine.prompts.chat(PROMPTS[0])
    engine.max_context = len(prompt) + 4
    fits = engine.run([Request(prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))])[0]
    assert len(fits.token_ids) == 4
    with pytest.raises(R2RError, match="the models read at most \\(their context length\\): ask for at most 4 new "
                                       "tokens"):
        engine.run([Request(prompt, SamplingParams(max_new_tokens=5))])
    engine.kv_capacity = len(prompt) + 2  # the smaller bound is the one named
    with pytest.raises(R2RError, match="the KV cache holds: ask for at most 2 new tokens"):
        engine.run([Request(prompt, SamplingParams(max_new_tokens=5))])


def test_cancelled_sequences_leave_with_a_failure_waiting_or_running(engine):
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    scheduler = engine.scheduler(max_batch=1, prefill_chunk=4)
    running, waiting = (engine.sequence(Request(engine.prompts.chat(p), params)) for p in PROMPTS[:2])
    scheduler.add(running)
    scheduler.add(waiting)
    for _ in range(8):
        scheduler.turn()
    assert running.generation.token_ids and not waiting.generation.token_ids
    running.cancelled = waiting.cancelled = True
    events = drive(scheduler)
    assert {id(e.sequence) for e in events} == {id(running), id(waiting)}
    assert all(isinstance(e, Failure) and isinstance(e.error, Cancelled) for e in events)
    assert scheduler.kv_in_use == 0


def test_cut_and_drop_waiting_fail_every_sequence_they_hold(engine):
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    scheduler = engine.scheduler(max_batch=2, prefill_chunk=8)
    sequences = [engine.sequence(Request(engine.prompts.chat(p), params)) for p in PROMPTS[:3]]
    for s in sequences:
        scheduler.add(s)
    scheduler.turn()
    stop = R2RError("stopping")
    dropped = scheduler.drop_waiting(stop)
    cut = scheduler.cut(stop)
    assert [e.sequence for e in dropped] == sequences[2:]
    assert {id(e.sequence) for e in cut} == {id(s) for s in sequences[:2]}
    assert all(e.error is stop for e in dropped + cut)
    assert scheduler.idle and scheduler.kv_in_use == 0


def test_a_draining_server_lets_preempted_sequences_finish_and_its_deadline_cuts_them(engine):
    """A server that stops admitting drops the sequences waiting to start, not a preempted one (in flight for its
    client: it finishes as the admitted ones do); the drain deadline cuts it with them."""
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    stop = R2RError("stopping")
    for deadline in (False, True):
        scheduler = engine.scheduler(max_batch=1, by_priority=True)
        running, urgent, late = (engine.sequence(Request(engine.prompts.raw(f"prompt {i}"), params, priority=p))
                                 for i, p in enumerate((5, 0, 1)))
        scheduler.add(running)
        scheduler.turn()
        scheduler.add(urgent)
        scheduler.add(late)
        scheduler.turn()  # the urgent one preempts the running one
        assert running.preemptions == 1 and list(scheduler.waiting) == [late, running]
        assert [e.sequence for e in scheduler.drop_waiting(stop)] == [late]
        if deadline:
            cut = scheduler.cut(stop)
            assert {id(e.sequence) for e in cut} == {id(urgent), id(running)} and scheduler.idle
        else:
            events = drive(scheduler)
            assert [e.sequence for e in events if isinstance(e, Step) and e.finished] == [urgent, running]
            assert len(running.generation.token_ids) == 20
        assert scheduler.kv_in_use == 0


def test_an_error_in_a_step_fails_the_sequences_in_it_and_the_scheduler_goes_on(engine, monkeypatch):
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    scheduler = engine.scheduler()
    first = engine.sequence(Request(engine.prompts.chat(PROMPTS[0]), params))
    scheduler.add(first)
    scheduler.turn()
    forward = engine.writer.forward
    monkeypatch.setattr(engine.writer, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    events = scheduler.turn()
    assert [(e.sequence, str(e.error)) for e in events] == [(first, "boom")]
    monkeypatch.setattr(engine.writer, "forward", forward)
    second = engine.sequence(Request(engine.prompts.chat(PROMPTS[1]), params))
    scheduler.add(second)
    events = drive(scheduler)
    assert all(isinstance(e, Step) and e.sequence is second for e in events) and events[-1].finished
    assert len(second.generation.token_ids) == 5
    with pytest.raises(RuntimeError, match="boom"):  # an offline run raises the error itself
        monkeypatch.setattr(engine.writer, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
        engine.run([Request([1, 2, 3], params)])


@pytest.mark.skipif(not HAS_LLAMA, reason="llama-cpp-python is not installed")
def test_a_failed_step_or_read_gives_its_llamacpp_sequences_back_at_once(tokenizer, llm, tmp_path, monkeypatch):
    """llama.cpp holds a fixed number of sequences. A request that fails (its LLM call, its prompt's read, its
    joining) gives its rows back then, not when the garbage collector gets to the failure's traceback, which
    keeps the batch and its caches: with the collector off, two requests still find two sequences free."""
    save_gguf(tiny_model(tokenizer, hidden=32, seed=0), tokenizer, tmp_path / "slm.gguf")
    slm = tiny_llamacpp(tmp_path / "slm.gguf", name="tiny-slm", n_ctx=1024, max_rows=2, vocab_size=len(tokenizer))
    engine = Engine(slm, llm, tokenizer, RandomPolicy(1.0, seed=0), verify="off")  # the SLM reads, the LLM writes
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    prompts = [engine.prompts.chat(p) for p in PROMPTS[:2]]
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]

    def run_two(failing: tuple | None):
        """Two requests at once; `failing`: (backend, method, n) makes that method's n-th call fail."""
        scheduler = engine.scheduler(prefill_chunk=8)
        sequences = [engine.sequence(Request(p, params)) for p in prompts]
        if failing is not None:
            backend, name, n = failing
            method, calls = getattr(backend, name), []

            def broken(*args, **kwargs):
                calls.append(1)
                if len(calls) == n:
                    raise RuntimeError("boom")
                return method(*args, **kwargs)

            monkeypatch.setattr(backend, name, broken)
        for s in sequences:
            scheduler.add(s)
        events = drive(scheduler)
        monkeypatch.undo()
        return sequences, events

    gc.disable()
    try:
        # The LLM's call in a step; the SLM's reads of a prompt's chunks and of a newcomer joining the batch.
        for failing in [(llm, "forward", 1), (slm, "read", 2), (slm, "read", 4), (slm, "read", 5)]:
            _, events = run_two(failing)
            assert any(isinstance(e, Failure) for e in events), failing
            sequences, events = run_two(None)  # both sequences free again
            assert [s.generation.token_ids for s in sequences] == alone, failing
    finally:
        gc.enable()


def test_an_offline_run_of_more_requests_than_the_backend_holds_queues_them(slm, llm, tokenizer, monkeypatch):
    engine = Engine(slm, llm, tokenizer, AlwaysLLM())
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompts = [engine.prompts.chat(p) for p in PROMPTS]
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]
    engine.max_rows = 2
    admitted = Scheduler.admit

    def at_most_two(self):
        left = admitted(self)
        assert self.admitted <= 2
        return left

    monkeypatch.setattr(Scheduler, "admit", at_most_two)
    assert [g.token_ids for g in engine.generate(prompts, params)] == alone


@pytest.mark.parametrize("overlap", [False, True])
def test_a_longer_prompt_joins_a_batch_whose_llm_has_read_nothing_yet(kind_pair, tokenizer, overlap):
    """A one-token prompt decodes while a longer one is read in chunks; when the longer one joins, the batch widens
    (padding on the left) while the LLM's cache is still empty. Padding an empty cache leaves it empty in every
    backend and in the LLM's queue alike, so the newcomer's caches fit: each answer is the one it gets alone."""
    slm, llm = kind_pair
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.0, seed=0), overlap=overlap)  # routes nothing
    prompts = [engine.prompts.raw("0"), engine.prompts.raw("0\u00d6 and more")]
    params = SamplingParams(max_new_tokens=6)
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]
    scheduler = engine.scheduler(4, prefill_chunk=2)
    sequences = [engine.sequence(Request(p, params)) for p in prompts]
    for s in sequences:
        scheduler.add(s)
    events = drive(scheduler)
    assert not [e.error for e in events if isinstance(e, Failure)]
    assert [s.generation.token_ids for s in sequences] == alone


def longest_rows_handed(model, monkeypatch) -> list[int]:
    """Each read's longest row, padding left out, as the model is handed them from now on."""
    read = []

    def spying(original):
        def spy(cache, new_ids, attention_mask, *args, **kwargs):
            read.append(int(attention_mask.sum(-1).max()))
            return original(cache, new_ids, attention_mask, *args, **kwargs)
        return spy

    for name in ("read", "forward", "forward_all"):
        monkeypatch.setattr(model, name, spying(getattr(model, name)))
    return read


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("prefill_chunk", [None, 3])
def test_the_llm_never_reads_a_request_forced_onto_the_slm(kind_pair, tokenizer, overlap, prefill_chunk, monkeypatch):
    """A request forced onto the SLM, unverified, costs the SLM alone: the LLM reads neither its prompt nor its
    tokens, between whichever rows it sits, while the other rows are routed, checked, rolled back, leave (all of
    the LLM's at once, once) and join. Strict verification makes each routed row's answer the LLM's own."""
    slm, llm = kind_pair
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.4, seed=1), verify="strict", overlap=overlap)
    long, short = engine.prompts.raw("a prompt only the SLM reads, " * 4), engine.prompts.raw("Count to five.")
    requests = [Request(long, SamplingParams(max_new_tokens=14), force="slm"),
                Request(short, SamplingParams(max_new_tokens=4)),
                Request(long[3:], SamplingParams(max_new_tokens=6), force="slm"),
                Request(short[1:], SamplingParams(max_new_tokens=5)),
                Request(short, SamplingParams(max_new_tokens=3))]
    most = len(short) + 5  # the most real tokens a routed row has
    assert len(long) - 3 > most
    alone = [Engine(slm, llm, tokenizer, AlwaysSLM() if r.force else AlwaysLLM()).generate(
        [r.prompt_ids], r.params)[0].token_ids for r in requests]
    read = longest_rows_handed(llm, monkeypatch)
    scheduler = engine.scheduler(3, prefill_chunk=prefill_chunk)
    sequences = [engine.sequence(r) for r in requests]
    assert [s.uses_llm for s in sequences] == [False, True, False, True, True]
    for s in sequences:
        scheduler.add(s)
    events = drive(scheduler)
    assert not [e.error for e in events if isinstance(e, Failure)]
    assert [s.generation.token_ids for s in sequences] == alone
    assert read and max(read) <= most
    assert all(set(s.generation.sources) == {"slm"} for s in sequences[::2][:2])


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("prefill_chunk", [None, 3])
def test_the_slm_never_reads_a_request_forced_onto_the_llm(kind_pair, tokenizer, prefill_chunk, overlap,
                                                           monkeypatch):
    """"LLM alone" through a pair's scheduler costs the LLM alone, the prompt included, alone and beside routed
    rows that join, leave and roll back: the SLM reads and proposes for the routed rows only, the policy looks at
    those alone, and each answer is the one it gets alone."""
    slm, llm = kind_pair
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.4, seed=1), verify="strict", overlap=overlap)
    prompt = engine.prompts.raw("Count to five, then back.")
    requests = [Request(prompt, SamplingParams(max_new_tokens=14), force="llm"),
                Request(prompt[2:], SamplingParams(max_new_tokens=5)),
                Request(prompt[1:], SamplingParams(max_new_tokens=4), force="llm"),
                Request(prompt[3:], SamplingParams(max_new_tokens=4))]
    alone = [Engine(slm, llm, tokenizer, AlwaysLLM()).generate([r.prompt_ids], r.params)[0].token_ids
             for r in requests]  # (strict: the routed answer is the LLM's own)
    most = len(prompt) + 3  # the most real tokens a routed row has: the forced ones outgrow it beside them
    read = longest_rows_handed(slm, monkeypatch)
    routed_rows, route = [], engine.policy.route
    monkeypatch.setattr(engine.policy, "route",
                        lambda logits, *a: (routed_rows.append(len(logits)), route(logits, *a))[1])
    scheduler = engine.scheduler(3, prefill_chunk=prefill_chunk)
    sequences = [engine.sequence(r) for r in requests]
    scheduler.add(sequences[0])
    events = []
    while len(sequences[0].generation.token_ids) < 3:
        events += scheduler.turn()
    assert not read and not routed_rows  # the SLM has not run, nor has the policy
    for s in sequences[1:]:
        scheduler.add(s)
    events += drive(scheduler)
    assert not [e.error for e in events if isinstance(e, Failure)]
    assert [s.generation.token_ids for s in sequences] == alone
    assert read and max(read) <= most
    assert routed_rows and max(routed_rows) <= 2  # the policy looks at the routed rows alone
