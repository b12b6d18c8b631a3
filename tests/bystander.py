"""A bystander: a greedy stream and a `/health` probe beside a request under test, to show what that request costs
everyone else (the stream's rate before and while it is sent, the slowest `/health` answer)."""

import json
import threading
import time

import httpx

CHAT = "/v1/chat/completions"


class Stream:
    """A streaming chat request in a thread: its text, the arrival time of each token chunk, the last
    finish_reason, and the error it ended with (a refusal, an error event, or the connection lost)."""

    def __init__(self, url: str, payload: dict):
        self.text, self.times, self.finish_reason, self.error = "", [], None, None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(url, payload), daemon=True)
        self.thread.start()

    def _run(self, url, payload):
        try:
            with httpx.stream("POST", url + CHAT, json={**payload, "stream": True}, timeout=120) as response:
                if response.status_code != 200:
                    self.error = json.loads(response.read())["error"]
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        self._read(json.loads(line[6:]))
        except httpx.TransportError as e:  # the server went away mid-stream
            self.error = {"message": f"connection lost: {e}"}
        finally:
            self.done.set()

    def _read(self, event: dict):
        if "error" in event:
            self.error = event["error"]
            return
        if event.get("r2r"):  # a token chunk (the role's and the finish's chunks carry none)
            self.times.append(time.monotonic())
        for choice in event.get("choices", []):
            self.text += choice["delta"].get("content") or ""
            self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def wait(self, timeout: float = 120):
        assert self.done.wait(timeout)
        return self


class Watch:
    """A bystander stream's token times and `/health`'s answer times, while something else is sent."""

    def __init__(self, url: str, tokens: int = 480):
        self.url, self.health_s, self.done = url, [], threading.Event()
        self.stream = Stream(url, {"messages": [{"role": "user", "content": "Bonjour!"}], "max_tokens": tokens,
                                   "temperature": 0, "ignore_eos": True, "r2r_policy": "slm"})
        self.times = self.stream.times
        self.probe = threading.Thread(target=self._probe, daemon=True)
        self.probe.start()

    def _probe(self):
        while not self.done.is_set():
            start = time.monotonic()
            assert httpx.get(self.url + "/health", timeout=30).status_code == 200
            self.health_s.append(time.monotonic() - start)
            time.sleep(0.05)

    def rate(self, start: float, end: float) -> float:
        return sum(start <= t < end for t in self.times) / (end - start)


def during(url: str, send, settle: float = 1.0):
    """`send()` beside a bystander stream: its rate in the second before, its rate while `send` ran, the slowest
    `/health` answer, and what `send` returned."""
    watch = Watch(url)
    while len(watch.times) < 5:
        time.sleep(0.01)
    time.sleep(settle)
    begin = time.monotonic()
    result = send()
    end = time.monotonic()
    watch.done.set()
    watch.probe.join(30)
    before = watch.rate(begin - settle, begin)
    # A bystander that has written all its tokens has no rate left to hold up: its rate while `send` ran is counted
    # up to its last token where it ended first (on a slow machine it can), and /health throughout.
    if watch.stream.done.is_set() and watch.times[-1] < end:
        end = watch.times[-1] + 1e-6
    return before, watch.rate(begin, max(end, begin + 0.25)), max(watch.health_s), result


def slowed(models, monkeypatch, seconds: float = 0.005) -> None:
    """Each model's forward takes `seconds` more: a tiny model's bystander stream then lasts seconds, long enough to
    be watched."""
    for model in models:
        forward = model.forward
        monkeypatch.setattr(model, "forward", lambda *a, f=forward: (time.sleep(seconds), f(*a))[1])
