"""llama.cpp's own HTTP server (from the `xllamacpp` wheel, which embeds it) on a GGUF file, until interrupted:
the remote LLM for `r2r ... --llm http://127.0.0.1:PORT`. `make llama-server` runs it on the prepared LLM.

    python scripts/llama-server.py MODEL.gguf [--port 8080] [--slots 4] [--ctx-per-slot 4096] [--threads N]
                                              [--api-key KEY]

Prints "listening on URL" once it accepts requests."""

import argparse
import os
import signal
import threading

import xllamacpp

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("--host", default="127.0.0.1")
parser.add_argument("--port", type=int, default=8080)
parser.add_argument("--slots", type=int, default=4, help="requests decoded at once (llama.cpp's --parallel)")
parser.add_argument("--ctx-per-slot", type=int, default=4096)
parser.add_argument("--threads", type=int, default=os.cpu_count())
parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (r2r's --llm-api-key)")
args = parser.parse_args()

params = xllamacpp.CommonParams()
params.model.path = args.model
params.hostnames = [args.host]
params.port = args.port
params.n_parallel = args.slots
params.n_ctx = args.slots * args.ctx_per_slot
params.cpuparams.n_threads = params.cpuparams_batch.n_threads = args.threads
if args.api_key:
    params.api_keys = [args.api_key]
params.cache_prompt = True  # a routed token's request reads only what is new since the row's last one
server = xllamacpp.Server(params)
print("listening on", server.listening_address, flush=True)
done = threading.Event()
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda *_: done.set())
done.wait()
