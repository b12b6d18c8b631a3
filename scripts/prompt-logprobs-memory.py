"""What a prompt's log-probabilities cost a server in memory: `r2r serve` on the default pair in a process of its own,
then one request for a prompt of N tokens scored (`echo` with `logprobs`, `max_tokens: 1`), R2R routing it; prints
the server's peak resident memory (the kernel's VmHWM) before and after, the difference, and the request's seconds.
Run it once per checkout to compare two (the command line runs the package found first on the path).

    python scripts/prompt-logprobs-memory.py --tokens 1500
    PYTHONPATH=/path/to/other/checkout python scripts/prompt-logprobs-memory.py --tokens 1500 --backend torch
"""

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve_process import start_process  # noqa: E402

from roads_to_rome.hardware import measured_on  # noqa: E402


def peak_rss(pid: int) -> int:
    """A process's peak resident memory so far, in bytes (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"no VmHWM for process {pid}")


parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--tokens", type=int, default=1500, help="the prompt's length")
parser.add_argument("--backend", default="auto", help="r2r serve's --backend")
parser.add_argument("--port", type=int, default=8391)
parser.add_argument("--out", type=Path, help="the figures as JSON")
args = parser.parse_args()

url = f"http://127.0.0.1:{args.port}"
log = Path(tempfile.mkdtemp()) / "serve.log"
command = [sys.executable, "-m", "roads_to_rome", "serve", "--port", str(args.port), "--backend", args.backend,
           "--max-tokens", "64"]
server = start_process(command, url + "/health", log)
try:
    random.seed(0)
    prompt = [random.randrange(1000, 30000) for _ in range(args.tokens)]
    warm = httpx.post(url + "/v1/completions", json={"prompt": prompt[:16], "max_tokens": 1}, timeout=600)
    assert warm.status_code == 200, warm.text
    before = peak_rss(server.pid)
    start = time.monotonic()
    scored = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "echo": True,
                                                       "logprobs": 1}, timeout=600)
    seconds = time.monotonic() - start
    assert scored.status_code == 200, scored.text
    entries = scored.json()["choices"][0]["logprobs"]["token_logprobs"]
    after = peak_rss(server.pid)
finally:
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(60)

figures = {"processor": measured_on(), "backend": args.backend, "prompt_tokens": args.tokens,
           "scored_entries": len(entries), "peak_rss_before_mb": round(before / 2**20),
           "peak_rss_after_mb": round(after / 2**20), "peak_rise_mb": round((after - before) / 2**20),
           "seconds": round(seconds, 2)}
print(json.dumps(figures, indent=1))
if args.out:
    args.out.write_text(json.dumps(figures, indent=1) + "\n")
