"""`r2r serve` on the default pair under the loads a server on a network meets, each beside a normal request that
must still answer: a flood of near-1 MB prompts from many clients, a client that trickles its body, and many
clients that trickle their request heads (a "slowloris").

    python scripts/network-checks.py [--flood-clients 40] [--prompt-bytes 900000] [--seconds 60] \
        [--slow-heads 400,2000] --out runs/net.json

Prints and writes: the normal 10-token request's latencies during the flood (each one, p50 and the worst), how the
flood's requests ended (by status and error code), when the trickling client was cut off (the server's
--max-body-seconds, 30 s by default) with the normal requests' latencies meanwhile, and for each number of
head-trickling connections how each ended and when (--max-head-seconds, 10 s; past twice --max-connections, 512,
closed as they open), the server's open file descriptors at their peak, and the normal requests meanwhile. The
server's output goes to OUT.server.log. Needs the prepared default pair (`make models`)."""

import argparse
import collections
import json
import socket
import statistics
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
from serve_process import start_process

parser = argparse.ArgumentParser()
parser.add_argument("--flood-clients", type=int, default=40)
parser.add_argument("--prompt-bytes", type=int, default=900_000)
parser.add_argument("--seconds", type=float, default=60.0, help="how long the flood lasts")
parser.add_argument("--slow-heads", default="400,2000", help="how many connections trickle their heads, per run")
parser.add_argument("--port", type=int, default=18950)
parser.add_argument("--out", default="runs/network-checks.json")
args = parser.parse_args()
URL = f"http://127.0.0.1:{args.port}"
NORMAL = {"messages": [{"role": "user", "content": "What is 48 / 2?"}], "max_tokens": 10, "temperature": 0}


def normal_requests(stop: threading.Event, latencies: list, every: float = 2.0) -> None:
    """A 10-token request every `every` seconds until `stop`: each one's latency, or its failure."""
    with httpx.Client(base_url=URL, timeout=120) as client:
        while not stop.is_set():
            start = time.monotonic()
            try:
                reply = client.post("/v1/chat/completions", json=NORMAL)
                ok = reply.status_code == 200
                latencies.append(round(time.monotonic() - start, 3) if ok else reply.status_code)
            except httpx.HTTPError as e:  # a connection past the server's cap is closed as it opens
                latencies.append(type(e).__name__)
            stop.wait(every)


def flood(stop: threading.Event, outcomes: collections.Counter, lock: threading.Lock) -> None:
    text = ("The quick brown fox jumps over the lazy dog 12345. " * (args.prompt_bytes // 51 + 1))[: args.prompt_bytes]
    body = json.dumps({"prompt": text, "max_tokens": 10}).encode()
    with httpx.Client(base_url=URL, timeout=120) as client:
        while not stop.is_set():
            try:
                reply = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
                code = reply.json().get("error", {}).get("code") if reply.status_code != 200 else ""
                key = f"{reply.status_code} {code}"
            except httpx.HTTPError as e:
                key = type(e).__name__
            with lock:
                outcomes[key.strip()] += 1


def trickle() -> tuple[float, str]:
    """Headers, then a body a byte a second: when the server cut it off, and its status line."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", args.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000\r\n\r\n")
        s.settimeout(1.0)
        while time.monotonic() - start < 300:
            try:
                s.sendall(b" ")
                answer = s.recv(4096)
                return time.monotonic() - start, answer.split(b"\r\n")[0].decode() if answer else "closed"
            except TimeoutError:
                continue
            except OSError as e:
                return time.monotonic() - start, type(e).__name__
    return time.monotonic() - start, "never cut off"


def slow_heads(n: int, server: psutil.Process, seconds: float = 60.0) -> dict:
    """`n` connections, each sending half a request head, then a byte of it a second: how and when each ended (its
    status line, "closed", or the error its socket raised), and the server's open file descriptors at the peak."""
    fds_before, sockets, ends = server.num_fds(), {}, collections.defaultdict(list)
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", args.port))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        s.setblocking(False)
        sockets[s] = time.monotonic()
    peak, start = server.num_fds(), time.monotonic()
    while sockets and time.monotonic() - start < seconds:
        for s, opened in list(sockets.items()):
            try:
                answer = s.recv(4096)
                end = answer.split(b"\r\n")[0].decode() if answer else "closed"
            except BlockingIOError:
                try:
                    s.send(b"a")
                    continue
                except OSError as e:
                    end = type(e).__name__
            except OSError as e:
                end = type(e).__name__
            ends[end].append(time.monotonic() - opened)
            del sockets[s]
            s.close()
        peak = max(peak, server.num_fds())
        time.sleep(1.0)
    for s in sockets:
        s.close()
    ended = {end: {"connections": len(t), "first_s": round(min(t), 2), "last_s": round(max(t), 2)}
             for end, t in ends.items()}
    return {"connections": n, "ended": ended, "still_open": len(sockets), "server_fds_before": fds_before,
            "server_fds_peak": peak}


def summary(latencies: list) -> dict:
    times = [x for x in latencies if isinstance(x, float)]
    return {"latencies_s": latencies, "answered": len(times), "failed": len(latencies) - len(times),
            "p50_s": statistics.median(times) if times else None, "max_s": max(times) if times else None}


def main():
    out = Path(args.out)
    server = start_process(["r2r", "serve", "--port", str(args.port)], URL + "/health", out.with_suffix(".server.log"))
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        cpu = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "")
        result = {"cpu": cpu, "flood_clients": args.flood_clients, "prompt_bytes": args.prompt_bytes}
        start = time.monotonic()
        httpx.post(URL + "/v1/chat/completions", json=NORMAL, timeout=120).raise_for_status()
        result["alone_s"] = round(time.monotonic() - start, 3)  # the normal request with nothing else

        stop, lock, outcomes, latencies = threading.Event(), threading.Lock(), collections.Counter(), []
        clients = [threading.Thread(target=flood, args=(stop, outcomes, lock)) for _ in range(args.flood_clients)]
        for t in clients:
            t.start()
        time.sleep(2.0)  # the flood under way
        watcher = threading.Thread(target=normal_requests, args=(stop, latencies))
        watcher.start()
        time.sleep(args.seconds)
        stop.set()
        for t in [*clients, watcher]:
            t.join()
        result["flood"] = {"outcomes": dict(outcomes), **summary(latencies)}

        stop, latencies = threading.Event(), []
        watcher = threading.Thread(target=normal_requests, args=(stop, latencies))
        watcher.start()
        took, status = trickle()
        stop.set()
        watcher.join()
        result["trickle"] = {"cut_after_s": round(took, 1), "status": status, **summary(latencies)}

        result["slow_heads"] = []
        for n in map(int, args.slow_heads.split(",")):
            stop, latencies = threading.Event(), []
            watcher = threading.Thread(target=normal_requests, args=(stop, latencies))
            watcher.start()
            heads = slow_heads(n, psutil.Process(server.pid))
            stop.set()
            watcher.join()
            result["slow_heads"].append({**heads, **summary(latencies)})
    finally:
        server.terminate()
        server.wait(30)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items()}, indent=2))


if __name__ == "__main__":
    main()
