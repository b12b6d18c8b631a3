#!/usr/bin/env bash
# The disaggregated set-up in miniature, on one machine: the LLM on llama.cpp's own server pinned to its own cores,
# r2r pinned to the others, with the LLM's calls in the step and beside the SLM's steps (--overlap), beside the LLM
# alone (behind r2r serve on the same server, and asked directly on its server given every core) and speculative
# decoding. Two JSON files go to OUT (default docs/results/overlap): serve.json and direct.json.
#
#   scripts/disaggregated.sh [R2R_CORES LLM_CORES] [-- extra `r2r bench serve` options]
#
# Defaults: r2r on core 0, the LLM on core 1 (a 2-core machine), 8 GSM8K dev prompts of up to 128 tokens at 1 and 4
# clients. Needs `make models` (the default pair) and the test extra's xllamacpp (llama.cpp's server).
set -euo pipefail
cd "$(dirname "$0")/.."
R2R_CORES=${1:-0}
LLM_CORES=${2:-1}
shift $(( $# >= 2 ? 2 : $# ))
[ "${1:-}" = "--" ] && shift
OUT=${OUT:-docs/results/overlap}
PORT=${PORT:-8091}
PY=.venv/bin/python
mkdir -p "$OUT"
count() { echo "$1" | tr ',' '\n' | wc -l; }
gguf=$($PY -c "from roads_to_rome.models import DEFAULT_LLM, gguf_path; print(gguf_path(DEFAULT_LLM))")

serve_llm() {  # cores threads: llama.cpp's server on those cores, until `stop_llm`
  taskset -c "$1" $PY scripts/llama-server.py "$gguf" --port "$PORT" --threads "$2" --slots 4 > "$OUT/llama-server.log" 2>&1 &
  LLM_PID=$!
  for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && return; sleep 1; done
  echo "llama.cpp's server did not start: see $OUT/llama-server.log" >&2; exit 1
}
stop_llm() { kill "$LLM_PID"; wait "$LLM_PID" 2> /dev/null || true; }
trap 'kill ${LLM_PID:-} 2> /dev/null || true' EXIT

# Each side on its own cores, one thread per core.
serve_llm "$LLM_CORES" "$(count "$LLM_CORES")"
taskset -c "$R2R_CORES" .venv/bin/r2r bench serve --llm "http://127.0.0.1:$PORT" --threads "slm=$(count "$R2R_CORES")" \
  --clients 1,4 --requests 8 --tokens 128 --systems r2r,r2r+overlap,llm,spec+k=4,spec+k=4+overlap \
  --out "$OUT/serve.json" "$@"
stop_llm
# The LLM alone at its fastest here: its own server on every core, asked directly.
serve_llm "$R2R_CORES,$LLM_CORES" "$(( $(count "$R2R_CORES") + $(count "$LLM_CORES") ))"
.venv/bin/r2r bench serve --llm "http://127.0.0.1:$PORT" --clients 1,4 --requests 8 --tokens 128 \
  --systems llm-direct --out "$OUT/direct.json" "$@"
stop_llm
