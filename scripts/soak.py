"""A long soak of `r2r serve` on the default pair (llama.cpp): many requests from concurrent clients, every outcome
accounted for, leaks measured. With --remote the LLM runs on llama.cpp's own server (scripts/llama-server.py),
which is killed and restarted --kills times during the run.

    python scripts/soak.py --requests 1000 --clients 8 [--remote --kills 2] --out runs/soak.json

The servers' own logs go beside the results (runs/soak.server.log, runs/soak.llm-server.log).

The workload, drawn from a seeded generator: greedy chat requests (whole and streamed; their answers are compared
with the same request made alone before the load), long prompts, clients that go away in the middle of a stream,
and bad bodies (malformed JSON, wrong types, out-of-range values, an unknown model); a client told by a 503 to come
back later waits its Retry-After first. It reports the count of each outcome, how many greedy answers equal the
reference, the server's RSS, open files and threads at the start (after a warm-up burst from every client) and the
end, and p50/p95 latency of the good requests."""

import argparse
import collections
import concurrent.futures
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from serve_process import start_process

parser = argparse.ArgumentParser()
parser.add_argument("--requests", type=int, default=1000)
parser.add_argument("--clients", type=int, default=8)
parser.add_argument("--port", type=int, default=18900)
parser.add_argument("--remote", action="store_true", help="the LLM on llama.cpp's server, killed and restarted")
parser.add_argument("--kills", type=int, default=2)
parser.add_argument("--down-s", default="8,45", help="how long the LLM's server stays dead, each time in turn "
                    "(comma-separated seconds: the default's first is within r2r serve's --llm-retry, the second not)")
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--out", default="runs/soak.json")
args = parser.parse_args()
URL = f"http://127.0.0.1:{args.port}"
QUESTIONS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many in May. How many in all?",
    "Write a Python function that reverses a string.",
    "What is the capital of France? Answer in one word.",
    "Explain recursion in one sentence.",
    "A train goes 60 km in 45 minutes. What is its speed in km/h?",
    "List three prime numbers greater than 50.",
    "Write a SQL query that counts the rows of a table named users.",
    "What does HTTP status 404 mean?",
]
LONG = " ".join(["The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill."] * 30)
BAD = [
    (b'{"messages": [', "malformed JSON"),
    (json.dumps({"messages": "hello"}).encode(), "messages of the wrong type"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "temperature": 7}).encode(), "temperature 7"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}).encode(), "max_tokens -3"),
    (json.dumps({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}).encode(), "an unknown model"),
    (json.dumps({"messages": [{"role": "user", "content": "hi"}], "top_p": "x"}).encode(), "top_p a string"),
]


def body(question: str, max_tokens: int, stream: bool) -> dict:
    return {"messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": max_tokens,
            "stream": stream}


def refused(reply: httpx.Response) -> tuple[str, str, float]:
    """A request the server turned away: llm_unavailable (after waiting out its Retry-After, as the openai client
    does before it asks again) or the status."""
    if reply.json().get("error", {}).get("code") == "llm_unavailable":
        time.sleep(min(float(reply.headers.get("retry-after", 0)), 10.0))
        return "llm_unavailable", "", 0.0
    return f"http {reply.status_code}", reply.text, 0.0


def ask(client: httpx.Client, payload: dict, leave_after: int | None = None) -> tuple[str, str, float]:
    """(outcome, text, seconds): ok, llm_unavailable, left (the client went away on purpose), or an error kind."""
    start = time.monotonic()
    try:
        if not payload["stream"]:
            reply = client.post("/v1/chat/completions", json=payload)
            if reply.status_code == 200:
                return "ok", reply.json()["choices"][0]["message"]["content"], time.monotonic() - start
            return refused(reply)
        text, chunks = "", 0
        with client.stream("POST", "/v1/chat/completions", json=payload) as reply:
            if reply.status_code != 200:
                reply.read()
                return refused(reply)
            last = None
            for line in reply.iter_lines():
                if not line.startswith("data: "):
                    continue
                last = line
                if line == "data: [DONE]":
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    code = chunk["error"].get("code")
                    return ("llm_unavailable" if code == "llm_unavailable" else "stream error"), text, 0.0
                if chunk["choices"]:
                    text += chunk["choices"][0]["delta"].get("content") or ""
                chunks += 1
                if leave_after is not None and chunks >= leave_after:
                    return "left", text, 0.0
            if last != "data: [DONE]":
                return "stream cut", text, 0.0
        return "ok", text, time.monotonic() - start
    except httpx.TimeoutException:
        return "hung", "", 0.0
    except httpx.HTTPError as e:
        return f"connection: {type(e).__name__}", "", 0.0


def bad(client: httpx.Client, raw: bytes) -> str:
    reply = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    shaped = isinstance(reply.json().get("error"), dict)
    refused = 400 <= reply.status_code < 500 and shaped
    return f"refused {reply.status_code}" if refused else f"bad body {reply.status_code}"


def usage(process: psutil.Process) -> dict:
    """The server's RSS, open files and threads; with py-spy on PATH also its Python threads by name, so that a
    change in the thread count tells Python threads (pools, probes) from native ones (OpenMP teams)."""
    figures = {"rss_mb": round(process.memory_info().rss / 2**20, 1), "open_files": process.num_fds(),
               "threads": process.num_threads()}
    if shutil.which("py-spy"):
        dump = subprocess.run(["py-spy", "dump", "--pid", str(process.pid)], capture_output=True, text=True).stdout
        names = re.findall(r'^Thread \S+ \([^)]*\): "([^"]*)"', dump, flags=re.M)
        figures["python_threads"] = sorted(names)
    return figures


def main():
    rng = random.Random(args.seed)
    llm_server, extra = None, []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    server_log, llm_log = out.with_suffix(".server.log"), out.with_suffix(".llm-server.log")
    for log in (server_log, llm_log):
        log.unlink(missing_ok=True)
    if args.remote:
        sys.path.insert(0, str(Path(__file__).parents[1]))
        from roads_to_rome.models import DEFAULT_LLM, gguf_path

        llm_port = args.port + 1
        llm_command = [sys.executable, str(Path(__file__).parent / "llama-server.py"), str(gguf_path(DEFAULT_LLM)),
                       "--port", str(llm_port), "--slots", str(args.clients)]
        llm_server = start_process(llm_command, f"http://127.0.0.1:{llm_port}/health", llm_log)
        extra = ["--llm", f"http://127.0.0.1:{llm_port}"]
    server = start_process(["r2r", "serve", "--port", str(args.port), "--max-batch", str(args.clients), *extra],
                           URL + "/health", server_log)
    client = httpx.Client(base_url=URL, timeout=300)
    # The reference: each greedy request alone, before the load (and the warm-up).
    reference = {}
    for question in QUESTIONS:
        for max_tokens in (4, 8, 12):
            reference[(question, max_tokens)] = ask(client, body(question, max_tokens, False))[1]
    # A burst from every client at once (good, streamed and bad bodies) before the start figures: what grows with
    # concurrency by design (the remote backend's threads, one per server slot, up to --clients) is counted there.
    burst = [body(QUESTIONS[i % len(QUESTIONS)], 4, i % 2 == 1) for i in range(2 * args.clients)]

    def warm(payload):
        with httpx.Client(base_url=URL, timeout=300) as own:
            ask(own, payload)
            bad(own, BAD[0][0])

    with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        list(pool.map(warm, burst))
    process = psutil.Process(server.pid)
    before = usage(process)

    plan = []  # (kind, payload or raw body)
    for _ in range(args.requests):
        roll = rng.random()
        question, max_tokens = rng.choice(QUESTIONS), rng.choice((4, 8, 12))
        if roll < 0.40:
            plan.append(("whole", body(question, max_tokens, False)))
        elif roll < 0.80:
            plan.append(("stream", body(question, max_tokens, True)))
        elif roll < 0.88:
            plan.append(("bad", rng.choice(BAD)[0]))
        elif roll < 0.97:
            plan.append(("leave", body(question, 12, True)))
        else:
            plan.append(("long", body(LONG + " Summarise this in one sentence.", 8, rng.random() < 0.5)))

    outcomes, latencies, same, compared, unexpected = collections.Counter(), [], 0, 0, []
    lock = threading.Lock()
    kill_times = [args.requests * (k + 1) // (args.kills + 1) for k in range(args.kills)] if args.remote else []
    kills = []

    def run(index_item):
        nonlocal same, compared
        index, (kind, payload) = index_item
        with httpx.Client(base_url=URL, timeout=300) as own:
            if kind == "bad":
                outcome, text, seconds = bad(own, payload), "", 0.0
            else:
                outcome, text, seconds = ask(own, payload, leave_after=3 if kind == "leave" else None)
        with lock:
            outcomes[f"{kind}: {outcome}"] += 1
            if outcome not in ("ok", "left", "llm_unavailable", "refused 400", "refused 404"):
                unexpected.append({"kind": kind, "outcome": outcome, "reply": text[:500],
                                   "at_s": round(time.monotonic() - started, 1)})
            if outcome == "ok":
                latencies.append(seconds)
                key = (payload["messages"][0]["content"], payload["max_tokens"])
                if kind in ("whole", "stream") and key in reference:
                    compared += 1
                    same += text == reference[key]

    def killer():
        nonlocal llm_server
        done = 0
        while done < len(kill_times):
            with lock:
                finished = sum(outcomes.values())
            if finished >= kill_times[done]:
                os.killpg(llm_server.pid, signal.SIGKILL)
                llm_server.wait()
                killed = time.monotonic()
                downs = [float(x) for x in args.down_s.split(",")]
                time.sleep(downs[done % len(downs)])
                llm_server = start_process(llm_command, f"http://127.0.0.1:{llm_port}/health", llm_log)
                kills.append({"after_requests": finished, "at_s": round(killed - started, 1),
                              "down_s": round(time.monotonic() - killed, 1)})
                done += 1
            time.sleep(0.5)

    started = time.monotonic()
    if args.remote:
        threading.Thread(target=killer, daemon=True).start()
    with Progress(TextColumn("soak"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()) as progress, \
            concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
        task = progress.add_task("soak", total=len(plan))
        for _ in pool.map(run, enumerate(plan)):
            progress.advance(task)
    wall = time.monotonic() - started
    time.sleep(2)  # the server lets go of what the last requests held
    after = usage(process)
    health = client.get("/health").json()
    server.send_signal(signal.SIGTERM)
    server.wait(60)
    if llm_server is not None:
        os.killpg(llm_server.pid, signal.SIGKILL)
    latencies.sort()
    result = {
        "requests": len(plan), "clients": args.clients, "remote_llm": args.remote, "kills": kills,
        "wall_s": round(wall, 1), "outcomes": dict(sorted(outcomes.items())), "accounted": sum(outcomes.values()),
        "unexpected": unexpected,
        "greedy_equal_to_alone": same, "greedy_compared": compared,
        "latency_p50_s": round(statistics.median(latencies), 2) if latencies else None,
        "latency_p95_s": round(latencies[int(0.95 * (len(latencies) - 1))], 2) if latencies else None,
        "server_start": before, "server_end": after, "health_at_end": health.get("status"),
        "server_exit_code": server.returncode,
    }
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
