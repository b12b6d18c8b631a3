"""`r2r bench`: benchmarks that print ratios measured side by side in one run (bench.py measures)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.progress import Progress, TimeElapsedColumn

from roads_to_rome.backends import BACKENDS
from roads_to_rome.cli import tables
from roads_to_rome.cli.bench_shapes import bench_shapes
from roads_to_rome.cli.common import show_machine, whole_numbers
from roads_to_rome.cli.options import (
    BackendOpt,
    DeferGroup,
    DeferSteps,
    Device,
    Dtype,
    EntropyThreshold,
    Llm,
    MaxUnverified,
    Out,
    OverlapAhead,
    PrefixCacheTokens,
    Slm,
    Threads,
    VerifyList,
    console,
    count,
)
from roads_to_rome.errors import R2RError, require_extra
from roads_to_rome.routing import DEFAULT_ENTROPY_THRESHOLD

bench_app = typer.Typer(help="Benchmarks that print ratios measured side by side in one run. Without a "
                        "subcommand: every way to run the pair (each model alone, speculative, R2R) on each backend.",
                        invoke_without_command=True)


@bench_app.callback()
def bench_compare(
    ctx: typer.Context,
    prompts: int = count(4, "--prompts", help="GSM8K dev prompts (items 0..N-1), run one at a time."),
    tokens: int = count(128, "--tokens", help="Max new tokens per prompt."),
    router_path: Path | None = typer.Option(None, "--router-path",
                                            help="R2R's router (default: the shipped one, else entropy routing)."),
    threshold: float | None = typer.Option(None, "--threshold", help="R2R's threshold (default: the router's own)."),
    spec_k: str = typer.Option("4", "--spec-k", help="Comma-separated draft tokens per check, one speculative "
                               "system each (this engine: --router slm --verify strict --max-unverified k)."),
    verify: VerifyList = "1",  # verified R2R systems besides plain R2R
    max_unverified: MaxUnverified = None,
    backends: str = typer.Option("torch,llamacpp", "--backends", help="Which backends to run, comma-separated."),
    dtype: Dtype = "auto",
    out: Path | None = typer.Option(Path("runs/bench.json"), "--out", help="Write the figures as JSON here."),
):
    """Tokens/s of each model alone, speculative decoding and R2R (with and without verification), per backend,
    in one run."""
    if ctx.invoked_subcommand is not None:
        return
    require_extra("eval", "`r2r bench`")
    from roads_to_rome.bench.measure import compare
    from roads_to_rome.core.sampling import check_max_unverified, parse_verify_list
    from roads_to_rome.models.loading import pick_dtype

    dtype = pick_dtype(dtype, "cpu")
    ks = whole_numbers(spec_k, "--spec-k")
    names = [b.strip() for b in backends.split(",") if b.strip()]
    if not names or set(names) - set(BACKENDS):
        raise R2RError(f"--backends takes torch, llamacpp or both, got {backends!r}")
    settings = list(parse_verify_list(verify))
    check_max_unverified(max_unverified, any(v.on for v in settings))
    with Progress(console=console, transient=True) as progress:
        result = compare(prompts, tokens, dtype, router_path, threshold, ks, DEFAULT_ENTROPY_THRESHOLD, progress,
                         settings, max_unverified, tuple(names))
    console.print(*tables.bench_compare(result, prompts, tokens, dtype), sep="\n")
    save(result, out)


@bench_app.command("backends")
def bench_backends(
    prompts: int = count(3, "--prompts", help="GSM8K dev prompts (items 0..N-1)."),
    tokens: int = count(128, "--tokens", help="Answer tokens per prompt (written by the SLM on llama.cpp)."),
    router_path: Path | None = typer.Option(None, "--router-path",
                                            help="Router to compare (default: the shipped one)."),
    threshold: EntropyThreshold = DEFAULT_ENTROPY_THRESHOLD, dtype: Dtype = "auto", out: Out = None,
):
    """Torch vs llama.cpp SLM features: hidden-state cosine, argmax and routing decisions agreement."""
    require_extra("eval", "`r2r bench backends`")
    from roads_to_rome.bench.measure import backend_agreement
    from roads_to_rome.models.loading import pick_dtype

    dtype = pick_dtype(dtype, "cpu")
    with Progress(console=console, transient=True) as progress:
        result = backend_agreement(prompts, tokens, router_path, threshold, dtype, progress)
    console.print(tables.bench_backends(result, prompts, threshold, dtype))
    save(result, out)


@bench_app.command("overhead")
def bench_overhead(
    tokens: int = count(256, "--tokens", help="New tokens per generation."),
    rounds: int = count(3, "--rounds", help="Alternating rounds of each; medians are compared."),
    compile: bool = typer.Option(False, "--compile",
                                 help="Also the static-cache loop compiled by torch.compile "
                                 "(minutes to compile on a CPU)."),
    slm: Slm = None, device: Device = "auto", dtype: Dtype = "auto", out: Out = None,
):
    """Engine overhead: R2R with the always-SLM policy against a bare SLM forward loop, same prompt."""
    require_extra("eval", "`r2r bench overhead`")
    from roads_to_rome.bench.measure import overhead
    from roads_to_rome.models.loading import pick_dtype

    dtype = pick_dtype(dtype, device)
    with Progress(console=console, transient=True) as progress:
        result = overhead(slm, device, dtype, tokens, rounds, compile, progress)
    console.print(*tables.bench_overhead(result, tokens), sep="\n")
    save(result, out)


@bench_app.command("batch")
def bench_batch(
    batch_size: int = count(4, "--batch-size"),
    tokens: int = count(128, "--tokens", help="Max new tokens per prompt."),
    threshold: EntropyThreshold = DEFAULT_ENTROPY_THRESHOLD,
    slm: Slm = None, llm: Llm = None, device: Device = "auto", dtype: Dtype = "auto", backend: BackendOpt = "auto",
    out: Out = None,
):
    """Batching: R2R on N GSM8K dev prompts one at a time vs in one batch (aggregate tokens/s)."""
    require_extra("eval", "`r2r bench batch`")
    from roads_to_rome.bench.measure import batching
    from roads_to_rome.models.loading import pick_dtype

    dtype = pick_dtype(dtype, device)
    result = batching(slm, llm, device, dtype, threshold, batch_size, tokens, backend)
    show_phases(result, ("sequential", "batched"), f"batch {batch_size}", out)


@bench_app.command("serve")
def bench_serve(
    clients: str = typer.Option("1,4", "--clients", help="Comma-separated numbers of concurrent clients, one run "
                                "each (the server holds as many requests at once as the largest)."),
    requests: int = count(8, "--requests", help="GSM8K dev prompts (items 0..N-1) each run answers."),
    tokens: int = count(128, "--tokens", help="max_tokens per request."),
    systems: str = typer.Option("r2r,r2r+overlap,llm,spec+k=4", "--systems", help="Comma-separated systems, one "
                                "server each, the first the baseline of the ratios: r2r (the LLM's calls in the step), "
                                "r2r+overlap (beside the SLM's steps), r2r+defer=continue|park (grouped), "
                                "r2r+force=slm|llm (R2R's server, each request forcing one model; +force=llm/N: "
                                "every N-th, the others routed), llm or slm (one model alone behind the same server "
                                "and backends), llm-direct (the LLM's own server, "
                                "with --llm http://...), spec+k=K (speculative decoding: the SLM drafts K, the LLM "
                                "checks; +overlap too)."),
    defer_group: DeferGroup = None, defer_steps: DeferSteps = None, overlap_ahead: OverlapAhead = None,
    rounds: int = count(1, "--rounds", help="Times over, the systems taking turns (figures pool the rounds; a "
                        "machine's speed drifts between minutes)."),
    threshold: float | None = typer.Option(None, "--threshold", help="The routing threshold (default: the "
                                           "policy's own)."),
    slm: Slm = None, llm: Llm = None, device: Device = "auto", dtype: Dtype = "auto", backend: BackendOpt = "auto",
    threads: Threads = None, out: Out = None,
):
    """Serving under load through the HTTP server: throughput and per-request latency (p50, p95) at each number of
    concurrent clients, R2R's ways of calling the LLM beside the LLM alone and speculative decoding, in one run."""
    require_extra("serve", "`r2r bench serve`")
    require_extra("eval", "`r2r bench serve`")
    from roads_to_rome.bench.serving import ServedSystem, serving
    from roads_to_rome.core.llm_calls import Deferral
    from roads_to_rome.models.loading import parse_threads, pick_dtype

    counts = whole_numbers(clients, "--clients")
    names = [m.strip() for m in systems.split(",") if m.strip()]
    if not counts or not names:
        raise R2RError(f"--clients takes whole numbers and --systems names; got --clients {clients!r} --systems "
                       f"{systems!r}")
    ServedSystem.check(names, llm, threshold, defer_group, defer_steps, overlap_ahead)
    rule = Deferral.of("off", defer_group, defer_steps, overlap_ahead)
    dtype = pick_dtype(dtype, device)
    with Progress(*Progress.get_default_columns(), TimeElapsedColumn(), console=console, transient=True) as progress:
        result = serving(slm, llm, device, dtype, counts, tokens, requests, names, rule, backend, threshold, rounds,
                         progress, parse_threads(threads))
    console.print(tables.bench_serve(result))
    save(result, out)


@bench_app.command("prefix")
def bench_prefix(
    clients: int = count(2, "--clients", help="Conversations held at once, one client each."),
    turns: int = count(4, "--turns", help="Questions per conversation (GSM8K dev items, each client its own)."),
    tokens: int = count(128, "--tokens", help="max_tokens per turn."),
    prefix_cache_tokens: PrefixCacheTokens = 16384,
    rounds: int = count(1, "--rounds", help="Times over, the two servers taking turns (figures pool the rounds)."),
    shots: int = typer.Option(0, "--shots", min=0, help="A system message of this many worked GSM8K solutions opens "
                              "every conversation, the same for all (few-shot prompting; an agent's long "
                              "instructions); the clients then arrive one after another."),
    n: int = count(1, "--n", help="Choices per turn (sampled at temperature 0.7, seeded; the conversation goes on "
                   "with the first): with prefix caching they read their prompt once."),
    slm: Slm = None, llm: Llm = None, device: Device = "auto", dtype: Dtype = "auto", backend: BackendOpt = "auto",
    threads: Threads = None, out: Out = None,
):
    """Prefix caching: multi-turn conversations through the server with it and without, side by side. Each turn's
    prompt holds the conversation so far; with prefix caching each model reads only what it has not kept (with
    --shots, also the system message every conversation shares). Time to the first token per turn and the
    conversations' seconds, in one run (a plot beside --out's JSON)."""
    require_extra("serve", "`r2r bench prefix`")
    require_extra("eval", "`r2r bench prefix`")
    from roads_to_rome.bench.serving import conversations, plot_conversations
    from roads_to_rome.data.benchmarks import GSM8K_DEV_ITEMS
    from roads_to_rome.models.loading import parse_threads, pick_dtype

    if prefix_cache_tokens < 1:
        raise R2RError("--prefix-cache-tokens is what the server with prefix caching keeps: give 1 or more")
    if clients * turns + shots > GSM8K_DEV_ITEMS:
        raise R2RError(f"--clients x --turns questions and --shots examples come from the {GSM8K_DEV_ITEMS} GSM8K "
                       f"dev items without overlapping: ask for {GSM8K_DEV_ITEMS} or fewer in all")
    dtype = pick_dtype(dtype, device)
    with Progress(*Progress.get_default_columns(), TimeElapsedColumn(), console=console, transient=True) as progress:
        result = conversations(slm, llm, device, dtype, clients, turns, tokens, backend, prefix_cache_tokens, rounds,
                               progress, parse_threads(threads), shots, n)
    console.print(tables.bench_prefix(result))
    save(result, out)
    if out:
        plot_conversations(result, out.with_suffix(".png"))
        console.print(f"plot in {out.with_suffix('.png')}")


@bench_app.command("priority")
def bench_priority(
    batch_clients: int = count(2, "--batch-clients", help="Clients of a batch job sending questions back to back, "
                               "as many as the batch holds (--max-batch)."),
    urgent: int = count(4, "--urgent", help="Urgent questions, one after another once the batch is full."),
    tokens: int = count(256, "--tokens", help="max_tokens of a batch job's request."),
    urgent_tokens: int = count(32, "--urgent-tokens", help="max_tokens of an urgent request."),
    rounds: int = count(1, "--rounds", help="Times over, the two servers taking turns (figures pool the rounds)."),
    slm: Slm = None, llm: Llm = None, device: Device = "auto", dtype: Dtype = "auto", backend: BackendOpt = "auto",
    threads: Threads = None, out: Out = None,
):
    """Priority scheduling: urgent requests on a server whose batch a batch job fills, scheduled first come first
    served and by priority (preempting), side by side. Each urgent request's time to its first token and to its
    last, the batch job's tokens per second, in one run (a plot beside --out's JSON)."""
    require_extra("serve", "`r2r bench priority`")
    require_extra("eval", "`r2r bench priority`")
    from roads_to_rome.bench.serving import plot_urgency, urgent_requests
    from roads_to_rome.data.benchmarks import GSM8K_DEV_ITEMS
    from roads_to_rome.models.loading import parse_threads, pick_dtype

    if urgent + batch_clients > GSM8K_DEV_ITEMS:
        raise R2RError(f"--urgent and the batch job's questions come from the {GSM8K_DEV_ITEMS} GSM8K dev items: ask "
                       "for fewer")
    dtype = pick_dtype(dtype, device)
    with Progress(*Progress.get_default_columns(), TimeElapsedColumn(), console=console, transient=True) as progress:
        result = urgent_requests(slm, llm, device, dtype, batch_clients, urgent, tokens, urgent_tokens, backend,
                                 rounds, progress, parse_threads(threads))
    console.print(tables.bench_priority(result))
    save(result, out)
    if out:
        plot_urgency(result, out.with_suffix(".png"))
        console.print(f"plot in {out.with_suffix('.png')}")


def show_phases(result: dict, modes: tuple[str, str], setting: str, out: Path | None) -> None:
    """Print a two-phase throughput comparison (baseline first) and its ratio; optionally save it."""
    console.print(*tables.phases(result, modes, setting), sep="\n")
    save(result, out)


@bench_app.command("steps")
def bench_steps(
    context: int = count(300, "--context", help="Tokens already in the KV cache."),
    new_tokens: str = typer.Option("1,2,4,8,16,32", "--new-tokens", help="Comma-separated k values."),
    rows: str = typer.Option("1", "--rows", help="Comma-separated numbers of rows each step reads (a batch's): "
                             "above 1, the cost of k new tokens in each of that many rows, beside one row's one."),
    slm: Slm = None, llm: Llm = None, device: Device = "auto", dtype: Dtype = "auto", backend: BackendOpt = "auto",
    out: Out = None,
):
    """Per-step cost of each model for k new tokens (the inputs of the cost model), over one row or several (what a
    batch's step and a grouped LLM call read)."""
    require_extra("eval", "`r2r bench steps`")
    from roads_to_rome.bench.measure import step_costs
    from roads_to_rome.models.loading import pick_dtype

    dtype = pick_dtype(dtype, device)
    ks = whole_numbers(new_tokens, "--new-tokens")
    if not ks:
        raise R2RError("every --new-tokens value must be at least 1")
    row_counts = whole_numbers(rows, "--rows")
    if not row_counts:
        raise R2RError("--rows takes comma-separated whole numbers: give at least one")
    with Progress(console=console, transient=True) as progress:
        result = step_costs(slm, llm, device, dtype, context, ks, backend, progress, tuple(row_counts))
    console.print(tables.bench_steps(result, ks, backend, dtype, context))
    save(result, out)


@bench_app.command("remote")
def bench_remote(
    llm: str = typer.Option(..., "--llm", help="The LLM's server: http://host:port (as `--llm` elsewhere)."),
    backend: BackendOpt = "llamacpp",
    context: int = count(300, "--context", help="Tokens the server (or the local cache) already holds."),
    new_tokens: str = typer.Option("1,4,16", "--new-tokens", help="Comma-separated catch-up sizes k."),
    prompts: int = count(2, "--prompts", help="GSM8K dev prompts for the tokens/s comparison."),
    tokens: int = count(128, "--tokens", help="Max new tokens per prompt."),
    dtype: Dtype = "auto", out: Out = None,
):
    """The LLM behind a server vs the same LLM here: catch-up latency for k new tokens (prefix cached, and
    cold), and R2R's tokens/s with either LLM, in one run."""
    require_extra("eval", "`r2r bench remote`")
    from roads_to_rome.bench.measure import remote
    from roads_to_rome.models.loading import pick_dtype

    dtype = pick_dtype(dtype, "cpu")
    ks = whole_numbers(new_tokens, "--new-tokens")
    with Progress(console=console, transient=True) as progress:
        result = remote(llm, backend, dtype, context, ks, prompts, tokens, progress=progress)
    console.print(*tables.bench_remote(result, ks), sep="\n")
    save(result, out)


def save(result: dict, out: Path | None) -> None:
    """Name the machine the figures came from (on screen and in the JSON); write them to `out` if given."""
    from roads_to_rome.bench.measure import processor

    result["processor"] = processor()
    show_machine(result["processor"], result)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        console.print(f"JSON in {out}")


bench_app.command("shapes")(bench_shapes)
