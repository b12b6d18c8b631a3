"""Accuracy from an `r2r eval` results directory against tokens/s from one `r2r bench` run: the speed Pareto
view with speculative decoding in it.

The eval's own tokens/s come from items decoded one after another over hours, beside whatever else the
machine did; the bench measures every system side by side in one run, so its tokens/s are the ones to
compare. Speculative decoding is lossless (strict verification under greedy writes the LLM's own tokens,
tests/test_verification_in_the_loop.py), so its accuracy is the LLM's on the same items.

    python scripts/pareto-speed.py runs/eval-verify/gsm8k runs/bench-verify.json docs/verify-pareto.png

Writes the plot and, beside it, a JSON file with the points.
"""
import json
import re
import sys
from pathlib import Path

from roads_to_rome.plots import pyplot


def bench_name(system: str) -> str | None:
    """The `r2r bench` system that runs the same setting as this eval system (without the backend suffix)."""
    if system in ("slm", "llm"):
        return f"{system.upper()} alone"
    if system == "r2r":
        return "R2R"
    match = re.fullmatch(r"r2r\+verify=(\w+|[\d.]+)", system)
    if match:
        value = match.group(1)
        return f"R2R verify={value if value == 'strict' else float(value)}"
    return None  # entropy and random: `r2r bench` does not run them


def main():
    if len(sys.argv) != 4:
        sys.exit("usage: python scripts/pareto-speed.py EVAL_RESULTS_DIR BENCH_JSON OUT_PNG")
    results_dir, bench_path, out = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    summary_path = results_dir / "summary.json"
    for path in (summary_path, bench_path):
        if not path.is_file():
            sys.exit(f"error: {path} not found (run `r2r eval`, and `r2r bench --out FILE`)")
    summary, bench = json.loads(summary_path.read_text()), json.loads(bench_path.read_text())
    speeds = {re.sub(r" \([^)]*\)$", "", name): s["tokens_per_s"] for name, s in bench["systems"].items()}
    systems = summary["systems"]
    if "llm" not in systems:
        sys.exit(f"error: {results_dir} has no llm results: speculative decoding's accuracy is the LLM's")
    points = []
    for system, s in systems.items():
        name = bench_name(system)
        if name in speeds:
            points.append({"system": system, "accuracy": s["accuracy"], "ci95": s["accuracy_ci95"],
                           "llm_rate": s["llm_rate"], "tokens_per_s": speeds[name]})
    for name, speed in speeds.items():
        if name.startswith("speculative"):
            points.append({"system": name, "accuracy": systems["llm"]["accuracy"],
                           "ci95": systems["llm"]["accuracy_ci95"],
                           "llm_rate": None, "tokens_per_s": speed})
    if not points:
        sys.exit("error: no system is in both the eval results and the bench run")

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.6))
    for i, p in enumerate(points):
        low, high = p["ci95"]
        marker = "s" if p["system"].startswith("speculative") else "o"
        ax.errorbar(p["tokens_per_s"], p["accuracy"], yerr=[[p["accuracy"] - low], [high - p["accuracy"]]],
                    fmt=marker, capsize=3, color=f"C{i % 10}", label=p["system"])
    ax.set_xlabel(f"tokens / s (r2r bench, {bench.get('processor', 'processor not recorded')})", fontsize=8)
    ax.set_ylabel(f"accuracy ({summary['benchmark']} items {summary['ids']})")
    ax.set_title("Accuracy against speed (speculative decoding: the LLM's accuracy)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    out.with_suffix(".json").write_text(json.dumps({"eval": str(results_dir), "bench": str(bench_path),
                                                    "points": points}, indent=2))
    for p in sorted(points, key=lambda p: p["tokens_per_s"]):
        print(f"{p['system']:28s} {p['accuracy']:6.1%}  {p['tokens_per_s']:6.1f} tokens/s")


if __name__ == "__main__":
    main()
