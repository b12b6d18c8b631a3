"""MKL's own code paths against its AUTO branch (MKL_CBWR= vs MKL_CBWR=AUTO) for the default pair on torch in
float32, side by side in one run: each model's one-token decode step over 1, 2, 4 and 8 rows, a prompt's read,
and R2R itself (`r2r bench batch`: one batch of prompts against the same prompts one at a time). MKL reads the
branch once, when it loads, so each arm runs in a process of its own. The package picks AUTO on AMD processors
(hardware.py); this is the measurement behind that choice, and the way to check it on another processor.

    .venv/bin/python scripts/mkl-branch.py --out docs/results/DATE-mkl-branch/steps.json
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BRANCHES = ("", "AUTO")  # (empty: MKL's own choice)
ROWS = (1, 2, 4, 8)


def measure(tokens: int) -> dict:
    """In this process: each model's decode step (ms) over each number of rows, and one prompt read (ms)."""
    from roads_to_rome import hardware
    from roads_to_rome.core.engine import Engine
    from roads_to_rome.core.sampling import SamplingParams
    from roads_to_rome.data.benchmarks import gsm8k, gsm8k_prompt
    from roads_to_rome.models import load_pair

    slm, llm, tokenizer = load_pair(None, None, "cpu", backend="torch", dtype="float32")
    result = {"processor": hardware.describe_cpu(), "MKL_CBWR": os.environ.get("MKL_CBWR"), "kernels": slm.kernels}
    for role, model in (("slm", slm), ("llm", llm)):
        engine = Engine.alone(model, tokenizer)
        prompts = [engine.prompts.chat(gsm8k_prompt(item)) for item in gsm8k()[:max(ROWS)]]

        def timed(rows: int, n: int) -> float:
            start = time.perf_counter()
            engine.generate(prompts[:rows], SamplingParams(max_new_tokens=n, ignore_eos=True))
            return time.perf_counter() - start

        timed(1, 2)  # (warm: the first call pays for allocation)
        steps = {}
        for rows in ROWS:
            steps[rows] = (timed(rows, tokens + 1) - timed(rows, 1)) / tokens * 1000
        result[role] = {"step_ms": steps, "prompt_read_ms": timed(1, 1) * 1000,
                        "prompt_tokens": len(prompts[0])}
    return result


def run_arm(branch: str, tokens: int) -> dict:
    env = {**os.environ, "MKL_CBWR": branch}
    done = subprocess.run([sys.executable, __file__, "--arm", "--tokens", str(tokens)], env=env,
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"the MKL_CBWR={branch} arm failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def r2r_batch(branch: str, batch: int, tokens: int) -> dict:
    """`r2r bench batch` on torch in float32 under one MKL path: R2R's tokens/s one at a time and in one batch."""
    out = Path(f"/tmp/mkl-branch-{branch or 'own'}.json")
    done = subprocess.run([sys.executable, "-m", "roads_to_rome", "bench", "batch", "--backend", "torch",
                           "--dtype", "float32", "--device", "cpu", "--batch-size", str(batch), "--tokens",
                           str(tokens), "--out", str(out)], env={**os.environ, "MKL_CBWR": branch},
                          capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"r2r bench batch under MKL_CBWR={branch} failed:\n{done.stderr[-2000:]}")
    return json.loads(out.read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16, help="decode steps timed per measurement")
    parser.add_argument("--batch", type=int, default=4, help="prompts in `r2r bench batch`")
    parser.add_argument("--batch-tokens", type=int, default=32, help="new tokens per prompt in `r2r bench batch`")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--arm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(measure(args.tokens)))
        return
    arms = {branch: run_arm(branch, args.tokens) for branch in BRANCHES}
    own, auto = (arms[b] for b in BRANCHES)
    print(f"{own['processor']}; {own['kernels']}; decode step in ms, MKL's own / MKL_CBWR=AUTO (ratio)")
    for role in ("slm", "llm"):
        pairs = [(own[role]["step_ms"][str(rows)], auto[role]["step_ms"][str(rows)]) for rows in ROWS]
        cells = [f"{rows} rows {a:.0f} / {b:.0f} ({a / b:.2f}x)" for rows, (a, b) in zip(ROWS, pairs)]
        a, b = own[role]["prompt_read_ms"], auto[role]["prompt_read_ms"]
        print(f"  {role}: " + ", ".join(cells) +
              f"; a {own[role]['prompt_tokens']}-token prompt {a:.0f} / {b:.0f} ({a / b:.2f}x)")
    batches = {branch: r2r_batch(branch, args.batch, args.batch_tokens) for branch in BRANCHES}
    print(f"r2r bench batch --batch-size {args.batch} --tokens {args.batch_tokens}, tokens/s, MKL's own / AUTO (ratio)")
    for phase in ("sequential", "batched"):
        a, b = (batches[branch][phase]["tokens_per_s"] for branch in BRANCHES)
        print(f"  {phase}: {a:.2f} / {b:.2f} ({b / a:.2f}x)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"steps": arms, "bench_batch": batches, "args": {**vars(args), "out": str(args.out)}}
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
