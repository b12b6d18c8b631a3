"""`r2r bench shapes`: the default SLM with LLMs of real sizes (bench/shapes.py measures), its options checked into a
`Plan`, and what it prints and writes."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.progress import Progress, TimeElapsedColumn

from roads_to_rome.cli import tables
from roads_to_rome.cli.common import show_machine, whole_numbers
from roads_to_rome.cli.options import (
    BackendOpt,
    DeferGroup,
    DeferSteps,
    Device,
    OverlapAhead,
    VerifyList,
    console,
    count,
)
from roads_to_rome.errors import R2RError, require_extra


def bench_shapes(
    llm_shape: str = typer.Option("qwen2.5-coder-3b,qwen2.5-coder-7b,qwen2.5-coder-14b", "--llm-shape",
                                  help="Comma-separated LLM shapes, each built once (random weights, Q4_K_M) from its "
                                  "published configuration: qwen2.5-coder-0.5b, -1.5b, -3b, -7b, -14b, -32b, "
                                  "r1-distill-qwen-1.5b, -32b (qwen2); qwen3-0.6b, qwen3-8b (torch only)."),
    slm_shape: str = typer.Option("", "--slm-shape", help="A random-weight SLM of this shape (torch) instead of the "
                                  "default SLM as shipped, with a random router of its size; for machines without the "
                                  "prepared weights, such as a GPU box that gets only the tokenizer."),
    llm_share: str = typer.Option("0.05,0.1,0.15,0.2", "--llm-share", help="Comma-separated shares of tokens the LLM "
                                  "writes (routed at random), one R2R system each."),
    prompts: int = count(4, "--prompts", help="GSM8K dev prompts (items 0..N-1), one at a time."),
    tokens: int = count(256, "--tokens", help="New tokens per prompt (EOS ignored)."),
    context: int = count(300, "--context", help="Tokens in the KV cache for the per-step costs."),
    new_tokens: str = typer.Option("1,2,4,8,16,32,64", "--new-tokens", help="Catch-up sizes k whose cost is measured."),
    verify: VerifyList = "1",  # whose acceptance the real pair measures
    spec_k: str = typer.Option("4", "--spec-k", help="Speculative decoding's draft lengths, measured on the real pair "
                               "(comma-separated; empty: none)."),
    batch: str = typer.Option("1", "--batch", help="Comma-separated batch sizes (prompts decoded together); batch b "
                              "runs the first multiple of b at least --prompts prompts."),
    real_from: Path = typer.Option(None, "--real-from", help="With --slm-shape: a results file of this command whose "
                                   "real-pair runs give the † rows (routing, verification and speculative "
                                   "acceptance)."),
    cuda_graphs: bool = typer.Option(True, "--cuda-graphs/--no-cuda-graphs", help="On CUDA, reads of up to 64 tokens "
                                     "as CUDA graphs, or transformers' eager forwards (to see what graphs buy)."),
    compile: str = typer.Option("slm", "--compile", help="On CUDA, whose graphs record its trunk compiled by "
                                "torch.compile: slm (the default, as r2r runs it), llm, slm,llm, or none "
                                "(transformers' own kernels, to see what compiling buys)."),
    defer: str = typer.Option("continue,park", "--defer", help="Deferral modes run beside lockstep R2R at each "
                              "batch above 1 (comma-separated: continue, park; empty: none)."),
    defer_group: DeferGroup = None, defer_steps: DeferSteps = None,
    overlap: str = typer.Option("", "--overlap", help="Comma-separated batch sizes (of --batch) at which R2R also "
                                "runs with the LLM's calls beside the SLM's steps (--overlap on: on CUDA on a stream "
                                "of their own), with lockstep's rule and each --defer mode; empty: none."),
    overlap_ahead: OverlapAhead = None,
    backend: BackendOpt = "llamacpp", device: Device = "auto",
    build_only: bool = typer.Option(False, "--build-only", help="Only build the shapes' files (llama.cpp)."),
    out: Path = typer.Option(Path("runs/bench-shapes.json"), "--out", help="Results (JSON; a re-run with the same "
                             "settings resumes from it) and the plot beside it."),
):
    """The default SLM with LLMs of real sizes: tokens/s of the LLM alone and of R2R at fixed LLM shares, measured
    with random-weight models of each shape, beside the cost model's figures from per-step costs measured in the
    same run; verification and speculative decoding predicted from the real pair's forwards; on torch,
    transformers' assisted generation beside them."""
    require_extra("eval", "`r2r bench shapes`")
    from roads_to_rome.bench import shapes as bench_shapes_module

    plan = shapes_plan(llm_shape, slm_shape, llm_share, prompts, tokens, context, new_tokens, verify, spec_k, batch,
                       real_from, cuda_graphs, compile, defer, defer_group, defer_steps, backend, device, overlap,
                       overlap_ahead)
    saved = json.loads(out.read_text()) if out.exists() else None

    def keep(result):
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))

    with Progress(*Progress.get_default_columns(), TimeElapsedColumn(), console=console) as progress:
        result = bench_shapes_module.measure(plan, saved, keep, progress, build_only)
    keep(result)
    show_shapes(result, out, build_only)


def shapes_plan(llm_shape, slm_shape, llm_share, prompts, tokens, context, new_tokens, verify, spec_k, batch,
                real_from, cuda_graphs, compile, defer, defer_group, defer_steps, backend, device, overlap,
                overlap_ahead):
    """`r2r bench shapes`'s options, checked, as the `Plan` it runs."""
    from roads_to_rome.bench import shape_models
    from roads_to_rome.bench.shapes import Plan
    from roads_to_rome.core.llm_calls import Deferral
    from roads_to_rome.core.sampling import parse_verify_list

    chosen = shape_models.parse_shapes(llm_shape)
    if backend not in ("llamacpp", "torch"):
        raise R2RError(f"--backend for shapes is llamacpp (a built GGUF) or torch (from the configuration), "
                       f"got {backend!r}")
    compiled = tuple(r.strip() for r in compile.split(",") if r.strip() and r.strip() != "none")
    if set(compiled) - {"slm", "llm"}:
        raise R2RError(f"--compile takes slm, llm, slm,llm or none, got {compile!r}")
    if backend == "llamacpp" and (other := [s.name for s in chosen if s.arch != "qwen2"]):
        raise R2RError(f"{', '.join(other)}: a qwen3 model; the GGUF builder writes qwen2 models, use --backend torch")
    if slm_shape and backend != "torch":
        raise R2RError("--slm-shape builds the SLM with transformers: use it with --backend torch")
    if real_from and not slm_shape:
        raise R2RError("--real-from goes with --slm-shape (with the default SLM the real pair is measured in the run)")
    if real_from and not real_from.exists():
        raise R2RError(f"--real-from {real_from} does not exist")
    modes = tuple(m.strip() for m in defer.split(",") if m.strip())
    if set(modes) - {"continue", "park"}:
        raise R2RError(f"--defer for shapes takes continue, park or both, got {defer!r}")
    batches = tuple(whole_numbers(batch, "--batch")) or (1,)
    overlapped = tuple(whole_numbers(overlap, "--overlap"))
    if set(overlapped) - set(batches):
        raise R2RError(f"--overlap {overlap}: batches of --batch ({batch}) only")
    if overlapped and backend != "torch":
        raise R2RError("--overlap for shapes runs the LLM on torch beside the SLM: use it with --backend torch")
    return Plan(shapes=tuple(chosen), shares=tuple(shape_models.parse_shares(llm_share)), prompts=prompts,
                tokens=tokens, context=context, step_tokens=tuple(whole_numbers(new_tokens, "--new-tokens")),
                verify=parse_verify_list(verify), spec_k=tuple(whole_numbers(spec_k, "--spec-k")), backend=backend,
                device=device, slm_shape=shape_models.parse_shape(slm_shape) if slm_shape else None,
                batches=batches, overlap=overlapped,
                real_from=str(real_from) if real_from else None, cuda_graphs=cuda_graphs, compile=compiled,
                defer=modes, deferral=Deferral.of("off", defer_group, defer_steps, overlap_ahead))


def show_shapes(result: dict, out: Path, build_only: bool) -> None:
    """What `r2r bench shapes` prints, and its Markdown table and plot beside the JSON."""
    from roads_to_rome.bench import shapes_report

    if build_only:
        for name, entry in result["shapes"].items():
            build = entry["build"]
            console.print(f"{name}: {build['path']} ({build['bytes'] / 1e9:.2f} GB)")
        return
    console.print(*tables.bench_shapes(result), sep="\n")
    plot = shapes_report.plot(result, out.with_suffix(".png"))
    out.with_suffix(".md").write_text(shapes_report.markdown(result))
    where = f"{result['device_name']} ({result['processor']})" if result.get("device_name") else result["processor"]
    show_machine(where, result)
    console.print(f"JSON in {out}, Markdown table and plot beside it ({plot})")
