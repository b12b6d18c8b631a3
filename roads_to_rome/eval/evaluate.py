"""The evaluation harness: systems x benchmark items -> per-item results -> summary, plots, report.

Per-item results go to `OUT/<benchmark>/<system>.jsonl`, one line per item as soon as it is graded,
so a killed run resumes where it stopped. Summaries are always recomputed from those files.
"""

from __future__ import annotations

import base64
import dataclasses
import html
import json
import time
from dataclasses import dataclass
from pathlib import Path

from roads_to_rome import files, models
from roads_to_rome.core.engine import Engine
from roads_to_rome.core.request import Request
from roads_to_rome.core.sampling import SamplingParams, check_max_unverified, parse_verify
from roads_to_rome.data import benchmarks
from roads_to_rome.data.stats import wilson
from roads_to_rome.errors import R2RError
from roads_to_rome.eval import grading
from roads_to_rome.models import load_pair
from roads_to_rome.models.systems import ENTROPY_WARMUP_THRESHOLD, ROUTED, SYSTEMS, System, alone
from roads_to_rome.plots import pyplot
from roads_to_rome.progress import QUIET
from roads_to_rome.routing import policies
from roads_to_rome.routing.rate import threshold_at_rate
from roads_to_rome.text import token_pieces


def read_results(path: Path) -> list[dict]:
    """Per-item results; a line cut off by a kill is ignored (that item runs again)."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def run_system(benchmark: str, items: list[benchmarks.Item], spec: System, engine: Engine, params: SamplingParams,
               out_dir: Path, batch_size: int, progress=QUIET, chat_template: str | None = None):
    """Run `spec` on the items it has no results for yet, appending each batch's rows; `chat_template`: the one
    given for the tokenizer's (`--chat-template`), which the results depend on."""
    path = out_dir / f"{spec.name}.jsonl"
    config_path = out_dir / f"{spec.name}.config.json"
    config = {"benchmark": benchmark, "system": spec.name, "max_new_tokens": params.max_new_tokens,
              "stop": list(params.stop),
              # The model that writes is in the "slm" slot (the LLM, for the LLM alone): results files key on it.
              "slm": engine.writer.name, "llm": engine.llm.name if engine.routes else None, "value": spec.value,
              # Speed depends on the backend: resuming on another one would mix timings in one file.
              "backends": [type(b).__name__ for b in (engine.writer, engine.llm if engine.routes else None) if b],
              # A retrained router is another system: its results must not join the old one's.
              "router": getattr(engine.policy, "identity", None),
              "verify": engine.verify.value, "max_unverified": engine.max_unverified}
    if spec.warmup is not None:
        config["warmup"] = spec.warmup
    if chat_template is not None:  # (absent otherwise: runs before the option resume as they were)
        config["chat_template"] = models.template_hash(chat_template)

    def busy():
        raise R2RError(f"another process is running {spec.name} into {out_dir} now ({config_path} is locked): wait "
                       "for it to end, or give another --out")

    # One process at a time appends to a system's results: two would run the same items and write each twice. The
    # lock is on the config file, which is rewritten in place, not on the results, which a repair replaces.
    with files.exclusive(config_path, busy):
        run_locked(benchmark, items, spec, engine, params, path, config_path, config, batch_size, progress)


def run_locked(benchmark: str, items: list[benchmarks.Item], spec: System, engine: Engine, params: SamplingParams,
               path: Path, config_path: Path, config: dict, batch_size: int, progress) -> None:
    recorded = config_path.read_text()  # (empty: made by the lock)
    if recorded and json.loads(recorded) != config:
        raise R2RError(f"{path} holds results of another configuration ({config_path}); use another --out "
                       "or delete those files")
    config_path.write_text(json.dumps(config, indent=2))
    rows = read_results(path)
    text = path.read_text() if path.exists() else ""
    if text and (not text.endswith("\n") or len(text.splitlines()) != len(rows)):
        # A line cut off by a kill: drop it before appending, or the next row would be glued onto it.
        partial = path.with_suffix(".repair")
        partial.write_text("".join(json.dumps(row) + "\n" for row in rows))
        partial.replace(path)
    done = {row["id"] for row in rows}
    todo = [item for item in items if item.id not in done]
    task = progress.add_task(f"{benchmark} {spec.name}", total=len(items), completed=len(items) - len(todo))
    with path.open("a") as f:
        for start in range(0, len(todo), batch_size):
            chunk = todo[start : start + batch_size]
            requests = [Request(engine.prompts.prompt(item.prompt, item.suffix), params, target_rate=spec.target_rate)
                        for item in chunk]
            began = time.perf_counter()
            for item, gen in zip(chunk, engine.run(requests)):
                extracted, correct = grading.grade(benchmark, item, gen.text)
                sources = "".join({"llm": "L", "fix": "F"}.get(s, "S") for s in gen.sources)
                row = {"id": item.id, "output": gen.text, "extracted": extracted, "correct": correct,
                       "tokens": len(gen.token_ids), "llm_tokens": gen.llm_tokens, "avg_params_b": gen.avg_params_b,
                       "rollbacks": gen.rollbacks, "discarded": gen.discarded,
                       "time_s": gen.elapsed_s, "batch_time_s": time.perf_counter() - began,
                       "finish_reason": gen.finish_reason, "sources": sources, "token_ids": gen.token_ids}
                f.write(json.dumps(row) + "\n")
                f.flush()
            progress.advance(task, len(chunk))


def summarize(rows: list[dict]) -> dict:
    """A system's summary, from its per-item rows alone."""
    n = len(rows)
    correct = sum(r["correct"] for r in rows)
    tokens = sum(r["tokens"] for r in rows)
    llm_tokens = sum(r["llm_tokens"] for r in rows)
    seconds = sum(r["time_s"] for r in rows)
    low, high = wilson(correct, n)
    return {
        "items": n,
        "accuracy": correct / n if n else 0.0,
        "accuracy_ci95": [low, high],
        "llm_rate": llm_tokens / tokens if tokens else 0.0,
        # token-weighted, like llm_rate: the average over every generated token
        "avg_params_b": sum(r["avg_params_b"] * r["tokens"] for r in rows) / tokens if tokens else 0.0,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "rollbacks_per_100_tokens": 100 * sum(r.get("rollbacks", 0) for r in rows) / tokens if tokens else 0.0,
        "mean_latency_s": seconds / n if n else 0.0,
        "mean_tokens": tokens / n if n else 0.0,
    }


def routing_profile(rows: list[dict], bins: int = 10) -> list[float]:
    """LLM rate by relative position in the response (the paper's routing-behaviour figure)."""
    routed, total = [0] * bins, [0] * bins
    for r in rows:
        n = len(r["sources"])
        for i, s in enumerate(r["sources"]):
            b = min(int(i / n * bins), bins - 1)
            total[b] += 1
            routed[b] += s in "LF"  # routed, or put in by verification
    return [x / t if t else 0.0 for x, t in zip(routed, total)]


def summaries(out_dir: Path, item_ids: set[str] | None = None) -> dict[str, dict]:
    """Per-system summaries of a results directory, the two single-model baselines first. Where the SLM and the
    LLM ran on the same items, every other system that ran on exactly those items also gets `gap_recovered`: the
    share of the SLM->LLM accuracy gap it closes (the paper's measure; on other items it would mean nothing)."""
    result, ran_on = {}, {}
    for path in sorted(out_dir.glob("*.jsonl"), key=lambda p: ({"slm": 0, "llm": 1}.get(p.stem, 2), p.stem)):
        rows = [r for r in read_results(path) if item_ids is None or r["id"] in item_ids]
        if rows:
            result[path.stem], ran_on[path.stem] = summarize(rows), {r["id"] for r in rows}
    if "slm" in result and "llm" in result and ran_on["slm"] == ran_on["llm"]:
        low, high = result["slm"]["accuracy"], result["llm"]["accuracy"]
        for name, summary in result.items():
            if name not in ("slm", "llm") and ran_on[name] == ran_on["slm"] and high != low:
                summary["gap_recovered"] = (summary["accuracy"] - low) / (high - low)
    return result


def gap_cell(summary: dict) -> str:
    return f"{summary['gap_recovered']:.0%}" if "gap_recovered" in summary else "–"


def markdown_table(table: dict[str, dict]) -> str:
    lines = ["| system | items | accuracy (95% CI) | LLM rate | SLM→LLM gap closed | avg. params (B) | tokens/s | "
             "latency (s) | rollbacks / 100 tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for name, s in table.items():
        low, high = s["accuracy_ci95"]
        lines.append(f"| {name} | {s['items']} | {s['accuracy']:.1%} ({low:.1%}–{high:.1%}) | {s['llm_rate']:.1%} | "
                     f"{gap_cell(s)} | "
                     f"{s['avg_params_b']:.3f} | {s['tokens_per_s']:.2f} | {s['mean_latency_s']:.1f} | "
                     f"{s.get('rollbacks_per_100_tokens', 0.0):.2f} |")
    return "\n".join(lines)


def system_colors(names) -> dict[str, str]:
    """One colour per system, the same in every plot of a report."""
    return {name: f"C{i % 10}" for i, name in enumerate(names)}


def plot(table: dict[str, dict], colors: dict[str, str], out_dir: Path, title: str) -> list[Path]:
    """Accuracy against average activated parameters and against tokens/s: the Pareto view."""
    plt = pyplot()

    paths = []
    for key, label, name in (("avg_params_b", "average activated parameters (B)", "pareto_params.png"),
                             ("tokens_per_s", "tokens / s", "pareto_speed.png")):
        fig, ax = plt.subplots(figsize=(6, 4.2))
        for system, s in table.items():
            low, high = s["accuracy_ci95"]
            ax.errorbar(s[key], s["accuracy"], yerr=[[s["accuracy"] - low], [high - s["accuracy"]]], fmt="o",
                        capsize=3, label=system, color=colors[system])
        # One dashed line per swept system ("r2r", "r2r@0.3", ...): the table may hold several kinds' sweeps.
        for kind in {system.split("@")[0] for system in table if "@" in system}:
            sweep = sorted((s[key], s["accuracy"]) for system, s in table.items() if system.split("@")[0] == kind)
            if len(sweep) > 1:
                ax.plot(*zip(*sweep), "--", color="grey", linewidth=1)
        ax.set_xlabel(label)
        ax.set_ylabel("accuracy")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths


def plot_routing(profiles: dict[str, list[float]], colors: dict[str, str], out_dir: Path) -> Path | None:
    plt = pyplot()

    if not profiles:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for system, profile in profiles.items():
        xs = [(i + 0.5) / len(profile) for i in range(len(profile))]
        ax.plot(xs, profile, marker="o", label=system, color=colors[system])
    ax.set_xlabel("relative position in the response")
    ax.set_ylabel("LLM rate")
    ax.set_title("Where the LLM is used")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "routing_by_position.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def html_report(benchmark: str, table: dict[str, dict], images: list[Path], examples: list[tuple[str, dict]],
                tokenizer, out_dir: Path) -> Path:
    def image(path: Path) -> str:
        data = base64.b64encode(path.read_bytes()).decode()
        return f'<img src="data:image/png;base64,{data}" alt="{path.stem}">'

    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{s['items']}</td><td>{s['accuracy']:.1%} "
        f"({s['accuracy_ci95'][0]:.1%}–{s['accuracy_ci95'][1]:.1%})</td><td>{s['llm_rate']:.1%}</td>"
        f"<td>{gap_cell(s)}</td><td>{s['avg_params_b']:.3f}</td><td>{s['tokens_per_s']:.2f}</td>"
        f"<td>{s['mean_latency_s']:.1f}</td><td>{s.get('rollbacks_per_100_tokens', 0.0):.2f}</td></tr>"
        for name, s in table.items())
    answers = []
    for system, row in examples:
        mark = "✓" if row["correct"] else "✗"
        answers.append(f"<h3>{html.escape(system)} · item {html.escape(row['id'])} · {mark} · "
                       f"{row['llm_tokens']}/{row['tokens']} LLM tokens</h3><pre>{highlight(row, tokenizer)}</pre>")
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>R2R eval: {benchmark}</title>
<style>body{{font:14px/1.45 system-ui,sans-serif;max-width:980px;margin:2em auto;padding:0 1em}}
table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:.3em .6em;text-align:right}}
td:first-child{{text-align:left}}pre{{white-space:pre-wrap;background:#fafafa;border:1px solid #eee;padding:.8em}}
.llm{{background:#ffe066}}.fix{{background:#b2f2bb}}img{{max-width:48%;margin:.5em 1% 0 0}}</style></head><body>
<h1>R2R evaluation: {html.escape(benchmark)}</h1>
<table><tr><th>system</th><th>items</th><th>accuracy (95% CI)</th><th>LLM rate</th><th>SLM→LLM gap closed</th>
<th>avg. params (B)</th>
<th>tokens/s</th><th>latency (s)</th><th>rollbacks / 100 tokens</th></tr>{rows}</table>
<h2>Accuracy against cost</h2>{''.join(image(p) for p in images if p)}
<h2>Answers</h2><p>Highlighted text came from the LLM: yellow where the router sent it, green where verification
put it in.</p>{''.join(answers)}</body></html>"""
    path = out_dir / "report.html"
    path.write_text(page)
    return path


def highlight(row: dict, tokenizer) -> str:
    """The answer with its LLM-produced tokens marked: routed ones (L) and verification's fixes (F)."""
    pieces = token_pieces(tokenizer, row["token_ids"])
    classes = {"L": "llm", "F": "fix"}
    return "".join(f'<span class="{classes[s]}">{html.escape(p)}</span>' if s in classes else html.escape(p)
                   for p, s in zip(pieces, row["sources"]))


DEFAULT_LLM_RATE = 0.15
DEFAULT_SPEC_K = 4


@dataclass(frozen=True)
class EvalConfig:
    """One `r2r eval` run: the systems, the items, the pair they share, and how the routed systems are set up.
    Checked when made, before any model loads."""

    benchmark: str
    systems: tuple[str, ...]
    out: Path  # results go to OUT/BENCHMARK/
    ids: str | None = None  # items by position: "0-199", "0,5,9-12" (None: all)
    max_new_tokens: int = 512
    batch_size: int = 1  # items decoded together
    slm: str | None = None
    llm: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    backend: str = "auto"
    router_path: Path | None = None  # None: the shipped router for the default SLM
    threshold: float | None = None  # r2r's threshold (None: the router's calibrated one)
    llm_rate: float | None = None  # entropy and random's target LLM rate when r2r is not among the systems (None: 0.15)
    sweep: tuple[float, ...] = ()  # r2r thresholds (or entropy LLM rates without a router), one system each
    verify: tuple[str | float, ...] = ("off",)  # verification settings of the routed systems, one system each
    max_unverified: int | None = None
    spec_k: int | None = None  # the spec system's draft tokens per check (None: 4)
    chat_template: str | None = None  # a Jinja chat template, or a file holding one, for the tokenizer's own

    def __post_init__(self):
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if not self.systems or unknown:
            raise R2RError(f"--systems takes a comma-separated subset of {','.join(SYSTEMS)}; unknown: {unknown}")
        self._check_unread()
        object.__setattr__(self, "llm_rate", DEFAULT_LLM_RATE if self.llm_rate is None else self.llm_rate)
        object.__setattr__(self, "spec_k", DEFAULT_SPEC_K if self.spec_k is None else self.spec_k)
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.spec_k < 1:
            raise R2RError("--max-new-tokens, --batch-size and --spec-k must be at least 1")
        if not 0 <= self.llm_rate <= 1 or any(not 0 <= v <= 1 for v in self.sweep):
            raise R2RError("--llm-rate and --sweep values must be in [0, 1]")
        object.__setattr__(self, "verify", tuple(parse_verify(v) for v in self.verify))
        check_max_unverified(self.max_unverified, any(v.on for v in self.verify))
        if any(v.on for v in self.verify) and not (set(self.systems) & set(ROUTED) or self.sweep):
            raise R2RError(f"--verify makes verified copies of r2r, entropy and random (and --sweep's systems), and "
                           f"--systems {','.join(self.systems)} has none: add one, or leave --verify out")
        if self.chat_template is not None:
            object.__setattr__(self, "chat_template", models.read_chat_template(self.chat_template))

    def _check_unread(self) -> None:
        """A setting no chosen system reads is refused: a table made without it would be taken for one made with it."""
        given = set(self.systems)
        unread = [(option, reader) for option, value, reader, read in (
            ("--threshold", self.threshold, "r2r's", "r2r" in given),
            ("--router-path", self.router_path, "r2r's and --sweep's", "r2r" in given or bool(self.sweep)),
            ("--spec-k", self.spec_k, "the spec system's", "spec" in given),
            ("--llm-rate", self.llm_rate, "entropy's and random's where r2r is not run (beside r2r they match its "
             "rate)", bool(given & {"entropy", "random"}) and "r2r" not in given))
            if value is not None and not read]
        if unread:
            option, reader = unread[0]
            raise R2RError(f"{option} is {reader}, and --systems {','.join(self.systems)} does not read it: choose "
                           "the systems it is for, or leave it out")


def entropy_at_rate(slm, tokenizer, items: list[benchmarks.Item], rows: list[dict], rate: float) -> float:
    """The entropy threshold that routes `rate` of the tokens of these answers (R2R's `rows`), by the SLM's entropy
    at each of them: what an entropy baseline matched to R2R's rate routes at until a request has scores enough to
    aim by, and throughout an answer shorter than that (a line of code), where aiming never starts."""
    import torch

    encoder, by_id, scores = alone(slm, tokenizer, "slm"), {r["id"]: r for r in rows}, []
    for item in items:
        written = by_id.get(item.id, {}).get("token_ids")
        if written:
            prompt = encoder.prompts.prompt(item.prompt, item.suffix)
            logits, _ = slm.forward_sequence(prompt + written[:-1], len(prompt) - 1)
            scores.append(policies.entropy(logits))
    return threshold_at_rate(torch.cat(scores), rate) if scores else ENTROPY_WARMUP_THRESHOLD


def evaluate(config: EvalConfig, console) -> dict:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    c, benchmark = config, config.benchmark
    items = benchmarks.select(benchmarks.load(benchmark), c.ids)
    out_dir = c.out / benchmark
    out_dir.mkdir(parents=True, exist_ok=True)
    system_names = list(c.systems)
    needs_llm = any(s != "slm" for s in system_names) or bool(c.sweep)
    slm_b, llm_b, tokenizer = load_pair(c.slm, c.llm, c.device, need_llm=needs_llm, dtype=c.dtype, backend=c.backend,
                                        chat_template=c.chat_template)
    router_path = models.router_path_for(c.router_path, c.slm)
    if router_path is not None:
        policies.build("router", slm_b, c.threshold, router_path)  # refuse a router of another SLM before any run
    params = SamplingParams(max_new_tokens=c.max_new_tokens, stop=benchmarks.STOP.get(benchmark, ()))
    item_ids = {item.id for item in items}

    # R2R first: the baselines are matched to the LLM rate it reaches on these items.
    order = sorted(system_names, key=lambda s: s != "r2r")
    specs = [System(f"spec+k={c.spec_k}", name, c.spec_k) if name == "spec"
             else System(name, name, c.threshold if name == "r2r" else None) for name in order]
    sweep_kind = "r2r" if router_path is not None else "entropy"
    specs += [System(f"{sweep_kind}@{v:g}", sweep_kind, v) for v in c.sweep]
    specs = [s.with_verify(v, c.max_unverified) if s.kind in ROUTED else s
             for s in specs for v in (c.verify if s.kind in ROUTED else ["off"])]

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=console) as progress:
        for spec in specs:
            if spec.kind in ("entropy", "random") and spec.value is None:
                r2r_rows = [r for r in read_results(out_dir / "r2r.jsonl") if r["id"] in item_ids]
                matched = "r2r" in system_names and r2r_rows
                rate = summarize(r2r_rows)["llm_rate"] if matched else c.llm_rate
                spec = dataclasses.replace(spec, value=round(rate, 4))
                if matched and spec.kind == "entropy":
                    spec = dataclasses.replace(spec, warmup=round(entropy_at_rate(slm_b, tokenizer, items, r2r_rows,
                                                                                  rate), 4))
            engine = spec.engine(slm_b, llm_b, tokenizer, router_path)
            run_system(benchmark, items, spec, engine, params, out_dir, c.batch_size, progress, c.chat_template)

    return report(c, items, out_dir, tokenizer)


def report(c: EvalConfig, items: list, out_dir, tokenizer) -> dict:
    """The summary of every system with results in `out_dir` for these items, not only this call's (a benchmark
    run in chunks, or a baseline run on its own, still ends in one table and one plot): summary.json, the plots,
    the HTML page with a few examples. Returns the table."""
    benchmark, item_ids = c.benchmark, {item.id for item in items}
    table = summaries(out_dir, item_ids)
    names = list(table)
    (out_dir / "summary.json").write_text(json.dumps(
        {"benchmark": benchmark, "ids": c.ids, "max_new_tokens": c.max_new_tokens, "systems": table}, indent=2))
    colors = system_colors(names)
    images = plot(table, colors, out_dir, f"{benchmark} ({len(items)} items)")
    profiles = {name: routing_profile([r for r in read_results(out_dir / f"{name}.jsonl") if r["id"] in item_ids])
                for name in names if name not in ("slm", "llm")}
    images.append(plot_routing(profiles, colors, out_dir))
    examples = []
    for name in names:
        rows = [r for r in read_results(out_dir / f"{name}.jsonl") if r["id"] in item_ids]
        examples += [(name, r) for r in rows if name != "llm" and "token_ids" in r][:2]
    html_report(benchmark, table, images, examples[:6], tokenizer, out_dir)
    return table
