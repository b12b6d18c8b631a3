"""A bystander: a greedy stream and a `/health` probe beside a request under test, to show what that request costs
everyone else (the stream's rate before and while it is sent, the slowest `/health` answer)."""

import json
import threading
import time

import httpx

CHAT = "/v1/chat/completions"


class Watch:
    """A bystander stream's token times and `/health`'s answer times, while something else is sent."""

    def __init__(self, url: str, tokens: int = 480):
        self.url, self.times, self.health_s, self.done = url, [], [], threading.Event()
        payload = {"messages": [{"role": "user", "content": "Bonjour!"}], "max_tokens": tokens, "temperature": 0,
                   "ignore_eos": True, "r2r_policy": "slm", "stream": True}
        self.stream = threading.Thread(target=self._stream, args=(payload,), daemon=True)
        self.stream.start()
        self.probe = threading.Thread(target=self._probe, daemon=True)
        self.probe.start()

    def _stream(self, payload):
        with httpx.stream("POST", self.url + CHAT, json=payload, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                    self.times.append(time.monotonic())

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
    if not watch.stream.is_alive() and watch.times[-1] < end:
        end = watch.times[-1] + 1e-6
    return before, watch.rate(begin, max(end, begin + 0.25)), max(watch.health_s), result


def slowed(models, monkeypatch, seconds: float = 0.005) -> None:
    """Each model's forward takes `seconds` more: a tiny model's bystander stream then lasts seconds, long enough to
    be watched."""
    for model in models:
        forward = model.forward
        monkeypatch.setattr(model, "forward", lambda *a, f=forward: (time.sleep(seconds), f(*a))[1])
