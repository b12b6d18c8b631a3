"""Grouped LLM calls on a GPU, by simulation until one is lent: the schedule simulator of `r2r bench shapes`
(`bench.cost_model.routing_calls`) driven by the step costs a batched `r2r bench shapes` run measured, at larger
batches too.

    python scripts/grouping-sim.py docs/results/2026-11-26-gpu-h200/run4-r1-32b-batched.json \
        --batch 4,8,16,32 --share 0.11 --accept 0,0.8 --json out.json

Step costs at a batch the run did not measure are extended linearly in rows from the two largest it measured
(at each k: t(b, k) = t(b2, k) + (t(b2, k) - t(b1, k)) / (b2 - b1) * (b - b2)), which is what a GPU does while
its reads stay bound by the weights, and an over-estimate of the cost once they are compute-bound. With
--one-row (a CPU run measured at batch 1 only), b rows × k tokens cost what one row's read of b·k tokens cost:
t(b, k) = t(1, b·k), close on a compute-bound CPU. The rule's settings are swept (--group, --steps) so that the
default can be read off; each figure is × the LLM alone at the same batch and × lockstep R2R.

With --overlap, also the LLM's calls beside the SLM's steps (`cost_model.overlapped_seconds`), sent as soon as a row
waits or by the grouping rule (the first --group and --steps), for each lead budget (--ahead), once per --contention:
0 for the LLM on a second GPU (nothing shared), up to 1 for one GPU whose bandwidth both models' steps would need in
full (each at half speed while both run). Batch 1 is priced from the run's one-row tables where it has them."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from roads_to_rome.bench import cost_model
from roads_to_rome.core.llm_calls import Deferral


def one_row_costs(table: dict, batch: int) -> dict[int, float]:
    one = cost_model.ms_keys(table)
    return {k: cost_model.cost_at(one, batch * k) for k in one}


def step_costs(tables: dict, batch: int) -> dict[int, float]:
    measured = sorted(int(b) for b in tables)
    if batch in measured:
        return cost_model.ms_keys(tables[str(batch)])
    b1, b2 = measured[-2], measured[-1]
    t1, t2 = cost_model.ms_keys(tables[str(b1)]), cost_model.ms_keys(tables[str(b2)])
    return {k: t2[k] + (t2[k] - t1[k]) / (b2 - b1) * (batch - b2) for k in t2 if k in t1}


def numbers(text: str, kind=float) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="a `r2r bench shapes --batch` results file with batched steps")
    parser.add_argument("--shape", help="the LLM shape in it (default: its first)")
    parser.add_argument("--batch", default="4,8,16,32")
    parser.add_argument("--share", type=float, default=0.11)
    parser.add_argument("--accept", default="0,0.8", help="shares of deferred routed tokens the LLM keeps")
    parser.add_argument("--group", default="0.4,0.5,0.6,0.75,1")
    parser.add_argument("--steps", default="8,16,32")
    parser.add_argument("--tokens", type=int, help="new tokens per row (default: the run's)")
    parser.add_argument("--samples", type=int, default=10)
    parser.add_argument("--one-row", action="store_true", help="price b rows from the batch-1 step tables")
    parser.add_argument("--overlap", action="store_true", help="also predict the LLM's calls beside the SLM's steps")
    parser.add_argument("--contention", default="0,0.3,1", help="with --overlap: how much the two models slow each "
                        "other while both run (0: a second GPU; 1: each at half speed)")
    parser.add_argument("--ahead", default="2", help="with --overlap: the rows' lead budgets (`Deferral.ahead`)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    result = json.loads(args.results.read_text())
    name = args.shape or next(iter(result["shapes"]))
    entry = result["shapes"][name]
    tokens = args.tokens or result["config"]["tokens"]
    widths = [max(w for ws in result.get("batch_prompt_widths", {"1": result["prompt_tokens"]}).values()
                  for w in ws)]  # the widest padded prompt
    own_slm = result.get("slm")  # a random-weight SLM's own table, else the default SLM's (as the summary reads it)
    slm_one = own_slm["steps"] if own_slm else result["real"]["steps"]["slm"]
    rows = []
    print(f"{name}, {args.share:.0%} LLM tokens, {tokens} tokens per row, step costs from {args.results} "
          f"({result.get('device_name') or result['processor']}); ×: against the LLM alone at the same batch")
    for batch in numbers(args.batch, int):
        if args.one_row or (batch == 1 and "1" not in result.get("slm_batched_steps", {})):
            slm_ms, llm_ms = one_row_costs(slm_one, batch), one_row_costs(entry["steps"], batch)
        else:
            slm_ms, llm_ms = step_costs(result["slm_batched_steps"], batch), step_costs(entry["batched_steps"], batch)
        alone = cost_model.predicted_alone_tok_s(llm_ms, widths, tokens, batch)
        lockstep = cost_model.predicted_routing_tok_s(slm_ms, llm_ms, args.share, widths, tokens, args.samples, batch)
        row = {"batch": batch, "llm_alone": alone, "lockstep": lockstep, "grouped": {}}
        print(f"batch {batch}: LLM alone {alone:.1f} tok/s, lockstep R2R {lockstep:.1f} ({lockstep / alone:.2f}×)")
        for mode in ("continue", "park"):
            for accept in numbers(args.accept) if mode == "continue" else [0.0]:
                cells = []
                for group in numbers(args.group):
                    for steps in numbers(args.steps, int):
                        rule = Deferral(mode, group, steps)
                        tok_s = cost_model.predicted_routing_tok_s(slm_ms, llm_ms, args.share, widths, tokens,
                                                                   args.samples, batch, rule, accept)
                        row["grouped"][f"{mode} accept={accept:g} group={group:g} steps={steps}"] = tok_s
                        cells.append(f"{group:g}/{steps}: {tok_s / alone:.2f}× ({tok_s / lockstep:.2f}× lockstep)")
                print(f"  {mode}{f' (kept {accept:.0%})' if mode == 'continue' else ''}: " + "  ".join(cells))
        if args.overlap:
            row["overlapped"] = {}
            grouped = Deferral("continue", numbers(args.group)[0], numbers(args.steps, int)[0])
            for rule_name, base in (("at once", Deferral()), (f"grouped {grouped.group:g}/{grouped.steps}", grouped)):
                for ahead in numbers(args.ahead, int):
                    rule, cells = dataclasses.replace(base, ahead=ahead), []
                    for accept in numbers(args.accept):
                        for contention in numbers(args.contention):
                            tok_s = cost_model.predicted_overlapped_tok_s(slm_ms, llm_ms, args.share, widths, tokens,
                                                                          args.samples, batch, accept, contention,
                                                                          rule)
                            key = f"{rule_name} ahead={ahead} accept={accept:g} contention={contention:g}"
                            row["overlapped"][key] = tok_s
                            cells.append(f"kept {accept:.0%}, contention {contention:g}: {tok_s / alone:.2f}× "
                                         f"({tok_s / lockstep:.2f}× lockstep)")
                    print(f"  overlapped, calls {rule_name}, ahead {ahead}: " + "  ".join(cells))
        rows.append(row)
    if args.json:
        args.json.write_text(json.dumps({"results": str(args.results), "shape": name, "share": args.share,
                                         "tokens": tokens, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
