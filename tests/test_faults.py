"""Faults of a remote LLM under `r2r serve`, on loopback with llama.cpp's own server (it starts in about a second):
killed in the middle of streams and back within the retry budget, away for longer, stalled (SIGSTOP) briefly and
for longer. Every request either finishes with the answer it gives on a healthy server or fails with the LLM-away
error (a 503 with Retry-After, or an error event and [DONE] in a stream, with the tokens sent so far); none hangs;
requests forced to the SLM run throughout; `/health` answers throughout, `degraded` while the LLM is away; and
serving resumes by itself when it is back."""

import concurrent.futures
import json
import os
import signal
import threading
import time

import httpx
import pytest
from conftest import LlamaServer
from helpers import NEEDS_LLAMA_SERVER, REMOTE_PROMPTS, remote

from roads_to_rome.backends.remote import STALLED_AFTER_S
from roads_to_rome.core.engine import Engine
from roads_to_rome.routing.policies import EntropyPolicy
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.limits import Limits
from roads_to_rome.serving.server import create_app

pytestmark = pytest.mark.timed

RETRY, TIMEOUT = 8.0, 3.0  # the remote backend's budget and per-call timeout in this test
CLIENT_TIMEOUT = 60.0  # a request that takes longer than this has hung
LONG = REMOTE_PROMPTS[:2]  # prompts whose answers run to max_tokens here: still streaming when the LLM is disturbed


def chat(url: str, prompt: str, stream: bool, policy: str | None = None, started: threading.Event | None = None):
    """One request's outcome: ("ok", text) or ("llm_unavailable", the error); anything else fails the test.
    `started` is set at the stream's first line (or when the request ends without one)."""
    try:
        return request(url, prompt, stream, policy, started)
    finally:
        if started is not None:
            started.set()


def request(url: str, prompt: str, stream: bool, policy: str | None, started: threading.Event | None):
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 300, "temperature": 0, "stream": stream,
            **({"r2r_policy": policy} if policy else {})}
    if not stream:
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT)
        if reply.status_code == 200:
            return "ok", reply.json()["choices"][0]["message"]["content"]
        error = reply.json()["error"]
        assert reply.status_code == 503 and error["code"] == "llm_unavailable", reply.text
        assert int(reply.headers["retry-after"]) > 0
        return "llm_unavailable", error
    text, events = "", 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT) as reply:
        if reply.status_code != 200:
            reply.read()
            assert reply.status_code == 503 and reply.json()["error"]["code"] == "llm_unavailable", reply.text
            return "llm_unavailable", reply.json()["error"]
        lines, error = [], None
        for line in reply.iter_lines():  # as they come: `started` fires at the first one
            if not line.startswith("data: "):
                continue
            lines.append(line)
            if line == "data: [DONE]" or error is not None:
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
                assert error["code"] == "llm_unavailable", error
                assert error["r2r"]["text"] == text  # what was sent before the error
                continue
            text += chunk["choices"][0]["delta"].get("content") or "" if chunk["choices"] else ""
            events += 1
            if started is not None:
                started.set()
    assert lines[-1] == "data: [DONE]"
    return ("llm_unavailable", error) if error is not None else ("ok", text)


class HealthWatch:
    """Polls `/health` in a thread: the slowest answer, and every status seen."""

    def __init__(self, url: str):
        self.url, self.slowest, self.statuses, self.stop = url, 0.0, [], threading.Event()
        self.error: BaseException | None = None  # what ended the watch early: raised in the test's thread on exit
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        try:
            while not self.stop.is_set():
                start = time.monotonic()
                reply = httpx.get(self.url + "/health", timeout=10)
                self.slowest = max(self.slowest, time.monotonic() - start)
                assert reply.status_code == 200, reply.text
                self.statuses.append(reply.json())
                time.sleep(0.1)
        except BaseException as e:  # noqa: BLE001 - an assertion in a thread would vanish: `__exit__` raises it
            self.error = e

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        if self.error is not None:
            raise AssertionError(f"/health failed while watched: {self.error!r}") from self.error
        assert self.statuses, "the health watch saw no answer"


def signal_group(server: LlamaServer, sig: int) -> None:
    os.killpg(server.process.pid, sig)


@NEEDS_LLAMA_SERVER
def test_a_remote_llm_that_dies_stalls_and_comes_back(llm_files, slm, tokenizer):  # noqa: F811
    with LlamaServer(llm_files["gguf"], slots=4) as llm_server:
        llm = remote(llm_server.url, tokenizer, slm, retry=RETRY, timeout=TIMEOUT)
        engine = Engine(slm, llm, tokenizer, EntropyPolicy(3.0), verify="off")  # routing that ignores company
        app = create_app(engine, "tiny", Limits(max_batch=4, max_tokens=300, context_length=512))
        with BackgroundServer(app) as r2r, HealthWatch(r2r.url) as health, \
                concurrent.futures.ThreadPoolExecutor(8) as pool:
            url = r2r.url
            reference = {p: chat(url, p, stream=False) for p in REMOTE_PROMPTS}
            assert all(outcome == "ok" for outcome, _ in reference.values())
            assert all(len(reference[p][1]) > 200 for p in LONG)

            def wave(disturb, streams=4):
                """Streams (and a whole request) in flight, held at their first call to the LLM (its server
                stopped, SIGSTOP); `disturb` runs once the streams are under way, and leaves the server as it
                wants it."""
                signal_group(llm_server, signal.SIGSTOP)
                started = [threading.Event() for _ in range(streams)]
                futures = [pool.submit(chat, url, LONG[i % len(LONG)], True, None, started[i]) for i in range(streams)]
                futures.append(pool.submit(chat, url, REMOTE_PROMPTS[0], False))
                for event in started:
                    event.wait(10)
                disturb()
                results = [f.result(timeout=CLIENT_TIMEOUT + 5) for f in futures]
                prompts = [LONG[i % len(LONG)] for i in range(streams)] + [REMOTE_PROMPTS[0]]
                for prompt, (outcome, out) in zip(prompts, results):
                    if outcome == "ok":
                        assert out == reference[prompt][1], "a good request gave another answer"
                return [outcome for outcome, _ in results]

            def restart_quickly():
                llm_server.stop()
                llm_server.start()  # within the retry budget

            # Killed and back within the budget: every request finishes with its healthy answer.
            assert wave(restart_quickly) == ["ok"] * 5

            def kill():
                llm_server.stop()
                killed = time.monotonic()  # a refused connection is a fault known at once, not after the retries
                while httpx.get(url + "/health").json()["status"] != "degraded":
                    assert time.monotonic() - killed < 2.0, "/health said ok 2 s after the LLM's server went away"
                    time.sleep(0.05)

            # Killed and away: the requests in flight fail with the LLM-away error, none hangs.
            started = time.monotonic()
            outcomes = wave(kill)
            assert "llm_unavailable" in outcomes and set(outcomes) <= {"ok", "llm_unavailable"}
            assert time.monotonic() - started < RETRY + 4 * TIMEOUT
            # While it is away: refused at once with 503, SLM-only requests run, health says degraded.
            refused_at = time.monotonic()
            assert chat(url, REMOTE_PROMPTS[1], stream=False)[0] == "llm_unavailable"
            assert chat(url, REMOTE_PROMPTS[1], stream=True)[0] == "llm_unavailable"
            assert time.monotonic() - refused_at < 2 * 2.5  # two probes at most, no retry budget waited out
            assert chat(url, REMOTE_PROMPTS[1], stream=False, policy="slm")[0] == "ok"
            away = httpx.get(url + "/health").json()
            assert away["status"] == "degraded" and away["llm"]["url"] == llm_server.url
            # Back: serving resumes without a restart of r2r serve.
            llm_server.start()
            deadline = time.monotonic() + 10
            while httpx.get(url + "/health").json()["status"] != "ok":
                assert time.monotonic() < deadline, "r2r serve did not see the LLM come back"
                time.sleep(0.2)
            assert {p: chat(url, p, stream=False) for p in REMOTE_PROMPTS} == reference

            def stall(seconds):
                def run():
                    time.sleep(seconds)
                    signal_group(llm_server, signal.SIGCONT)
                return run

            # A stall shorter than a call's timeout: nothing fails.
            assert wave(stall(TIMEOUT / 2)) == ["ok"] * 5
            # A stall longer than the budget: the requests in flight fail, then it resumes.
            outcomes = wave(stall(RETRY + 2 * TIMEOUT))
            assert "llm_unavailable" in outcomes and set(outcomes) <= {"ok", "llm_unavailable"}
            deadline = time.monotonic() + 10
            while httpx.get(url + "/health").json()["status"] != "ok":
                assert time.monotonic() < deadline
                time.sleep(0.2)
            assert {p: chat(url, p, stream=False) for p in REMOTE_PROMPTS} == reference
        assert health.slowest < 3.0, f"/health took {health.slowest:.1f} s to answer"
        assert {s["status"] for s in health.statuses} == {"ok", "degraded"}


class SlowSLM:
    """The tiny SLM at the pace of a real one (`delay` seconds a step), never ending an answer by itself, so that a
    stream runs for seconds."""

    def __init__(self, backend, delay: float, eos_ids: set[int]):
        self.backend, self.delay, self.never = backend, delay, sorted(eos_ids)

    def __getattr__(self, name):
        return getattr(self.backend, name)

    def forward(self, *args):
        time.sleep(self.delay)
        logits, hidden = self.backend.forward(*args)
        logits = logits.clone()  # the backend's is an inference tensor
        logits[:, self.never] = -1e4
        return logits, hidden


def stream_times(url: str, prompt: str, policy: str | None, max_tokens: int, out: dict) -> None:
    """A stream's outcome and when each of its chunks came, into `out`."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, **({"r2r_policy": policy} if policy else {})}
    out["times"], out["error"] = [], None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                out["error"] = chunk.get("error", out["error"])
                out["times"].append(time.monotonic())
    out["ended"] = time.monotonic()


# Long enough for /health to say so (STALLED_AFTER_S) and for the SLM-only stream (0.08 s a token, 200 tokens) to
# show a gap if it waited; a call's retry budget outlasts it by two per-call timeouts.
STALL_S = 12.0


@NEEDS_LLAMA_SERVER
def test_with_overlap_a_stalled_llm_holds_only_the_rows_that_wait_for_it(llm_files, slm, tokenizer):
    """The LLM's server stopped (SIGSTOP) for STALL_S while an SLM-only stream and a routed one run (short: it has
    written all it may by the time the LLM is back, and waits for its word): the SLM-only stream's chunks keep
    coming (no gap over 3 s), /health says degraded once the routed row's call has waited STALLED_AFTER_S, and both
    finish right after SIGCONT. Killed for good instead: the routed request ends with the LLM-away error, the
    SLM-only one finishes."""
    with LlamaServer(llm_files["gguf"], slots=4) as llm_server:
        llm = remote(llm_server.url, tokenizer, slm, retry=STALL_S + 2 * TIMEOUT, timeout=TIMEOUT)
        # about 8% of the tiny SLM's tokens routed
        never = slm.eos_ids | {tokenizer.eos_token_id}
        engine = Engine(SlowSLM(slm, 0.08, never), llm, tokenizer, EntropyPolicy(3.7), verify="off", overlap=True)
        app = create_app(engine, "tiny", Limits(max_batch=4, max_tokens=300, context_length=512))
        with BackgroundServer(app) as r2r:
            url = r2r.url

            def run_both():
                outs = ({}, {})
                threads = [threading.Thread(target=stream_times, args=(url, LONG[0], policy, tokens, out))
                           for policy, tokens, out in zip((None, "slm"), (40, 200), outs)]
                for t in threads:
                    t.start()
                while not all(out.get("times") for out in outs):
                    time.sleep(0.05)
                return threads, outs

            threads, (routed, own) = run_both()
            stopped = time.monotonic()
            signal_group(llm_server, signal.SIGSTOP)
            degraded = None
            while time.monotonic() - stopped < STALL_S:
                if degraded is None and (said := httpx.get(url + "/health").json())["status"] == "degraded":
                    degraded = said["llm"]
                time.sleep(0.2)
            signal_group(llm_server, signal.SIGCONT)
            resumed = time.monotonic()
            for t in threads:
                t.join(CLIENT_TIMEOUT)
            during = [t for t in own["times"] if stopped <= t <= min(resumed, own["ended"])]
            gaps = [b - a for a, b in zip([stopped] + during, during + [min(resumed, own["ended"])])]
            assert len(during) > 10 and max(gaps) <= 3.0, f"the SLM-only stream stalled {max(gaps):.1f} s"
            # said as soon as the routed row's call had waited STALLED_AFTER_S (polled every 0.2 s, on a busy server)
            assert degraded is not None and degraded["status"] == "stalled"
            assert STALLED_AFTER_S <= degraded["waiting_for_s"] <= STALLED_AFTER_S + 2.0
            assert routed["error"] is None and own["error"] is None
            assert routed["ended"] - resumed < 10.0, "the routed stream did not finish right after SIGCONT"

            threads, (routed, own) = run_both()
            llm_server.stop()  # for good
            for t in threads:
                t.join(CLIENT_TIMEOUT)
            assert routed["error"] is not None and routed["error"]["code"] == "llm_unavailable"
            assert own["error"] is None and len(own["times"]) > 10


SERVE_WITH_REMOTE_LLM = """
import sys
sys.path.insert(0, {tests!r})
from tiny import tiny_model, tiny_tokenizer
from roads_to_rome.backends.remote import RemoteBackend
from roads_to_rome.backends.torch_backend import TorchBackend
from roads_to_rome.core.engine import Engine
from roads_to_rome.routing.policies import RandomPolicy
from roads_to_rome.serving.server import create_app, run
from roads_to_rome.serving.limits import Limits
tok = tiny_tokenizer()
slm = TorchBackend(tiny_model(tok, hidden=32, seed=0))
llm = RemoteBackend({llm!r}, tok, slm.eos_ids, vocab_size=len(tok))  # 120 s per call, 30 s of retries
engine = Engine(slm, llm, tok, RandomPolicy(0.5, seed=0))
sys.exit(run(create_app(engine, "tiny", Limits(max_tokens=300, context_length=512)), "127.0.0.1", {port}))
"""


@NEEDS_LLAMA_SERVER
def test_sigterm_exits_within_seconds_while_the_llms_server_has_stopped_answering(llm_files):
    import subprocess
    import sys
    from pathlib import Path

    from conftest import free_port

    with LlamaServer(llm_files["gguf"], slots=2) as llm_server:
        port = free_port()
        code = SERVE_WITH_REMOTE_LLM.format(tests=str(Path(__file__).parent), llm=llm_server.url, port=port)
        process = subprocess.Popen([sys.executable, "-c", code])
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            started, lines = threading.Event(), []

            def read_stream():
                body = {"messages": [{"role": "user", "content": LONG[0]}], "max_tokens": 300, "temperature": 0,
                        "stream": True, "r2r_policy": "llm"}
                with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=CLIENT_TIMEOUT) as reply:
                    for line in reply.iter_lines():
                        lines.append(line)
                        started.set()

            stream = threading.Thread(target=read_stream, daemon=True)
            stream.start()
            assert started.wait(30)
            signal_group(llm_server, signal.SIGSTOP)  # the LLM's server stops answering mid-stream
            time.sleep(1.0)
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            process.wait(20)
            took = time.monotonic() - signalled
            stream.join(10)
            assert took < 12, f"r2r serve took {took:.1f} s to exit after SIGTERM"
            errors = [json.loads(line[6:])["error"] for line in lines if line.startswith('data: {"error"')]
            assert errors and "shutting down" in errors[0]["message"], lines[-3:]  # cut with an error, not hanging
        finally:
            signal_group(llm_server, signal.SIGCONT)
            process.kill()
