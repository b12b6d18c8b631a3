"""What `r2r bench shapes` prints and draws: its result summarised beside the cost model, as a table, a markdown
page and a plot."""

from __future__ import annotations

from pathlib import Path

from roads_to_rome.bench.cost_model import (
    ms_keys,
    predicted_alone_tok_s,
    predicted_from_calls,
    predicted_overlapped_tok_s,
    predicted_routing_tok_s,
    tokens_per_round,
)
from roads_to_rome.bench.shape_models import SHAPES
from roads_to_rome.core.llm_calls import Deferral
from roads_to_rome.plots import pyplot


def system_name(name: str, batch: int) -> str:
    return name if batch == 1 else f"{name} b={batch}"


def summarize(result: dict, shares: list[float]) -> dict:
    """Ratios and the cost model's figures beside what was measured: for each shape, the LLM alone, R2R at each
    share (measured; predicted from step costs), R2R with verification and speculative decoding (predicted: the
    real pair's forwards at this shape's step costs), transformers' assisted generation (its measured cost per
    round at the real pair's tokens per round), and the same systems at larger batches (measured only)."""
    real, tokens, lengths = result["real"], result["config"]["tokens"], result.get("prompt_tokens", [])
    own_slm = result.get("slm")
    slm_ms = ms_keys(own_slm["steps"] if own_slm else real["steps"]["slm"])
    batches = result["config"].get("batches", [1])
    real_systems = real.get("systems", {})
    rows = {}
    entries = list(result["shapes"].items()) + ([("qwen2.5-coder-1.5b (real)", None)] if "steps" in real else [])
    for name, entry in entries:
        if entry is None:
            llm_ms, measured = ms_keys(real["steps"]["llm"]), {"llm": real_systems.get("llm")}
            measured |= {k: v for k, v in real_systems.items() if k.startswith("r2r") or k.startswith("spec")}
            params_b = SHAPES["qwen2.5-coder-1.5b"].params / 1e9
        elif "steps" in entry:
            llm_ms, measured, params_b = ms_keys(entry["steps"]), dict(entry["systems"]), entry["params_b"]
        else:
            continue
        alone_predicted = predicted_alone_tok_s(llm_ms, lengths, tokens)
        llm_run = measured.get("llm") or {}
        alone = llm_run.get("tokens_per_s")
        table = [{"system": "llm", "measured": alone, "predicted": alone_predicted,
                  "recorded_while_timed": llm_run.get("recorded_while_timed")}]
        for share in shares:
            run = measured.get(f"r2r@{share:g}")
            table.append({"system": f"r2r@{share:g}", "share": share,
                          "measured": run["tokens_per_s"] if run else None,
                          "measured_share": run["llm_share"] if run else None,
                          "recorded_while_timed": (run or {}).get("recorded_while_timed"),
                          "predicted": predicted_routing_tok_s(slm_ms, llm_ms, share, lengths, tokens)})
        if 1 in result["config"].get("overlap", []):
            table += [overlap_row(result["config"], run, system, 1, share, mode, slm_ms, llm_ms, lengths,
                                  alone_predicted)
                      for system, share, mode, run in overlap_runs(measured, shares, [], 1)]
        for system, run in real_systems.items():
            if system.startswith(("r2r", "spec")) and run.get("batch", 1) == 1:  # (a batch records no calls)
                row = {"system": system + " †", "share": run["llm_share"],
                       "predicted": predicted_from_calls(run, slm_ms, llm_ms)}
                if entry is None:
                    row["measured"] = run["tokens_per_s"]
                table.append(row)
        for key, run in ((entry or {}).get("assisted") or {}).items():
            spec = real_systems.get(f"spec+k={run['k']}")
            if "round_ms" in run and spec:
                table.append({"system": f"hf-assisted {key} †", "share": spec["llm_share"],
                              "predicted": tokens_per_round(spec) / (run["round_ms"] / 1000), "assisted": True})
        with_ratios(table, alone, alone_predicted)
        for batch in batches[1:] if batches[0] == 1 else batches:
            table += batched_rows(result, entry, measured, shares, batch)
        steps = {k: llm_ms[k] for k in sorted(llm_ms) if k in result["config"]["step_tokens"]}
        rows[name] = {"params_b": params_b, "build": (entry or {}).get("build"), "rows": table, "step_ms": steps}
    slm_alone = ((own_slm or real).get("systems") or {}).get("slm", {}).get("tokens_per_s")
    return {**result, "summary": rows, "slm_tokens_per_s": slm_alone}


def with_ratios(table: list[dict], alone: float | None, alone_predicted: float) -> None:
    """Each row's speed-up over the LLM alone (measured, where it was, else predicted) and over its cost model."""
    reference = alone or alone_predicted
    for row in table:
        if row.get("measured"):
            row["x_llm"] = row["measured"] / reference
            row["x_model"] = row["measured"] / row["predicted"]
        # assisted generation's figure comes from its measured cost per round: beside the LLM alone as measured
        row["predicted_x_llm"] = row["predicted"] / (reference if row.get("assisted") else alone_predicted)


def batched_rows(result: dict, entry: dict | None, measured: dict, shares: list[float], batch: int) -> list[dict]:
    """The LLM alone and R2R at each share, `batch` rows at a time, lockstep and with each deferral mode: measured,
    and the cost model's figure where step tables with that many rows were measured (a deferred mode's at the rate
    its run kept deferred routed tokens)."""
    slm_ms = ms_keys(result.get("slm_batched_steps", {}).get(str(batch), {}))
    llm_ms = ms_keys((entry or {}).get("batched_steps", {}).get(str(batch), {}))
    widths, tokens = result.get("batch_prompt_widths", {}).get(str(batch)), result["config"]["tokens"]
    alone_predicted = predicted_alone_tok_s(llm_ms, widths, tokens, batch) if llm_ms and widths else None
    alone = (measured.get(system_name("llm", batch)) or {}).get("tokens_per_s")
    config = result["config"]
    modes = ["off"] + config.get("defer", [])
    rows = []
    for system, share, mode in [("llm", None, "off")] + [(f"r2r@{share:g}" + ("" if mode == "off" else f"+{mode}"),
                                                         share, mode) for share in shares for mode in modes]:
        run = measured.get(system_name(system, batch))
        if not run:
            continue
        rule = Deferral.of(mode, config.get("defer_group"), config.get("defer_steps"))
        predicted = alone_predicted if share is None else (
            predicted_routing_tok_s(slm_ms, llm_ms, share, widths, tokens, rows=batch, deferral=rule,
                                    accept=run.get("deferred_accept", 0.0), samples=100 if mode == "off" else 20)
            if slm_ms and alone_predicted else None)
        row = {"system": system_name(system, batch), "batch": batch, "share": run["llm_share"],
               "measured": run["tokens_per_s"], "measured_share": run["llm_share"],
               "x_llm": run["tokens_per_s"] / alone if alone else None, "predicted": predicted,
               "predicted_x_llm": predicted / alone_predicted if predicted else None,
               "x_model": run["tokens_per_s"] / predicted if predicted else None,
               "recorded_while_timed": run.get("recorded_while_timed")}
        if "routed_rows_per_call" in run:
            row |= {"llm_calls": run["llm_calls_total"], "routed_rows_per_call": run["routed_rows_per_call"]}
        if mode != "off":
            row |= {"defer": mode, "accept": run["deferred_accept"],
                    "discarded_per_100": run["deferred_discarded_per_100"]}
        rows.append(row)
    if batch in config.get("overlap", []):
        for system, share, mode, run in overlap_runs(measured, shares, config.get("defer", []), batch):
            row = overlap_row(config, run, system, batch, share, mode, slm_ms, llm_ms, widths, alone_predicted)
            row |= {"batch": batch, "x_llm": run["tokens_per_s"] / alone if alone else None,
                    "llm_calls": run["llm_calls_total"], "routed_rows_per_call": run["routed_rows_per_call"]}
            rows.append(row)
    return rows


def overlapped_systems(shares, defer, batch: int) -> list[tuple[str, float, str]]:
    """The systems with the LLM's calls beside the SLM's steps at `batch` (name, share, deferral mode): R2R at each
    share with lockstep's rule (its call sent as soon as a row waits), and above one row with each deferral mode."""
    modes = ["off"] + (list(defer) if batch > 1 else [])
    return [(f"r2r@{share:g}" + ("" if mode == "off" else f"+{mode}") + "+overlap", share, mode)
            for share in shares for mode in modes]


def overlap_runs(measured: dict, shares: list[float], defer: list[str], batch: int
                 ) -> list[tuple[str, float, str, dict]]:
    """The runs with overlap measured at `batch` (system name, share, deferral mode, run)."""
    named = [(system_name(name, batch), share, mode) for name, share, mode in overlapped_systems(shares, defer, batch)]
    return [(name, share, mode, measured[name]) for name, share, mode in named if name in measured]


def overlap_row(config: dict, run: dict, system: str, batch: int, share: float, mode: str, slm_ms: dict,
                llm_ms: dict, widths: list[int] | None, alone_predicted: float | None) -> dict:
    """One run with overlap beside its cost model: the two models each at its own full speed while both run (as on
    two devices), so that measured / model says what sharing one device costs."""
    rule = Deferral.of(mode, config.get("defer_group"), config.get("defer_steps"), config.get("overlap_ahead"))
    predicted = (predicted_overlapped_tok_s(slm_ms, llm_ms, share, widths, config["tokens"], samples=20, rows=batch,
                                            accept=run.get("deferred_accept", 0.0), deferral=rule)
                 if slm_ms and llm_ms and widths else None)
    return {"system": system, "share": run["llm_share"], "measured": run["tokens_per_s"],
            "measured_share": run["llm_share"], "predicted": predicted, "overlap": True,
            "predicted_x_llm": predicted / alone_predicted if predicted and alone_predicted else None,
            "x_model": run["tokens_per_s"] / predicted if predicted else None,
            "accept": run.get("deferred_accept", 0.0), "discarded_per_100": run["deferred_discarded_per_100"],
            "recorded_while_timed": run.get("recorded_while_timed")}


def plot(result: dict, path: Path) -> Path:
    """Speed-up over the LLM alone against the LLM's size: the cost model's line per share, measured points."""
    plt = pyplot()

    entries = sorted(((e["params_b"], e) for e in result["summary"].values()), key=lambda x: x[0])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    shares = sorted({row["share"] for _, e in entries for row in e["rows"] if row["system"].startswith("r2r@")
                     and not row.get("batch") and not row.get("overlap")})
    for i, share in enumerate(shares):
        color = f"C{i}"
        at_share = [(b, r) for b, e in entries for r in e["rows"] if r.get("share") == share and not r.get("batch")
                    and r["system"].startswith("r2r@") and not r.get("overlap")]
        line = [(b, r["predicted_x_llm"]) for b, r in at_share]
        points = [(b, r["x_llm"]) for b, r in at_share if r.get("x_llm")]
        ax.plot(*zip(*line), "x--", color=color, label=f"{share:.0%} LLM tokens: cost model")
        if points:
            ax.plot(*zip(*points), "o", color=color, label=f"{share:.0%}: measured")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xticks([b for b, _ in entries], [f"{b:.1f}B" for b, _ in entries])
    ax.minorticks_off()
    slm = (result.get("slm") or {}).get("name", "the default 0.5B")
    ax.set_xlabel(f"LLM parameters (billions; the SLM: {slm})")
    ax.set_ylabel("speed-up over the LLM alone")
    where = f"{result['device_name']} (bf16, batch 1)" if result.get("device_name") else f"a CPU: {result['processor']}"
    ax.set_title(f"R2R on {where}", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


COLUMNS = ("system", "LLM share", "tok/s measured", "× LLM alone", "tok/s cost model", "× LLM alone (model)",
           "measured / model")
GROUPED_COLUMNS = ("routed rows / LLM call", "kept")
WARM_RUNS = 3  # timed runs of a system at most, while its last one still recorded graphs (shapes.run_system)


def grouped(entry: dict) -> bool:
    """Whether a shape's rows include batched runs that counted their LLM calls (the grouping columns)."""
    return any("routed_rows_per_call" in row for row in entry["rows"])


def row_cells(row: dict, with_grouping: bool) -> list[str]:
    """One summary row as text, in `COLUMNS` (and `GROUPED_COLUMNS`) order."""
    share = row.get("measured_share", row.get("share"))
    system = row["system"] + (" ‡" if row.get("recorded_while_timed") else "")
    cells = [system, "100%" if row["system"] == "llm" else f"{share:.1%}" if share is not None else "",
             f"{row['measured']:.2f}" if row.get("measured") else "–",
             f"{row['x_llm']:.2f}×" if row.get("x_llm") else "–",
             f"{row['predicted']:.2f}" if row.get("predicted") else "–",
             f"{row['predicted_x_llm']:.2f}×" if row.get("predicted_x_llm") else "–",
             f"{row['x_model']:.2f}" if row.get("x_model") else "–"]
    if with_grouping:
        cells += [f"{row['routed_rows_per_call']:.2f}" if row.get("llm_calls") and row["system"] != "llm" else "",
                  f"{row['accept']:.0%}" if "accept" in row else ""]
    return cells


def deferral_note(config: dict) -> str | None:
    if not config.get("defer"):
        return None
    return (f"+{' / +'.join(config['defer'])}: deferred routing (--defer), the LLM called once "
            f"{config['defer_group']:g} of the batch's rows wait or a routed token waited {config['defer_steps']} "
            "steps. kept: deferred routed tokens whose SLM token the LLM kept; random weights agree with nothing, so "
            "with them the LLM keeps the SLM's token at the rate the real pair kept it in this run.")


def recording_note(summary: dict) -> str | None:
    if not any(row.get("recorded_while_timed") for entry in summary.values() for row in entry["rows"]):
        return None
    return (f"‡ still recording CUDA graphs (and compiling the trunk for them) in the last of its {WARM_RUNS} timed "
            "runs: its figure includes that one-time work.")


def notes(result: dict) -> list[str]:
    """The notes under the tables: what deferral, overlap and ‡ mean, where they appear."""
    config = result["config"]
    return [note for note in (deferral_note(config), overlap_note(config), recording_note(result["summary"])) if note]


def overlap_note(config: dict) -> str | None:
    if not config.get("overlap"):
        return None
    return ("+overlap: the LLM's calls beside the SLM's steps (--overlap on; on CUDA on a stream of their own), a "
            f"routed row writing up to {config['overlap_ahead']} tokens ahead of the call in flight; its cost model "
            "runs each model at its own full speed while both run (as on two devices): measured / model is what "
            "sharing one device costs.")


def markdown(result: dict) -> str:
    """The summary as a Markdown table (for result pages): one row per shape and system."""
    with_grouping = any(grouped(entry) for entry in result["summary"].values())
    columns = ("LLM",) + COLUMNS + (GROUPED_COLUMNS if with_grouping else ())
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for name, entry in result["summary"].items():
        for row in entry["rows"]:
            cells = [f"{name} ({entry['params_b']:.1f}B)"] + row_cells(row, with_grouping)
            lines.append("| " + " | ".join(cells) + " |")
    for note in notes(result):
        lines += ["", note]
    ks = result["config"]["step_tokens"]
    lines += ["", "What one catch-up over k tokens costs per token read, against a one-token step (the LLM's "
              f"forward on a {result['config']['context']}-token cache):", "",
              "| LLM | " + " | ".join(f"k = {k}" for k in ks) + " |", "|---|" + "---|" * len(ks)]
    for name, entry in result["summary"].items():
        ms = entry["step_ms"]
        lines.append(f"| {name} | " + " | ".join(f"{ms[k]:.0f} ms ({ms[k] / k / ms[ks[0]]:.2f})" if k in ms else "–"
                                                 for k in ks) + " |")
    return "\n".join(lines) + "\n"
