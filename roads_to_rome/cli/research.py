"""The research commands: `r2r eval`, `r2r train`, `r2r calibrate` and the label pipeline (`r2r label ...`)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.progress import TimeRemainingColumn
from typer.core import TyperGroup

from roads_to_rome.cli import tables
from roads_to_rome.cli.common import RateColumn, load_alone, progress_bar
from roads_to_rome.cli.options import (
    AsJson,
    BackendOpt,
    ChatTemplateOpt,
    Device,
    Dtype,
    JudgeKind,
    JudgeModel,
    JudgeUrl,
    Llm,
    MaxUnverified,
    RouterPath,
    Slm,
    VerifyList,
    console,
    count,
)
from roads_to_rome.errors import R2RError, require_extra


class DefaultRunGroup(TyperGroup):
    """`r2r label PROMPTS ...` means `r2r label run PROMPTS ...`; `r2r label report ...` stays itself."""

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["run", *args]
        return super().parse_args(ctx, args)



router_app = typer.Typer(no_args_is_help=True, help="Routers from and for the paper's reference code (thu-nics/R2R).")


@router_app.command("import")
def router_import(
    file: Path = typer.Argument(..., help="A reference router checkpoint (.pt), e.g. the R1 pair's published one."),
    out: Path = typer.Option(..., "--out", help="The router directory to write (then: --router-path DIR)."),
    slm: Slm = None, device: Device = "auto", dtype: Dtype = "auto", backend: BackendOpt = "auto",
):
    """Turn a reference checkpoint into this project's router format, for the SLM it was trained on."""
    from roads_to_rome.routing.router import import_reference

    if not file.is_file():
        raise R2RError(f"{file}: no such file")
    slm_engine = load_alone(slm, "slm", device, dtype, backend)
    ckpt = import_reference(file, slm_engine.slm, out)
    params = sum(p.numel() for p in ckpt.router.parameters())
    console.print(f"router saved to {out} ({params / 1e6:.1f}M parameters, threshold {ckpt.threshold:.4f}, for "
                  f"{slm_engine.slm.name}): use it with --router-path {out}")


@router_app.command("export")
def router_export(
    path: Path = typer.Argument(..., help="A router directory of the reference architecture (`r2r train "
                                "--architecture reference`, or imported)."),
    out: Path = typer.Option(..., "--out", help="The .pt file to write, in the reference's format."),
):
    """Write a router in the reference's checkpoint format, so that the reference's code runs it."""
    from roads_to_rome.routing.router import export_reference

    export_reference(path, out)
    console.print(f"wrote {out}")


label_app = typer.Typer(cls=DefaultRunGroup, no_args_is_help=True,
                        help="The routing-label pipeline: `r2r label PROMPTS --out DIR`, `r2r label report DIR`.")


def eval_command(
    benchmark: str = typer.Option(..., "--benchmark", help="gsm8k, aime2025, gpqa, humaneval or humaneval-infill "
                                  "(single-line fill in the middle)."),
    systems: str = typer.Option("slm,llm,entropy,random", "--systems",
                                help="Comma-separated: slm,llm,r2r,entropy,random,"
                                "spec (speculative decoding: the SLM drafts --spec-k tokens, the LLM checks them)."),
    ids: str | None = typer.Option(None, "--ids", help="Items by position: 0-199, or 0,5,9-12 (default: all)."),
    max_new_tokens: int = count(512, "--max-new-tokens"),
    out: Path = typer.Option(Path("runs/eval"), "--out", help="Results go to OUT/BENCHMARK/."),
    router_path: RouterPath = None,
    threshold: float | None = typer.Option(None, "--threshold",
                                           help="r2r: the router's threshold (default: its calibrated one)."),
    llm_rate: float | None = typer.Option(None, "--llm-rate", min=0, max=1,
                                          help="entropy/random target LLM rate when r2r is not among the systems "
                                          "(default 0.15).", show_default=False),
    sweep: str | None = typer.Option(None, "--sweep",
                                     help="Comma-separated r2r thresholds (or entropy LLM rates without a router)."),
    batch_size: int = count(1, "--batch-size", help="Items decoded together."),
    verify: VerifyList = "off",  # for r2r, entropy and random: one system each, e.g. r2r+verify=1
    max_unverified: MaxUnverified = None,
    spec_k: int | None = typer.Option(None, "--spec-k", min=1, help="Draft tokens per check for the spec system "
                                      "(default 4).", show_default=False),
    chat_template: ChatTemplateOpt = None,
    slm: Slm = None, llm: Llm = None, device: Device = "auto", dtype: Dtype = "auto", backend: BackendOpt = "auto",
):
    """Evaluate systems on a benchmark: accuracy with 95% CI, LLM rate, avg. params, speed; JSON, table, plots, HTML."""
    require_extra("eval", "`r2r eval`")
    from roads_to_rome.core.sampling import parse_verify_list
    from roads_to_rome.eval.evaluate import EvalConfig, evaluate, markdown_table

    try:
        sweep_values = tuple(float(v) for v in sweep.split(",")) if sweep else ()
    except ValueError:
        raise R2RError(f"--sweep takes comma-separated numbers, got {sweep!r}") from None
    config = EvalConfig(benchmark=benchmark, systems=tuple(s.strip() for s in systems.split(",") if s.strip()),
                        out=out, ids=ids, max_new_tokens=max_new_tokens, batch_size=batch_size, slm=slm, llm=llm,
                        device=device, dtype=dtype, backend=backend, router_path=router_path, threshold=threshold,
                        llm_rate=llm_rate, sweep=sweep_values, verify=parse_verify_list(verify),
                        max_unverified=max_unverified, spec_k=spec_k, chat_template=chat_template)
    table = evaluate(config, console)
    console.print(markdown_table(table), markup=False, highlight=False)
    console.print(f"results, summary.json, plots and report.html in {out / benchmark}")


def train(
    datasets: list[Path] = typer.Argument(..., help="Label datasets (output directories of `r2r label`). With several, "
                                          "a prompt comes from the first that judged it: give answer labels "
                                          "first, facts labels after them."),
    out: Path = typer.Option(Path("runs/router"), "--out",
                             help="Checkpoint directory (router.safetensors + router.json)."),
    objective: str = typer.Option("divergent", "--objective",
                                  help="divergent (the judge's verdict) or different (any mismatch)."),
    inputs: str = typer.Option("hidden,token,logits", "--inputs", help="Comma-separated router inputs."),
    dim: int = count(128, "--dim", help="Router width."),
    blocks: int = count(2, "--blocks", help="Residual blocks."),
    target_rate: float = typer.Option(0.12, "--target-rate",
                                      help="Calibrate the threshold to this LLM rate on validation."),
    seed: int = typer.Option(0, "--seed"),
    epochs: int = count(40, "--epochs", help="At most this many epochs (early stopping on validation AUC)."),
    ablations: bool = typer.Option(False, "--ablations",
                                   help="Also train every input set x objective and print the table."),
    architecture: str = typer.Option("mlp", "--architecture", help="mlp (this project's router) or reference (the "
                                     "paper's reference router; `r2r router export` writes it for the reference's "
                                     "code)."),
    slm: Slm = None, device: Device = "auto", dtype: Dtype = "auto", backend: BackendOpt = "auto",
):
    """Train the router on label datasets (SLM features recomputed by prefill), calibrate, save, report."""
    require_extra("labels", "`r2r train`")
    from roads_to_rome.training import train as training

    if not 0 < target_rate < 1:
        raise R2RError("--target-rate is a share of tokens, strictly between 0 and 1")
    slm_engine = load_alone(slm, "slm", device, dtype, backend)
    with progress_bar() as progress:
        result = training.train_router(datasets, slm_engine.slm, out, objective, inputs, dim, blocks, target_rate, seed,
                                       epochs, ablations, progress, architecture)
    for skip in result["skipped"]:
        console.print(f"[yellow]ablation {skip['inputs']} / {skip['objective']} skipped: {skip['reason']}")
    console.print(tables.training(result, training.RATES))
    threshold = result["runs"][0]["threshold"]
    console.print(f"router saved to {out} (threshold {threshold:.4f} for {target_rate:.0%} LLM tokens)")


def calibrate(
    router_path: Path = typer.Argument(..., help="A router checkpoint directory."),
    dataset: Path = typer.Argument(..., help="The label dataset it was trained on (its validation prompts are used)."),
    target_rate: float | None = typer.Option(None, "--target-rate", help="Set the threshold for this LLM rate."),
    target_recall: float | None = typer.Option(None, "--target-recall",
                                               help="Set it for this recall of divergent tokens."),
    write: bool = typer.Option(False, "--write", help="Store the chosen threshold in the checkpoint."),
    all_prompts: bool = typer.Option(False, "--all-prompts", help="Sweep on every prompt of DATASET, not its "
                                     "validation split: for a dataset the router was not trained on (e.g. margin "
                                     "labels of the SLM's own answers to an evaluation set)."),
    as_json: AsJson = False,
    slm: Slm = None, device: Device = "auto", dtype: Dtype = "auto", backend: BackendOpt = "auto",
):
    """Sweep thresholds on validation data: recall of divergent tokens vs LLM rate (table + plot)."""
    require_extra("labels", "`r2r calibrate`")
    from roads_to_rome.training import train as training

    training.check_targets(target_rate, target_recall, write)  # before the SLM loads
    slm_engine = load_alone(slm, "slm", device, dtype, backend)
    result = training.calibrate(router_path, dataset, slm_engine.slm, target_rate, target_recall, write, all_prompts)
    if as_json:
        print(json.dumps(result))
        return
    console.print(tables.calibration(result))
    console.print(f"plot: {result['plot']}")
    if result["chosen"]:
        chosen = result["chosen"]
        console.print(f"threshold {chosen['threshold']:.4f}: LLM rate {chosen['rate']:.1%}, "
                      f"recall {chosen['recall']:.1%}")
        if write:
            console.print(f"threshold written to {router_path / 'router.json'}")


def load_judge(kind: str, url: str | None, model: str | None, llm: str | None, device: str, dtype: str, backend: str):
    """A judge by name; the local one loads the LLM alone."""
    from roads_to_rome.pipeline import judges

    return judges.build(kind, lambda: load_alone(llm, "llm", device, dtype, backend), url, model, device)


@label_app.command("run")
def label_run(
    prompts: Path = typer.Argument(..., help="JSONL prompt set (see `r2r label prompts`)."),
    out: Path = typer.Option(..., "--out", help="Directory for the steps' Parquet parts and labels.parquet."),
    steps: str = typer.Option("responses,prefill,continuations,judgements,labels", "--steps",
                              help="Which steps to run, comma-separated, in pipeline order."),
    judge: JudgeKind = "local", judge_url: JudgeUrl = None, judge_model: JudgeModel = None,
    max_new_tokens: int = count(256, "--max-new-tokens", help="Longest LLM response (step 0)."),
    continuation_tokens: int = count(32, "--continuation-tokens", help="Longest branch continuation (step 2)."),
    rejoin_tokens: int = typer.Option(0, "--rejoin-tokens", min=0, help="--judge answer: a branch whose last N "
                                      "tokens run in a row in the LLM's response has re-joined it and stops "
                                      "(neutral); 0 (default): every branch runs to its end (stopping at 8 "
                                      "tokens changed 19% of the stopped verdicts on the default pair)."),
    batch_size: int = count(4, "--batch-size", help="Responses (step 0) and branches (step 2) decoded together."),
    positions_per_response: int = typer.Option(0, "--positions-per-response", min=0, help="Branch from at most N "
                                               "differing positions per response (a fixed sample; the others are "
                                               "left unjudged, unparseable): rollouts to the end of the answer cost "
                                               "hundreds of tokens each. 0 (default): every one."),
    writer: str = typer.Option("llm", "--writer", help="Who writes the responses: llm (the paper's labels) or slm "
                               "(on-policy: the prefixes the router meets when it runs; needs --judge margin, or "
                               "--judge answer, which then rolls out the LLM's own token as well as the SLM's)."),
    margin: float = typer.Option(1.0, "--margin", help="--judge margin: divergent where the LLM ranks the SLM's "
                                 "token more than this many nats below its own (what --verify at this tolerance "
                                 "rejects)."),
    chat_template: ChatTemplateOpt = None,
    slm: Slm = None, llm: Llm = None, device: Device = "auto", dtype: Dtype = "auto", backend: BackendOpt = "auto",
):
    """Run the label pipeline (or some of its steps); re-running resumes where it stopped."""
    require_extra("labels", "`r2r label`")
    from roads_to_rome.models import load_pair, read_chat_template
    from roads_to_rome.pipeline import judges, labels

    template = read_chat_template(chat_template) if chat_template is not None else None

    def judge_for(llm_alone):
        return judges.build(judge, lambda: llm_alone, judge_url, judge_model, device, margin)

    judges.check_settings(judge, judge_url, judge_model, margin)  # before any model loads
    if rejoin_tokens and judge != "answer":
        raise R2RError(f"--rejoin-tokens stops the answer judge's rollouts; --judge {judge} makes none: leave it out")

    with progress_bar(RateColumn(), TimeRemainingColumn()) as progress:
        dataset = labels.run(prompts, out, steps,
                             lambda: load_pair(slm, llm, device, dtype=dtype, backend=backend, chat_template=template),
                             judge_for, max_new_tokens, continuation_tokens, batch_size, progress,
                             rollout=judge == "answer", rejoin_tokens=rejoin_tokens, margin=judge == "margin",
                             writer=writer, positions_per_response=positions_per_response, chat_template=template)
    if dataset:
        console.print(f"labelled dataset: {dataset}")
    for step, t in labels.throughput(out).items():
        console.print(f"{step}: {t['items_per_s']:.3f} items/s, {t['tokens_per_s']:.1f} tokens/s "
                      f"({t['items']} items in {t['seconds']:.0f} s)")


@label_app.command("prompts")
def label_prompts(
    out: Path = typer.Option(..., "--out", help="Where to write the JSONL prompt set."),
    recipe: str = typer.Option("default", "--recipe", help="default: math, logic, code and qa from reasoning-gym; "
                               "math: problems with checkable answers for --judge answer (reasoning-gym's worded "
                               "generators, CHAMP, and word problems the LLM writes); infill: lines of code to "
                               "fill in the middle, from the functions of Python's standard library."),
    per_domain: int = count(100, "--per-domain", help="default recipe: prompts per domain."),
    generated: int = typer.Option(100, "--generated", min=0, help="math recipe: reasoning-gym prompts."),
    written: int = typer.Option(0, "--written", min=0, help="math recipe: word problems the LLM writes "
                                "(GSM8K's style, none sharing 8 words in a row with a GSM8K test question)."),
    champ: bool = typer.Option(True, "--champ/--no-champ", help="math recipe: CHAMP's 270 competition problems."),
    functions: int = count(500, "--functions", help="infill recipe: functions, one line taken out of each."),
    seed: int = typer.Option(0, "--seed"),
    llm: Llm = None, device: Device = "auto", dtype: Dtype = "auto", backend: BackendOpt = "auto",
):
    """Build a training prompt set (no evaluation data); the same seed gives the same set."""
    require_extra("labels", "`r2r label prompts`")
    from roads_to_rome.pipeline import prompt_sets

    if recipe == "default":
        prompts = prompt_sets.build_prompt_set(per_domain, seed)
    elif recipe == "math":
        prompts = prompt_sets.math_prompt_set(generated, seed, champ)
        if written:
            with progress_bar(RateColumn(), TimeRemainingColumn()) as progress:
                writer = load_alone(llm, "llm", device, dtype, backend)
                prompts += prompt_sets.write_word_problems(writer, written, seed, progress=progress)
    elif recipe == "infill":
        prompts = prompt_sets.infill_prompt_set(functions, seed)
    else:
        raise R2RError(f"--recipe takes default, math or infill, got {recipe!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    domains = sorted({p["domain"] for p in prompts})
    console.print(f"{len(prompts)} prompts in {len(domains)} domain(s) ({', '.join(domains)}) -> {out}")
    overlaps = [p["gsm8k_overlap_words"] for p in prompts if "gsm8k_overlap_words" in p]
    if overlaps:
        console.print(f"written problems: {len(overlaps)}; longest run of words shared with a GSM8K test question: "
                      f"{max(overlaps)} (median {sorted(overlaps)[len(overlaps) // 2]})")


@label_app.command("agree")
def label_agree(
    out: Path = typer.Argument(..., help="A label output directory whose judgements step has run."),
    judge: str = typer.Option("semantic", "--judge", help="The second judge: local, remote, semantic or facts."),
    against: Path | None = typer.Option(None, "--against", help="Instead of running a second judge, compare with "
                                        "this label directory's judgements (the same responses branched another "
                                        "way, e.g. with --rejoin-tokens 0: how often stopping early changed a "
                                        "label; or a committed dataset's labels.parquet, labelled by another "
                                        "judge)."),
    judge_url: JudgeUrl = None, judge_model: JudgeModel = None,
    llm: Llm = None, device: Device = "auto", dtype: Dtype = "auto", backend: BackendOpt = "auto",
):
    """Run a second judge on the same differing positions (or read another directory's verdicts) and report how
    often it agrees with the first."""
    require_extra("labels", "`r2r label agree`")
    from roads_to_rome.pipeline import label_reports, labels

    if not ((out / "judgements").exists() or (against is not None and (out / "labels.parquet").exists())):
        raise R2RError(f"{out} has no judgements yet: run `r2r label PROMPTS --out {out}` first")
    if against is not None and not ((against / "judgements").exists() or (against / "labels.parquet").exists()):
        raise R2RError(f"{against} has no judgements yet (nor a labels.parquet): run `r2r label PROMPTS --out "
                       f"{against}` first")
    if against is not None:
        print(json.dumps(label_reports.agreement(out, other_dir=against)))
        return
    name = f"judgements-{judge}"
    labels.step_judgements(load_judge(judge, judge_url, judge_model, llm, device, dtype, backend), out, name=name)
    print(json.dumps(label_reports.agreement(out, name)))


@label_app.command("check-judge")
def label_check_judge(
    cases: Path | None = typer.Argument(None, help="JSONL of hand-labelled cases: context, a, b, label "
                                        "(neutral|divergent). Default: the hand-labelled cases shipped with r2r."),
    judge: str = typer.Option("local", "--judge", help="local, remote, semantic or facts."),
    judge_url: JudgeUrl = None, judge_model: JudgeModel = None,
    llm: Llm = None, device: Device = "auto", dtype: Dtype = "auto", backend: BackendOpt = "auto",
    as_json: AsJson = False,
):
    """How well a judge agrees with hand labels: accuracy, divergent recall/precision, Cohen's kappa."""
    require_extra("labels", "`r2r label check-judge`")
    from roads_to_rome.pipeline import judges

    result = judges.check(load_judge(judge, judge_url, judge_model, llm, device, dtype, backend),
                          cases or judges.CHECK_SET)
    if as_json:
        print(json.dumps(result))
        return
    console.print(*tables.judge_check(result, judge))


@label_app.command("report")
def label_report(
    dataset: Path = typer.Argument(..., help="A label output directory or its labels.parquet."),
    as_json: AsJson = False,
):
    """Per domain and overall: queries, tokens, different and divergent rates, SLM entropy by label."""
    require_extra("labels", "`r2r label report`")
    from roads_to_rome.pipeline import label_reports

    result = label_reports.report(dataset)
    if as_json:
        print(json.dumps(result))
        return
    console.print(tables.label_report(result))


