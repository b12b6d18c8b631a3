"""The server-hardening checks on the real pair: starts `r2r serve` (llama.cpp by default) on loopback, runs
each check as a client would, prints one line per check and writes them as JSON.

    python scripts/server-checks.py [--backend llamacpp] [--port 18800] [--out runs/server-checks.json]

Nothing else should run meanwhile: item 3 times a stream while a long prompt is read."""

import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from serve_process import start_process

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="llamacpp")
parser.add_argument("--port", type=int, default=18800)
parser.add_argument("--long-prompt-words", type=int, default=3000)
parser.add_argument("--out", default="runs/server-checks.json")
args = parser.parse_args()
URL = f"http://127.0.0.1:{args.port}"
CHAT = URL + "/v1/chat/completions"
QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did Natalia sell altogether in April and May?")
results = {}


def start(*extra):
    return start_process(["r2r", "serve", "--port", str(args.port), "--backend", args.backend, *extra],
                         URL + "/health", Path(args.out).with_suffix(".server.log"), seconds=300)


def body(content=QUESTION, **kw):
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 64, **kw}


def record(name, ok, **figures):
    results[name] = {"ok": bool(ok), **figures}
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {json.dumps(figures)}", flush=True)


class Stream(threading.Thread):
    def __init__(self, payload):
        super().__init__(daemon=True)
        self.payload, self.times, self.text, self.error = payload, [], "", None
        self.start()

    def run(self):
        with httpx.stream("POST", CHAT, json={**self.payload, "stream": True}, timeout=1800) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = event["error"]["message"]
                    elif event.get("r2r"):
                        self.times.append(time.monotonic())
                        self.text += event["choices"][0]["delta"].get("content") or ""


def raw(content: bytes, headers=None):
    return httpx.post(CHAT, content=content, headers={"content-type": "application/json", **(headers or {})},
                      timeout=600)


server = start("--max-batch", "4", "--max-queue", "2", "--drain-timeout", "5")
try:
    reference = httpx.post(CHAT, json=body(max_tokens=96), timeout=600).json()["choices"][0]["message"]["content"]
    # 1: a seed that overflows 64 bits, while a stream runs
    stream = Stream(body(max_tokens=96))
    response = httpx.post(CHAT, json=body(seed=1180591620717411303424), timeout=60)
    stream.join()
    record("1 overflowing seed", response.status_code == 400 and stream.error is None and len(stream.times) == 96,
           status=response.status_code, stream_tokens=len(stream.times), same_text_as_alone=stream.text == reference)
    # 2: a prompt beyond what the KV pool holds is refused at once
    start_time = time.monotonic()
    response = httpx.post(CHAT, json=body("clips " * 17000), timeout=600)
    record("2 17k-word prompt", response.status_code == 400, status=response.status_code,
           code=response.json()["error"]["code"], seconds=round(time.monotonic() - start_time, 2))
    # 3: a running stream keeps getting tokens while a long prompt is read
    stream = Stream(body(max_tokens=2048))
    while len(stream.times) < 5:
        time.sleep(0.05)
    before = len(stream.times) / (stream.times[-1] - stream.times[0] + 1e-9)
    long_prompt = " ".join(QUESTION.split() * (args.long_prompt_words // len(QUESTION.split())))
    submitted = time.monotonic()
    newcomer = Stream(body(long_prompt, max_tokens=8))
    newcomer.join()
    first = newcomer.times[0] if newcomer.times else time.monotonic()
    during = [t for t in stream.times if submitted < t < first]
    prompt_tokens = httpx.post(URL + "/v1/completions", json={"prompt": long_prompt, "max_tokens": 1},
                               timeout=600).json()["usage"]["prompt_tokens"]
    record("3 stream during a long prefill", len(during) > 0, prompt_tokens=prompt_tokens,
           prefill_s=round(first - submitted, 1), stream_tokens_during=len(during),
           stream_tok_s_before=round(before, 2), stream_tok_s_during=round(len(during) / (first - submitted), 2))
    # 5: 4 MB body; /health meanwhile
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        big = pool.submit(raw, json.dumps(body("x" * 4_000_000)).encode())
        start_time = time.monotonic()
        health = httpx.get(URL + "/health", timeout=60)
        health_s = time.monotonic() - start_time
        response = big.result()
    record("5 4 MB body", response.status_code == 413 and health_s < 1, status=response.status_code,
           health_s=round(health_s, 3))
    # 6: lone surrogate, JSON nested 100k deep (within a 1 MiB body: 50k deep)
    statuses = [raw(b'{"messages": [{"role": "user", "content": "\\ud800x"}]}').status_code,
                raw(b"[" * 50_000 + b"]" * 50_000).status_code]
    record("6 surrogate / deep JSON", statuses == [400, 400], statuses=statuses)
    # 9: non-finite values
    statuses = [httpx.post(CHAT, json=body(temperature=t), timeout=60).status_code for t in (1e308, "inf")]
    record("9 temperature 1e308 / inf", statuses == [400, 400], statuses=statuses)
    # 10: foreign Host / Origin / text/plain
    statuses = [raw(json.dumps(body()).encode(), {"host": "evil.example"}).status_code,
                raw(json.dumps(body()).encode(), {"origin": "http://evil.example"}).status_code,
                raw(json.dumps(body()).encode(), {"content-type": "text/plain"}).status_code,
                httpx.get(URL + "/docs").status_code]
    record("10 Host / Origin / content-type / docs", statuses == [403, 403, 415, 404], statuses=statuses)
    stream.join()
    # 7: with 4 slots and 2 queue places: 4 long streams, 2 queued clients that give up, then one more
    streams = [Stream(body(max_tokens=256)) for _ in range(4)]
    time.sleep(2)
    for _ in range(2):
        try:
            httpx.post(CHAT, json=body(max_tokens=8), timeout=1)
        except httpx.TimeoutException:
            pass
    time.sleep(1)
    waiting = httpx.get(URL + "/health").json()["waiting"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        after = [pool.submit(httpx.post, CHAT, json=body(max_tokens=8), timeout=600) for _ in range(2)]
        statuses = [a.result().status_code for a in after]
    for s in streams:
        s.join()
    record("7 queued clients that give up", waiting == 0 and statuses == [200, 200], waiting_after=waiting,
           next_statuses=statuses)
    # 11: greedy output alone and in company (the LLM alone and R2R)
    questions = [f"{QUESTION} Then add {n}." for n in range(8)]
    same = {}

    def text(question, extra):
        response = httpx.post(CHAT, json=body(question, max_tokens=128, **extra), timeout=600)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    for policy in ("llm", None):
        extra = {"r2r_policy": policy} if policy else {}
        alone = [text(q, extra) for q in questions]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda q: text(q, extra), questions))
        same[policy or "r2r"] = sum(a == b for a, b in zip(alone, together))
    record("11 greedy alone vs in a batch of 4 (same text, of 8)", True, **same)
    # 8: SIGTERM while a long stream runs: cut at the drain deadline (5 s), the process exits
    stream = Stream(body(max_tokens=2048))
    while not stream.times:
        time.sleep(0.05)
    start_time = time.monotonic()
    server.send_signal(signal.SIGTERM)
    stream.join()
    code = server.wait(60)
    record("8 SIGTERM with --drain-timeout 5", stream.error is not None and "shutting down" in stream.error,
           exit_seconds=round(time.monotonic() - start_time, 1), stream_error=stream.error, exit_code=code)
finally:
    if server.poll() is None:
        server.kill()
# 4: --max-batch beyond what llama.cpp can hold
process = subprocess.run(["r2r", "serve", "--port", str(args.port), "--backend", args.backend, "--max-batch", "300"],
                         capture_output=True, text=True, timeout=600)
record("4 --max-batch 300", process.returncode != 0 and "Traceback" not in process.stderr,
       exit_code=process.returncode, message=(process.stderr.strip().splitlines() or [""])[-1][:200])
os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
with open(args.out, "w") as f:
    json.dump({"backend": args.backend, "checks": results}, f, indent=2)
print(f"JSON in {args.out}")
sys.exit(0 if all(r["ok"] for r in results.values()) else 1)
