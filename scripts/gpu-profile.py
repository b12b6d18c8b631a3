"""Where one R2R step's time goes at batch 1 on CUDA, and what the SLM's read costs done other ways.

For a random-weight SLM of a published shape (default: DeepSeek-R1-Distill-Qwen-1.5B), each variant of its read
(--variants) is measured in this one process:
  - the graphed one-token read alone (CUDA events around replays) and the kernels one replay launches
    (torch.profiler);
  - `forward` as the engine calls it (read, output head, float32 logits), host clock after a sync;
  - the engine's decode step with the router running every step and routing nothing (the SLM's own cost in R2R):
    ms per token and its phases (the engine's timings: propose, route, the rest);
  - the SLM alone through the engine.
The first variant's engine steps are also profiled op by op (tables under --out).

Variants: `graphs` (the trunk's kernels as transformers launches them, recorded as a graph), `compiled` (the trunk
compiled by torch.compile, then recorded: the backend's default), `autotuned` (compiled with inductor's
max-autotune, which times Triton matrix-product kernels against cuBLAS's for each shape, the one-row ones included),
`fused-norms` (the RMSNorms as torch.nn.RMSNorm, uncompiled). A one-token replay includes the output head (the
backend records it in the same graph). Run on the device with scripts/gpu-run.sh; on a CPU it dry-runs the engine parts.

    python scripts/gpu-profile.py --out runs/gpu/profile.json [--layers 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from roads_to_rome.backends.torch_backend import TorchBackend
from roads_to_rome.bench.shape_models import SHAPES, default_tokenizer, random_router, torch_shape
from roads_to_rome.bench.stand_ins import RouterAtShare
from roads_to_rome.core.engine import Engine
from roads_to_rome.core.sampling import SamplingParams


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cuda_ms(run, repeats: int = 200) -> float:
    """Median GPU milliseconds of `run` (CUDA events around each call)."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_ms(run, repeats: int = 100) -> float:
    """Median wall milliseconds of `run` followed by a sync."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def kernels_per_call(run, calls: int = 10) -> tuple[float, list[tuple[str, int, float]]]:
    """Kernels launched per call of `run`, and the kernels by name: (name, launches per call, GPU µs per call)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        synchronize()
    rows = [(e.key, e.count / calls, e.device_time_total / calls) for e in prof.key_averages()
            if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[2])
    return sum(r[1] for r in rows), rows


def fuse_norms(model) -> None:
    """Each RMSNorm module swapped for torch's own (F.rms_norm: one fused kernel where torch has it), same weights."""
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RMSNorm"):
            fused = torch.nn.RMSNorm(module.weight.shape, eps=module.variance_epsilon, device=module.weight.device,
                                     dtype=module.weight.dtype)
            fused.weight = module.weight
            model.set_submodule(name, fused)


def make_variant(name: str, model, vocab: int) -> TorchBackend:
    if name == "fused-norms":  # (changes the model: run it last)
        fuse_norms(model)
    backend = TorchBackend(model, name=name, vocab_size=vocab, compile=name in ("compiled", "autotuned"))
    if name == "autotuned":
        torch._dynamo.reset()  # dynamo's cache of the same trunk would otherwise serve the default mode's kernels
        backend.compiled_trunk = torch.compile(backend.trunk, mode="max-autotune-no-cudagraphs")
    return backend


def measure(name: str, model, tokenizer, prompt: list[int], tokens: int, out: Path, trace: bool) -> dict:
    slm = make_variant(name, model, len(tokenizer))
    result = {"variant": name, "kernels": slm.kernels}
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    started = time.perf_counter()
    alone = Engine.alone(slm, tokenizer, "slm")
    alone.generate([prompt[:32]], SamplingParams(max_new_tokens=4, ignore_eos=True))  # captures (and compiles)
    synchronize()
    result["warm_up_s"] = time.perf_counter() - started

    # The one-token read: forward as the engine calls it, and the graph's replay alone.
    cache = slm.new_cache()
    ids = torch.tensor([prompt], device=slm.device)
    mask = torch.ones(1, len(prompt) + 1, dtype=torch.long, device=slm.device)
    slm.forward(cache, ids, mask[:, :-1])
    last = torch.tensor([[prompt[-1]]], device=slm.device)

    def one_forward():
        slm.forward(cache, last, mask)
        slm.truncate(cache, len(prompt))

    one_forward()
    result["forward_ms"] = host_ms(one_forward)
    hidden = torch.randn(1, 1, slm.hidden_size, device=slm.device, dtype=slm.dtype)
    if slm.device.type == "cuda":
        step = slm.pool.graphs[cache.kv][1]
        result["replay_ms"] = cuda_ms(step.graph.replay)
        result["head_ms"] = cuda_ms(lambda: slm._logits(hidden))
        result["argmax_ms"] = cuda_ms(lambda: slm._logits(hidden).argmax(-1))
        result["kernels_per_replay"], by_name = kernels_per_call(step.graph.replay)
        result["replay_kernels"] = [{"name": n, "per_call": c, "us_per_call": us} for n, c, us in by_name[:25]]
        result["kernels_per_forward"], _ = kernels_per_call(one_forward)
        result["host_ms"] = result["forward_ms"] - result["replay_ms"]  # what forward adds to the replay

    # The SLM in R2R: the router runs every step and routes nothing, so every step is the SLM's own cost.
    router = random_router(slm)
    r2r = Engine(slm, slm, tokenizer, RouterAtShare(router, 0.0))
    r2r.generate([prompt[:32]], SamplingParams(max_new_tokens=4, ignore_eos=True))
    for label, engine in (("r2r_router_only", r2r), ("slm_alone", alone)):
        synchronize()
        start = time.perf_counter()
        gen = engine.generate([prompt], params)[0]
        synchronize()
        t = gen.timings  # per step, the first one (which reads the prompt) included
        result[label] = {"tokens_per_s": len(gen.token_ids) / (time.perf_counter() - start),
                         "ms_per_step": 1000 * t.total_s / t.steps, "propose_ms": 1000 * t.slm_s / t.steps,
                         "route_ms": 1000 * t.router_s / t.steps,
                         "rest_ms": 1000 * (t.total_s - t.slm_s - t.router_s - t.llm_s) / t.steps, "steps": t.steps}
    if trace:  # what each decode step does on the host and the device, op by op
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        steps = r2r.stream([prompt], SamplingParams(max_new_tokens=40, ignore_eos=True))
        for _ in range(8):
            next(steps)
        with profile(activities=activities) as prof:
            for _ in range(16):
                next(steps)
            synchronize()
        for key in ("cpu_time_total", "device_time_total") if torch.cuda.is_available() else ("cpu_time_total",):
            table = prof.key_averages().table(sort_by=key, row_limit=40, max_name_column_width=60)
            (out.parent / f"profile-{name}-{key}.txt").write_text(table)
        for _ in steps:
            pass
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slm-shape", default="r1-distill-qwen-1.5b")
    parser.add_argument("--variants", default="graphs,compiled")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--context", type=int, default=300, help="prompt tokens (random ids)")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape (a dry run)")
    parser.add_argument("--out", type=Path, default=Path("runs/gpu/profile.json"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.slm_shape]
    if args.layers:
        from dataclasses import replace

        shape = replace(shape, layers=args.layers)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = torch_shape(shape, device, torch.bfloat16 if device == "cuda" else torch.float32)
    tokenizer = default_tokenizer()
    prompt = torch.randint(1000, 20000, (args.context,)).tolist()
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "shape": shape.name, "layers": shape.layers, "context": args.context, "variants": []}
    for i, name in enumerate(args.variants.split(",")):
        report["variants"].append(measure(name, model, tokenizer, prompt, args.tokens, args.out, trace=i == 0))
        args.out.write_text(json.dumps(report, indent=1))
        v = report["variants"][-1]
        print(json.dumps({k: v[k] for k in v if k != "replay_kernels"}, indent=1), flush=True)
    for v in report["variants"]:
        print(f"{v['variant']:>10}: replay {v.get('replay_ms', float('nan')):.3f} ms, "
              f"{v.get('kernels_per_replay', 0):.0f} kernels; forward {v['forward_ms']:.3f} ms; R2R step (router, "
              f"nothing routed) {v['r2r_router_only']['ms_per_step']:.3f} ms; SLM alone "
              f"{v['slm_alone']['ms_per_step']:.3f} ms; warm-up {v['warm_up_s']:.1f} s")


if __name__ == "__main__":
    main()
