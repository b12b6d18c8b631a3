"""What a prompt's log-probabilities cost a server in memory: `r2r serve` on the default pair in a process of its own,
then a prompt of N tokens read without scores, then the same prompt scored (`echo` with `logprobs`, `max_tokens: 1`),
R2R routing it; prints the server's resident memory before each, how far its peak rose while each ran (the kernel's
VmHWM, reset before each) and each request's seconds. What scoring adds is the scored rise beside the plain one.
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


def memory(pid: int, field: str) -> int:
    """A process's resident memory now (VmRSS) or at its peak since it was last reset (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise SystemExit(f"no {field} for process {pid}")


def reset_peak(pid: int) -> int:
    """Set the process's peak back to what it holds now (the kernel's clear_refs 5), so that a load's peak is not
    what a request is measured against; returns what it holds."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return memory(pid, "VmRSS")


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
# (started away from this checkout: `python -m` would find the package in its working directory first)
server = start_process(command, url + "/health", log, cwd=log.parent)
try:
    random.seed(0)
    prompt = [random.randrange(1000, 30000) for _ in range(args.tokens)]
    warm = httpx.post(url + "/v1/completions", json={"prompt": prompt[:16], "max_tokens": 1}, timeout=600)
    assert warm.status_code == 200, warm.text
    figures = {}
    for kind, extra in (("plain", {}), ("scored", {"echo": True, "logprobs": 1})):
        before = reset_peak(server.pid)
        start = time.monotonic()
        answer = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, **extra}, timeout=600)
        figures[kind] = {"seconds": round(time.monotonic() - start, 2), "rss_before_mb": round(before / 2**20),
                         "peak_rise_mb": round((memory(server.pid, "VmHWM") - before) / 2**20)}
        assert answer.status_code == 200, answer.text
    entries = answer.json()["choices"][0]["logprobs"]["token_logprobs"]
finally:
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(60)

figures = {"processor": measured_on(), "backend": args.backend, "prompt_tokens": args.tokens,
           "scored_entries": len(entries), **figures}
print(json.dumps(figures, indent=1))
if args.out:
    args.out.write_text(json.dumps(figures, indent=1) + "\n")
