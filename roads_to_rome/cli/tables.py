"""Results as rich tables and text: what the `r2r` commands print."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

LLM_STYLE = "bold black on yellow"
STYLES = {"llm": LLM_STYLE, "fix": "bold black on green"}  # by token source; the SLM's tokens are plain
MARKS = {"llm": ("[[", "]]"), "fix": ("{{", "}}")}  # the same where output is not a terminal


def style(source: str, thinking: bool = False) -> str | None:
    """A token's style: by its source; a reasoning model's thinking dimmed."""
    return " ".join(s for s in ("dim" if thinking else None, STYLES.get(source)) if s) or None


def highlighted(tokenizer, generation, terminal: bool, thinking: int = 0) -> Text:
    """The answer with the LLM's tokens highlighted (verification's fixes in their own colour), the first
    `thinking` tokens (a reasoning model's thinking) dimmed; where output is not a terminal, routed tokens in
    [[...]] and fixes in {{...}} instead."""
    from roads_to_rome.text import token_pieces

    text, span = Text(), "slm"
    for n, (piece, source) in enumerate(zip(token_pieces(tokenizer, generation.token_ids), generation.sources)):
        if terminal:
            text.append(piece, style=style(source, n < thinking))
            continue
        if source != span:
            text.append(MARKS.get(span, ("", ""))[1] + MARKS.get(source, ("", ""))[0])
            span = source
        text.append(piece)
    return text.append(MARKS.get(span, ("", ""))[1])


def stats(generation, engine, terminal: bool, reasoned=None) -> Table:
    table = Table(show_header=False, box=None, padding=(0, 2))
    t, policy, verify = generation.timings, engine.policy, engine.verify
    models = [(role, b) for role, b in (("SLM", engine.slm), ("LLM", engine.llm)) if b is not None]
    marked = "highlighted" if terminal else "in [[ ]]" + (", fixes in {{ }}" if verify.on else "")
    rows = [
        ("policy", policy.name + (f" (threshold {policy.threshold:g})" if policy.threshold is not None else "")),
        ("tokens", f"{len(generation.token_ids)} ({generation.finish_reason})"),
        ("LLM tokens", f"{generation.llm_tokens}  ({marked})"),
        ("LLM rate", f"{generation.llm_rate:.1%}"),
        ("avg. activated params", f"{generation.avg_params_b:.3f} B"),
        ("speed", f"{generation.tokens_per_s:.1f} tokens/s"),
        ("time SLM / router / LLM", f"{t.slm_s:.2f} / {t.router_s:.3f} / {t.llm_s:.2f} s"),
        *((f"{role} ran on", b.kernels) for role, b in models),
    ]
    if generation.cached_tokens:
        rows.insert(1, ("prompt tokens", f"{len(generation.prompt_ids)} ({generation.cached_tokens} kept read from "
                                         "before: prefix caching)"))
    if reasoned is not None:
        shares = [f"{rate:.1%}" if rate is not None else "-" for rate in (reasoned.llm_rate_thinking,
                                                                          reasoned.llm_rate_answer)]
        rows.insert(4, ("LLM rate thinking / answer", f"{shares[0]} / {shares[1]}  ({reasoned.reasoning_tokens} "
                                                      f"thinking tokens)"))
    if verify.on:
        rows.insert(3, ("verification", f"{verify}: {generation.rollbacks} rollbacks, "
                                        f"{generation.sources.count('fix')} fixes, "
                                        f"{generation.discarded} tokens discarded"))
    for name, value in rows:
        table.add_row(Text(name, style="dim"), value)
    return table


def training(result: dict, rates) -> Table:
    """`r2r train`: validation ROC-AUC and recall at LLM rates, per run, beside entropy's."""
    metrics, entropy = result["metrics"], result["entropy"]
    table = Table("inputs", "objective", "params", "val ROC-AUC", *[f"recall@{r:.0%}" for r in rates],
                  title=f"validation: {metrics['val_tokens']} tokens of {metrics['val_prompts']} held-out prompts "
                        f"(ROC-AUC and recall of {metrics['recall_of']} tokens at an LLM rate)")
    for r in result["runs"]:
        table.add_row(r["inputs"], r["objective"], f"{r['params'] / 1e6:.2f}M", f"{r['val_auc']:.3f}",
                      *[f"{r['recall'][x]:.1%}" for x in rates])
    table.add_row("entropy", "-", "0", f"{entropy['val_auc']:.3f}", *[f"{entropy['recall'][x]:.1%}" for x in rates])
    return table


def calibration(result: dict) -> Table:
    """`r2r calibrate`: recall of the router and of entropy at LLM rates, with the thresholds."""
    own = result["own_threshold"]
    table = Table("LLM rate", "threshold", "router recall", "entropy recall",
                  title=f"recall of {result['recall_of']} tokens ({result['val_tokens']} tokens; ROC-AUC router "
                        f"{result['auc']:.3f}, entropy {result['entropy_auc']:.3f})",
                  caption=f"its own threshold {own['threshold']:.4f}: {own['rate']:.1%} of tokens, recall "
                          f"{own['recall']:.1%}")
    for row in result["table"]:
        table.add_row(f"{row['rate']:.0%}", f"{row['threshold']:.4f}", f"{row['router_recall']:.1%}",
                      f"{row['entropy_recall']:.1%}")
    return table


def judge_check(result: dict, judge: str) -> tuple[Table, str]:
    """`r2r label check-judge`: each case's verdict, then the agreement figures."""
    table = Table("hand label", "verdict", "raw answer",
                  title=f"{judge} judge on {result['cases']} hand-labelled cases")
    for a in result["answers"]:
        table.add_row(a["label"], a["verdict"], a["raw"].strip()[:40])
    pct = lambda x: "-" if x is None else f"{x:.0%}"  # noqa: E731
    return table, (f"accuracy {result['accuracy']:.0%}, divergent recall {pct(result['divergent_recall'])}, "
                   f"precision {pct(result['divergent_precision'])} ({result['said_divergent']} said divergent, "
                   f"{result['divergent_cases']} are), Cohen's kappa {result['kappa']:.2f}, "
                   f"unparseable {result['unparseable']}")


def label_report(result: dict) -> Table:
    """`r2r label report`: the paper's statistics table."""
    title = None if result["judged"] else "not judged yet: the prefill step's figures (divergent ones need the judge)"
    table = Table("domain", "queries", "tokens", "different", "divergent", "paper", "H identical",
                  "H different", "H neutral", "H divergent", title=title,
                  caption="paper: different/divergent, R1-1.5B vs R1-32B labelled by a 72B judge "
                          "(the R2R paper's training data)")
    fmt = lambda v: "–" if v is None else f"{v:.3f}"  # noqa: E731
    paper = result.get("paper", {})
    for name, r in [*result["domains"].items(), ("overall", result["overall"])]:
        p = paper.get(name.lower())
        table.add_row(name, str(r["queries"]), str(r["tokens"]), f"{r['different_rate']:.1%}",
                      "–" if r["divergent_rate"] is None else f"{r['divergent_rate']:.1%}",
                      f"{p['different_rate']:.1%}/{p['divergent_rate']:.1%}" if p else "–",
                      *[fmt(r[f"mean_entropy_{label}"]) for label in ("identical", "different", "neutral",
                                                                      "divergent")])
    return table


def bench_compare(result: dict, prompts: int, tokens: int, dtype: str) -> list:
    """`r2r bench`: every system's speed against the fastest LLM alone, then R2R's cost model."""
    base = result["baseline"]
    table = Table("system", "tokens", "seconds", "tokens/s", "LLM rate", "rollbacks", f"x {base}",
                  title=f"{prompts} GSM8K dev prompts, <= {tokens} new tokens, greedy, one at a time ({dtype} torch)")
    for name, r in result["systems"].items():
        rate = "" if r["llm_rate"] is None else f"{r['llm_rate']:.1%}"
        table.add_row(name, str(r["tokens"]), f"{r['seconds']:.1f}", f"{r['tokens_per_s']:.2f}", rate,
                      str(r.get("rollbacks", "")), f"{r['vs_fastest_llm']:.2f}")
    return [table, *(cost_model(name, r) for name, r in result["systems"].items() if "cost_model" in r)]


def cost_model(name: str, r: dict) -> str:
    """The cost model's prediction for one R2R run, against what the run measured."""
    m = r["cost_model"]
    return (f"{name}: cost model: prompts ({m['prompt_tokens']} tokens) SLM {m['t_slm_prompt_ms']:.0f} ms "
            f"+ LLM {m['t_llm_prompt_ms']:.0f} ms; per token t_SLM {m['t_slm_ms']:.1f} ms + router "
            f"{m['t_router_ms']:.1f} ms + {m['llm_calls_per_token']:.3f} x t_LLM({m['catch_up_tokens']}) "
            f"{m['t_llm_catch_up_ms']:.1f} ms -> predicted {m['predicted_tokens_per_s']:.2f} tok/s, "
            f"measured {r['tokens_per_s']:.2f} ({r['tokens_per_s'] / m['predicted_tokens_per_s']:.0%}); "
            f"inside the run: SLM {r['slm_ms_per_step']:.1f} ms per step, LLM "
            + ("no call" if r["llm_ms_per_call"] is None else f"{r['llm_ms_per_call']:.1f} ms per call")
            + " (prompts included)")


def bench_backends(result: dict, prompts: int, threshold: float, dtype: str) -> Table:
    """`r2r bench backends`: how closely the SLM's features agree across torch and llama.cpp."""
    table = Table("measure", "torch vs llama.cpp",
                  title=f"SLM features over {result['positions']} answer positions "
                        f"({prompts} GSM8K dev prompts, torch {dtype})")
    table.add_row("hidden-state cosine, mean", f"{result['hidden_cosine_mean']:.4f}")
    table.add_row("hidden-state cosine, min", f"{result['hidden_cosine_min']:.4f}")
    table.add_row("argmax agreement", f"{result['argmax_agreement']:.1%}")
    table.add_row(f"entropy decisions agree (>= {threshold} nats)", f"{result['entropy_decision_agreement']:.1%}")
    if "router_decision_agreement" in result:
        table.add_row(f"router decisions agree (>= {result['router_threshold']:.3f})",
                      f"{result['router_decision_agreement']:.1%}")
        table.add_row("router |score gap|, mean / max",
                      f"{result['router_score_gap_mean']:.3f} / {result['router_score_gap_max']:.3f}")
    return table


def bench_overhead(result: dict, tokens: int) -> list:
    """`r2r bench overhead`: the engine against bare forward loops."""
    names = {"bare": "bare SLM forward loop (DynamicCache)", "engine": "R2R engine, --router slm",
             "static": "bare loop, StaticCache", "static_compiled": "bare loop, StaticCache + torch.compile"}
    table = Table("loop", "tokens/s (median)", "x bare", "runs",
                  title=f"{tokens} tokens, {result['dtype']}, {result['device']}")
    for name, median in result["tokens_per_s"].items():
        table.add_row(names[name], f"{median:.2f}", f"{result['vs_bare'][name]:.3f}",
                      ", ".join(f"{x:.2f}" for x in result["runs"][name]))
    lines = [table]
    if result["compile_s"] is not None:
        lines.append(f"torch.compile took {result['compile_s']:.0f} s before the first token")
    return [*lines, f"engine / bare = {result['ratio']:.3f}  (target >= 0.90)"]


def phases(result: dict, modes: tuple[str, str], setting: str) -> list:
    """A two-phase throughput comparison (baseline first) and its ratio."""
    table = Table("mode", "tokens", "seconds", "tokens/s", "LLM rate")
    for mode in modes:
        r = result[mode]
        table.add_row(mode.replace("_", " "), str(r["tokens"]), f"{r['seconds']:.1f}", f"{r['tokens_per_s']:.2f}",
                      f"{r['llm_rate']:.1%}")
    names = [m.replace("_", " ") for m in modes]
    where = f"{setting}, {result['backend']}, {result['dtype']}, {result['device']}"
    return [table, f"{names[1]} / {names[0]} = {result['speedup']:.2f}x  ({where})"]


def bench_serve(result: dict) -> Table:
    """`r2r bench serve`: throughput and latency per system and number of clients, beside the baseline's."""
    table = Table("system", "clients", "tokens/s", f"× {result['baseline']}", "p50 s", "p95 s",
                  f"p95 × {result['baseline']}", "LLM calls", "routed rows / call", "LLM rate",
                  title=f"{result['requests']} requests of up to {result['tokens']} tokens, {result.get('rounds', 1)} "
                        f"round(s) ({result['policy']}, verify "
                        f"{result['verify']}, group {result['defer_group']:g}, steps {result['defer_steps']}; "
                        f"{result['backend']}, {result['dtype']}, {result['device']})", title_justify="left")
    order = {name: i for i, name in enumerate(result["systems"])}
    for run in sorted(result["runs"].values(), key=lambda r: (r["clients"], order[r["system"]])):
        table.add_row(run["system"], str(run["clients"]), f"{run['tokens_per_s']:.2f}", f"{run['x_throughput']:.2f}×",
                      f"{run['p50_s']:.1f}", f"{run['p95_s']:.1f}", f"{run['x_p95']:.2f}×", str(run["llm_calls"]),
                      f"{run['routed_rows_per_call']:.2f}", f"{run['llm_rate']:.1%}")
    return table


def bench_prefix(result: dict) -> Table:
    """`r2r bench prefix`: each turn's time to the first token with prefix caching and without."""
    shots = result.get("shots", 0)
    shared = f", a shared system message of {shots} worked examples, arriving one after another" if shots else ""
    shared += f", {result['n']} sampled choices per turn" if result.get("n", 1) > 1 else ""
    table = Table("turn", "prompt tokens", "found kept", "TTFT s kept", "TTFT s none", "× TTFT", "turn s kept",
                  "turn s none",
                  title=f"{result['clients']} conversation(s) of {result['turns']} turns, up to {result['tokens']} "
                        f"tokens each{shared}, {result['rounds']} round(s) ({result['policy']}; {result['backend']}, "
                        f"{result['dtype']}, {result['device']}); same answers {result['same_answers']}/"
                        f"{result['answers']}", title_justify="left")
    kept, none = result["per_turn"]["kept"], result["per_turn"]["none"]
    for t, (a, b, x) in enumerate(zip(kept, none, result["x_ttft_per_turn"]), 1):
        table.add_row(str(t), f"{a['prompt_tokens']:.0f}", f"{a['cached_tokens']:.0f}", f"{a['ttft_s']:.2f}",
                      f"{b['ttft_s']:.2f}", f"{x:.2f}×", f"{a['seconds']:.1f}", f"{b['seconds']:.1f}")
    whole = result["conversation"]
    table.add_row("all", "", "", f"{whole['kept']['ttft_s']:.2f}", f"{whole['none']['ttft_s']:.2f}",
                  f"{result['x_ttft']:.2f}×", f"{whole['kept']['seconds']:.1f}", f"{whole['none']['seconds']:.1f}",
                  end_section=True)
    differ = ", ".join("-" if t is None else str(t) for t in result["first_difference"])
    table.caption = (f"a whole conversation: {result['x_seconds']:.2f}× faster with prefix caching; first turn whose "
                     f"answers differ, per conversation: {differ}")
    return table


def bench_priority(result: dict) -> Table:
    """`r2r bench priority`: urgent requests' times, first come first served and by priority."""
    table = Table("urgent request", "TTFT s fcfs", "TTFT s priority", "× TTFT", "answered s fcfs",
                  "answered s priority",
                  title=f"{result['urgent']} urgent requests (up to {result['urgent_tokens']} tokens) beside "
                        f"{result['batch_clients']} batch-job clients filling the batch (up to {result['tokens']} "
                        f"tokens each), {result['rounds']} round(s) ({result['policy']}; {result['backend']}, "
                        f"{result['dtype']}, {result['device']}); same urgent answers "
                        f"{result['same_urgent_answers']}/{result['urgent_answers']}", title_justify="left")
    fcfs, priority = result["by_scheduling"]["fcfs"], result["by_scheduling"]["priority"]
    for i, (a, b, c, d) in enumerate(zip(fcfs["ttft_s"], priority["ttft_s"], fcfs["seconds"], priority["seconds"]), 1):
        table.add_row(str(i), f"{a:.2f}", f"{b:.2f}", f"{a / b:.2f}×", f"{c:.1f}", f"{d:.1f}")
    table.add_row("mean", f"{fcfs['mean_ttft_s']:.2f}", f"{priority['mean_ttft_s']:.2f}", f"{result['x_ttft']:.2f}×",
                  f"{fcfs['mean_seconds']:.1f}", f"{priority['mean_seconds']:.1f}", end_section=True)
    table.caption = (f"the server: {fcfs['tokens_per_s']:.2f} tokens/s first come first served, "
                     f"{priority['tokens_per_s']:.2f} by priority ({result['throughput_kept']:.0%}; the batch job's "
                     f"own {fcfs['batch_tokens_per_s']:.2f} and {priority['batch_tokens_per_s']:.2f}), "
                     f"{priority['preemptions']} preemption(s); worst urgent TTFT {fcfs['worst_ttft_s']:.2f} s against "
                     f"{priority['worst_ttft_s']:.2f} s")
    return table


def bench_steps(result: dict, ks: list[int], backend: str, dtype: str, context: int) -> Table:
    """`r2r bench steps`: milliseconds per forward step; over several rows, each also as a multiple of one row's
    one-token step (what grouping LLM calls weighs: `Backend.grouped_reads`)."""
    title = f"ms per forward step ({backend}, {dtype}, {result['device']}, {context}-token cache)"
    batched = result.get("batched_ms", {})
    table = Table("model", *(["rows"] if batched else []), *[f"k={k}" for k in ks], title=title)
    for role, row in result["ms"].items():
        table.add_row(role.upper(), *(["1"] if batched else []), *[f"{row[k]:.0f}" for k in ks])
        one = row.get(1)
        for n, by_role in batched.items():
            cells = [f"{ms:.0f}" + (f" ({ms / one:.2f}×)" if one else "") for ms in (by_role[role][k] for k in ks)]
            table.add_row("", str(n), *cells)
    return table


def bench_remote(result: dict, ks: list[int]) -> list:
    """`r2r bench remote`: catch-up latency and tokens/s, the LLM local vs behind a server."""
    steps = Table("LLM", *[f"k={k} {state}" for k in ks for state in ("cached", "cold")],
                  title=f"ms per LLM catch-up of k tokens ({result['context']}-token prefix)")
    for where, row in result["catch_up"].items():
        steps.add_row(where, *[f"{row[k][state]:.0f}" for k in ks for state in ("cached_ms", "cold_ms")])
    speed = Table("system", "tokens", "seconds", "tokens/s", "LLM rate",
                  title=f"{result['prompts']} GSM8K dev prompts, {result['max_new_tokens']} tokens, one at a time")
    for name, r in result["systems"].items():
        speed.add_row(name, str(r["tokens"]), f"{r['seconds']:.1f}", f"{r['tokens_per_s']:.2f}", f"{r['llm_rate']:.1%}")
    s = result["systems"]
    ratio = s["R2R (remote)"]["tokens_per_s"] / s["R2R (local)"]["tokens_per_s"]
    same = result["same_output"]
    return [steps, speed, f"R2R remote / local = {ratio:.2f}x; same output, local vs remote: LLM alone "
                          f"{same['LLM alone']}/{result['prompts']}, R2R {same['R2R']}/{result['prompts']} "
                          f"(remote: {result['remote']}; local: {result['backend']})"]


def bench_shapes(result: dict) -> list:
    """Per LLM shape: tokens/s measured and predicted by the cost model, and the ratios to the LLM alone."""
    from roads_to_rome.bench import shapes_report

    out = []
    for name, entry in result["summary"].items():
        build = entry.get("build") or {}
        built = (f", {build['bytes'] / 1e9:.2f} GB" if build.get("bytes") else "") + \
            (f", built in {build['built_s'] / 60:.1f} min" if build.get("built_s") else "")
        table = Table(title=f"{name} ({entry['params_b']:.2f}B parameters{built})", title_justify="left")
        with_grouping = shapes_report.grouped(entry)
        for column in shapes_report.COLUMNS + (shapes_report.GROUPED_COLUMNS if with_grouping else ()):
            table.add_column(column, justify="left" if column == "system" else "right")
        for row in entry["rows"]:
            table.add_row(*shapes_report.row_cells(row, with_grouping))
        out.append(table)
    out += shapes_report.notes(result)
    if result.get("slm_tokens_per_s"):
        slm = (result.get("slm") or {}).get("name", "the default SLM")
        out.append(f"SLM alone ({slm}): {result['slm_tokens_per_s']:.2f} tok/s. † the real 0.5B + 1.5B pair's "
                   "forwards (the shipped router, verification, speculative drafts) replayed at this pair's step "
                   "costs: predicted where the models have random weights, measured on the real pair; "
                   "hf-assisted: transformers' assisted generation, its measured cost per round at the real pair's "
                   "tokens per round.")
    return out
