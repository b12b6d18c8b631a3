"""The two models at once (--overlap): the LLM's calls run on a thread of their own while the SLM goes on writing.

On every backend, under greedy decoding, every request gets exactly the tokens it gets with the calls in the step
(lockstep or grouped), however late the LLM answers: batched, alone, with rows joining and leaving while a call is
in flight (on llama.cpp, whose chunked prompt reads round otherwise, up to a near-tie of the LLM's two best
tokens); strict verification is still the LLM's own output; a stream shows only tokens that stay. A stalled LLM holds
only the rows that wait for it, and a failed one fails only those."""

import threading
import time

import pytest
from conftest import ENGINE_LOGIC_BACKENDS, kind_fixture
from helpers import assert_stream_shows_only_tokens_that_stay, llm_greedy_reference, make_checkpoint

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.llm_calls import Deferral, Worker, resolve_overlap
from roads_to_rome.core.request import Failure, Request
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.errors import LLMUnavailable, R2RError
from roads_to_rome.routing.policies import AlwaysSLM, EntropyPolicy, NeuralPolicy

kind = kind_fixture(ENGINE_LOGIC_BACKENDS)  # (conftest.ENGINE_LOGIC_BACKENDS: why not torch-static)

PROMPTS = ["What is 48 / 2?", "def add(a, b):", "Bonjour! Paris is the capital of which country? Explain.",
           "Natalia sold clips to 48 of her friends in April."]
N_TOKENS = 24


class SlowLLM:
    """A backend whose catch-ups take `delay` seconds longer (a server far away), or wait for `gate` to open, or
    fail with `LLMUnavailable` once `fail` is set: everything else is the wrapped backend's."""

    def __init__(self, backend, delay: float = 0.0):
        self.backend, self.delay = backend, delay
        self.gate, self.fail, self.calls = threading.Event(), False, 0
        self.gate.set()

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def _wait(self):
        self.calls += 1
        self.gate.wait()
        time.sleep(self.delay)
        if self.fail:
            raise LLMUnavailable("the LLM server at http://test is unavailable (stopped)", "http://test")

    def forward(self, *args):
        self._wait()
        return self.backend.forward(*args)

    def forward_all(self, *args):
        self._wait()
        return self.backend.forward_all(*args)


def late_worker(monkeypatch, seconds: float) -> None:
    """Every operation the LLM's worker runs starts `seconds` late: what it has queued is still to run when the
    batch's last turn is over."""
    submit = Worker.submit

    def late(self, fn, *args):
        def slowly(*a):
            time.sleep(seconds)
            return fn(*a)
        return submit(self, slowly, *args)

    monkeypatch.setattr(Worker, "submit", late)


def outputs(gens):
    return [(g.token_ids, g.sources) for g in gens]


def test_overlap_gives_every_row_the_tokens_of_the_calls_in_the_step(kind_pair, tokenizer):
    slm, llm = kind_pair
    params = SamplingParams(max_new_tokens=N_TOKENS)
    policies = {"router": NeuralPolicy(make_checkpoint(slm), slm.embed, threshold=0.5),
                "entropy": EntropyPolicy(3.0)}
    in_flight_steps = 0
    for name, policy in policies.items():
        for verify in ("off", 1.0, "strict"):
            for mode in ("off", "continue", "park"):
                rule = Deferral(mode, group=0.75, steps=4)
                reference = Engine(slm, llm, tokenizer, policy, verify=verify, defer=rule)
                prompts = [reference.prompts.chat(p) for p in PROMPTS]
                expected = outputs(reference.generate(prompts, params))
                for delay in (0.0, 0.01):
                    slow = SlowLLM(llm, delay)
                    engine = Engine(slm, slow, tokenizer, policy, verify=verify, defer=rule, overlap=True)
                    assert engine.overlap
                    gens = engine.generate(prompts, params)
                    assert outputs(gens) == expected, (name, verify, mode, delay)
                    if delay:  # (rows alone where each call is still in flight after a step: the harder case)
                        assert outputs([engine.generate([p], params)[0] for p in prompts]) == expected
                    in_flight_steps += engine.counters.steps - engine.counters.llm_calls
    assert in_flight_steps > 0


# (llama.cpp) How close the LLM's two best tokens may be, in nats, where a prompt read in chunks may pick the other
# one: its batch kernels sum in another order than one row's, which moves logits by float32 rounding, far below this.
NEAR_TIE = 1e-3


def test_rows_join_leave_and_stand_still_while_a_call_is_in_flight(kind, kind_pair, tokenizer):
    """Requests of different lengths arrive one per turn and their prompts are read in chunks while the LLM is slow.
    On torch each ends with the tokens it gets alone in lockstep. llama.cpp reads a prompt in chunks with other
    kernels than whole (its logits differ in the last bits, with or without overlap), so there strict verification
    runs, and each output is the LLM's own greedy one, read alone and whole, up to its first near-tie: a token that
    differs must be the LLM's runner-up there, within NEAR_TIE nats of its best, and nothing after it is compared."""
    slm, llm = kind_pair
    policy, exact = EntropyPolicy(3.0), kind != "llamacpp"
    reference = Engine(slm, llm, tokenizer, policy, verify=1.0) if exact else Engine.alone(llm, tokenizer)
    requests = [Request(reference.prompts.chat(p + " " * i),
                        SamplingParams(max_new_tokens=8 + 5 * i, logprobs=None if exact else 2))
                for i, p in enumerate(PROMPTS * 2)]
    expected = [reference.run([r])[0] for r in requests]
    engine = Engine(slm, SlowLLM(llm, 0.02), tokenizer, policy, verify=1.0 if exact else "strict", overlap=True)
    scheduler = engine.scheduler(max_batch=4, prefill_chunk=7)
    got, arrivals, held = {}, list(enumerate(requests)), 0
    while arrivals or not scheduler.idle:
        if arrivals:
            i, request = arrivals.pop(0)
            scheduler.add(engine.sequence(request, i))
        before = {id(s): len(s.generation.token_ids) for s in scheduler.batch.sequences}
        for event in scheduler.turn():
            assert not isinstance(event, Failure), event.error
            if event.finished:
                got[event.sequence.index] = event.sequence.generation
        held += sum(len(s.generation.token_ids) == before.get(id(s), -1) for s in scheduler.batch.sequences)
    if exact:
        assert outputs([got[i] for i in range(len(requests))]) == outputs(expected)
    else:
        near_ties = [first_difference_is_a_near_tie(got[i].token_ids, expected[i]) for i in range(len(requests))]
        print("llama.cpp, first differences' gaps (None: the same tokens):", near_ties)
        assert near_ties.count(None) >= len(requests) // 2, near_ties  # (most agree to the last token)
    assert held > 0  # some row waited, standing still, for the LLM to check where it ends


def first_difference_is_a_near_tie(tokens: list[int], reference) -> float | None:
    """None where `tokens` are the reference generation's; else the gap between the LLM's two best tokens where they
    first differ, asserted below NEAR_TIE with `tokens` taking the runner-up there."""
    k = next((k for k, (a, b) in enumerate(zip(tokens, reference.token_ids)) if a != b), None)
    if k is None:
        assert len(tokens) == len(reference.token_ids), (tokens, reference.token_ids)
        return None
    (best, best_lp), (second, second_lp) = reference.logprobs[k].top[:2]
    assert best == reference.token_ids[k] and tokens[k] == second and best_lp - second_lp < NEAR_TIE, (
        f"output {k}: wrote {tokens[k]}, the LLM alone {best} ({best_lp:.6f}), runner-up {second} ({second_lp:.6f})")
    return best_lp - second_lp


def test_strict_verification_with_overlap_is_the_llms_greedy_output(kind_pair, tokenizer):
    slm, llm = kind_pair
    prompts, params, expected = llm_greedy_reference(llm, tokenizer, PROMPTS, N_TOKENS)
    for n in (2, None):
        engine = Engine(slm, SlowLLM(llm, 0.01), tokenizer, EntropyPolicy(3.0), verify="strict", max_unverified=n,
                        overlap=True)
        assert [g.token_ids for g in engine.generate(prompts, params)] == expected, n
    for drafts in (EntropyPolicy(1e9), AlwaysSLM()):  # the SLM alone drafts: speculative decoding, the next drafts
        spec = Engine(slm, SlowLLM(llm, 0.01), tokenizer, drafts, verify="strict", max_unverified=4,
                      overlap=True)  # written while the LLM checks
        assert [g.token_ids for g in spec.generate(prompts, params)] == expected, drafts.name


def test_a_stream_with_overlap_shows_only_tokens_that_stay(kind_pair, tokenizer):
    slm, llm = kind_pair
    engine = Engine(slm, SlowLLM(llm, 0.01), tokenizer, EntropyPolicy(3.0), overlap=True)
    results = assert_stream_shows_only_tokens_that_stay(engine, [engine.prompts.chat(p) for p in PROMPTS], N_TOKENS)
    assert sum(g.deferred_replaced for g in results) > 0


def test_a_run_with_overlap_returns_with_the_llms_rows_given_back(kind_pair, tokenizer, monkeypatch):
    """`Engine.run` returns once what its LLM's worker queued has run: another engine on the same llama.cpp backend
    (whose sequences are the backend's, not an engine's) finds every one free, however late the worker is."""
    slm, llm = kind_pair
    if llm.max_rows is None:
        pytest.skip("only a backend with a fixed number of rows can run out of them")
    late_worker(monkeypatch, 0.02)
    engine = Engine(slm, llm, tokenizer, EntropyPolicy(3.0), overlap=True)
    prompts, params = [engine.prompts.chat(p) for p in PROMPTS * 2], SamplingParams(max_new_tokens=4)
    assert len(prompts) == llm.max_rows  # every sequence the backend has
    engine.generate(prompts, params)
    assert len(Engine.alone(llm, tokenizer).generate(prompts, params)) == len(prompts)


def test_two_engines_on_one_llamacpp_backend_never_call_it_at_once(kind, kind_pair, tokenizer, monkeypatch):
    """An engine driven by its own scheduler (a server's) leaves its LLM's worker giving rows back after its last
    turn; another engine on the same llama.cpp backend that reads meanwhile takes turns with it: a llama.cpp context
    is not thread-safe (two threads in it at once aborted the process)."""
    if kind != "llamacpp":
        pytest.skip("a torch model is read by several threads at once safely")
    from roads_to_rome.backends import llamacpp

    slm, llm = kind_pair
    inside, most, guard = [0], [0], threading.Lock()

    def counted(name):
        native = getattr(llamacpp.llama_cpp, name)

        def call(handle, *args):
            if handle is not llm._ctx and handle is not llm._memory:  # (the SLM's context is another)
                return native(handle, *args)
            with guard:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.002)
            try:
                return native(handle, *args)
            finally:
                with guard:
                    inside[0] -= 1
        return call

    for name in ("llama_decode", "llama_memory_seq_rm", "llama_memory_seq_cp"):
        monkeypatch.setattr(llamacpp.llama_cpp, name, counted(name))
    late_worker(monkeypatch, 0.01)
    engine = Engine(slm, llm, tokenizer, EntropyPolicy(3.0), overlap=True)
    prompts, params = [engine.prompts.chat(p) for p in PROMPTS], SamplingParams(max_new_tokens=6)
    scheduler = engine.scheduler(4)
    for i, p in enumerate(prompts):
        scheduler.add(engine.sequence(Request(p, params), i))
    while not scheduler.idle:
        assert not [e for e in scheduler.turn() if isinstance(e, Failure)]
    Engine.alone(llm, tokenizer).generate(prompts, params)  # while the worker gives the rows back
    engine.llm_side.wait_idle()
    assert most[0] == 1


def test_a_stalled_llm_holds_only_the_rows_that_wait_for_it_and_a_failed_one_fails_only_them(slm, llm, tokenizer):
    slow = SlowLLM(llm)
    engine = Engine(slm, slow, tokenizer, EntropyPolicy(0.5), verify=1.0, overlap=True)
    alone = Engine.alone(slm, tokenizer, "slm")
    prompt = engine.prompts.chat("What is 48 / 2?")
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    slm_only = alone.generate([prompt], params)[0].token_ids
    for failing in (False, True):
        slow.gate.clear()  # the LLM stops answering
        scheduler = engine.scheduler()
        routed = engine.sequence(Request(prompt, params), 0)
        own = engine.sequence(Request(prompt, params, force="slm"), 1)
        scheduler.add(routed)
        scheduler.add(own)
        events = []
        while not any(e.sequence is own and e.finished for e in events):
            events += scheduler.turn()
        assert own.generation.token_ids == slm_only  # written to the end while the LLM said nothing
        assert routed in scheduler.batch.sequences and slow.calls >= 1  # ... while the routed row waits
        slow.fail = failing
        slow.gate.set()
        while not scheduler.idle:
            events += scheduler.turn()
        failures = [e for e in events if isinstance(e, Failure)]
        if failing:
            assert [f.sequence for f in failures] == [routed] and isinstance(failures[0].error, LLMUnavailable)
        else:
            assert not failures and routed.generation.finish_reason == "length"
            lockstep = Engine(slm, llm, tokenizer, EntropyPolicy(0.5), verify=1.0)
            assert routed.generation.token_ids == lockstep.generate([prompt], params)[0].token_ids
        slow.fail = False


def test_where_overlap_is_on_by_default(slm, llm):
    from types import SimpleNamespace

    import torch

    here = torch.device("cpu")
    remote = SimpleNamespace(remote=True, device=here)
    assert resolve_overlap("auto", slm, remote) and not resolve_overlap("auto", slm, llm)
    assert resolve_overlap("auto", slm, SimpleNamespace(remote=False, device=torch.device("cuda", 1)))
    assert resolve_overlap("on", slm, llm) and not resolve_overlap("off", slm, remote)
    assert not resolve_overlap("on", slm, None)  # one model: nothing to overlap
    with pytest.raises(R2RError, match="overlap takes off, on, auto"):
        resolve_overlap("sometimes", slm, llm)


def test_settings_per_role_are_parsed_once_at_the_engine_config():
    from roads_to_rome.models.loading import EngineConfig, parse_devices, parse_threads

    assert parse_devices("slm=cuda:0,llm=cuda:1") == {"slm": "cuda:0", "llm": "cuda:1"}
    assert parse_devices("cpu") == {"slm": "cpu", "llm": "cpu"} and parse_devices("llm=cpu")["slm"] == "auto"
    assert parse_threads("slm=1,llm=1") == {"slm": 1, "llm": 1} and parse_threads(2) == {"slm": 2, "llm": 2}
    assert parse_threads(None) == {}
    config = EngineConfig(verify="1.5", overlap=True, threads="llm=3")
    assert (config.verify.value, config.overlap, config.threads) == (1.5, "on", {"llm": 3})
    for bad, message in ((dict(device="slm=tpu"), "bad --device"), (dict(threads="slm=0"), "bad --threads"),
                         (dict(threads="gpu=1"), "bad --threads"), (dict(overlap="maybe"), "overlap takes"),
                         (dict(defer="later"), "defer takes"), (dict(verify="lots"), "verify")):
        with pytest.raises(R2RError, match=message):
            EngineConfig(**bad) if "device" not in bad else parse_devices(bad["device"])


def in_turn(first, second, inside: threading.Event, release: threading.Event, events: list) -> list:
    """`first` on a thread until it is inside the gate (`inside`), then `second` on another, then `release` lets
    `first` go on: the events of the time in between."""
    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    threads[0].start()
    inside.wait(5)
    threads[1].start()
    time.sleep(0.05)
    before = list(events)
    release.set()
    for t in threads:
        t.join(5)
    return before


def test_a_graph_capture_runs_alone_among_the_threads_that_read():
    """With overlap two threads drive one GPU: a capture (from inside its own thread's read, as a first read of a
    size records one) waits for the other thread's read to end, holds the other's next read back until it is done,
    and two threads that both capture from inside their reads take turns instead of waiting on each other."""
    from roads_to_rome.backends.cuda_graphs import CaptureGate

    gate, events = CaptureGate(), []
    reading, release = threading.Event(), threading.Event()

    def reader():
        with gate.reading():
            events.append("read starts")
            reading.set()
            release.wait(5)
            events.append("read ends")

    def capturer():
        with gate.reading(), gate.capturing():
            events.append("capture")

    assert in_turn(reader, capturer, reading, release, events) == ["read starts"]
    assert events == ["read starts", "read ends", "capture"]

    events.clear()
    capturing, done = threading.Event(), threading.Event()

    def long_capture():
        with gate.capturing():
            capturing.set()
            done.wait(5)
            events.append("capture ends")

    def read():
        with gate.reading():
            events.append("read")

    assert in_turn(long_capture, read, capturing, done, events) == []
    assert events == ["capture ends", "read"]

    both, order = threading.Barrier(2), []

    def read_then_capture():
        with gate.reading():
            both.wait(5)
            with gate.capturing():
                order.append(threading.get_ident())

    threads = [threading.Thread(target=read_then_capture) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads) and len(set(order)) == 2
