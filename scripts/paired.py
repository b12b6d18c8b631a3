"""Paired comparison of two systems in one `r2r eval` results directory, per 50 items and overall:
accuracy, LLM rate, share of the SLM->LLM gap recovered, items only one of them gets right, exact McNemar p.
Where both systems verify (both roll back), also how often the LLM rejected a token each let through:
the items on which each rolls back less per token, with an exact sign test.

    python scripts/paired.py runs/eval/gsm8k r2r entropy
    python scripts/paired.py runs/eval/gsm8k r2r runs/eval-entropy20/gsm8k:entropy   # B from another directory

A system may be given as DIR:SYSTEM to take its results from another results directory (the same benchmark:
items are matched by id); slm and llm come from RESULTS_DIR.
"""
import sys
from pathlib import Path

from roads_to_rome.data.stats import sign_test
from roads_to_rome.eval.evaluate import read_results


def load(results_dir: Path, system: str) -> dict[str, dict]:
    if ":" in system:  # DIR:SYSTEM
        other, system = system.rsplit(":", 1)
        results_dir = Path(other)
    path = results_dir / f"{system}.jsonl"
    if not path.is_file():
        sys.exit(f"error: {path} not found: give an `r2r eval` results directory holding {system}, slm and llm")
    return {r["id"]: r for r in read_results(path)}  # (a line a kill cut off, or an eval still writing, left out)


def compare(rows: dict[str, dict], a: str, b: str, ids: list[str]) -> str:
    acc = {s: sum(rows[s][i]["correct"] for i in ids) / len(ids) for s in rows}
    rate = {s: sum(rows[s][i]["llm_tokens"] for i in ids) / sum(rows[s][i]["tokens"] for i in ids) for s in (a, b)}
    only_a = sum(rows[a][i]["correct"] and not rows[b][i]["correct"] for i in ids)
    only_b = sum(rows[b][i]["correct"] and not rows[a][i]["correct"] for i in ids)
    p = sign_test(only_a, only_b)
    gap = acc["llm"] - acc["slm"]
    recovered = {s: f"{(acc[s] - acc['slm']) / gap:.0%}" if gap else "n/a" for s in (a, b)}
    return (f"{len(ids)} items | slm {acc['slm']:.1%} llm {acc['llm']:.1%} | {a} {acc[a]:.1%} at {rate[a]:.1%} "
            f"(gap {recovered[a]}) | {b} {acc[b]:.1%} at {rate[b]:.1%} (gap {recovered[b]}) | "
            f"only {a} right {only_a}, only {b} right {only_b}, McNemar p={p:.2g}")


def compare_rollbacks(rows: dict[str, dict], a: str, b: str, ids: list[str]) -> str:
    """Rollbacks per generated token, item by item: where a verifying system rolls back less, its routing let
    fewer tokens through that the LLM rejects (each system's own answer, so the tokens checked differ)."""
    per_token = {s: [rows[s][i]["rollbacks"] / max(rows[s][i]["tokens"], 1) for i in ids] for s in (a, b)}
    fewer_a = sum(x < y for x, y in zip(per_token[a], per_token[b]))
    fewer_b = sum(x > y for x, y in zip(per_token[a], per_token[b]))
    total = {s: sum(rows[s][i]["rollbacks"] for i in ids) for s in (a, b)}
    per_100 = {s: 100 * total[s] / sum(rows[s][i]["tokens"] for i in ids) for s in (a, b)}
    return (f"{a} {total[a]} ({per_100[a]:.2f} / 100 tokens), {b} {total[b]} ({per_100[b]:.2f}) | fewer per token: "
            f"{a} on {fewer_a} items, {b} on {fewer_b}, {len(ids) - fewer_a - fewer_b} tied, sign test "
            f"p={sign_test(fewer_a, fewer_b):.2g}")


def main():
    if len(sys.argv) != 4:
        sys.exit("usage: python scripts/paired.py RESULTS_DIR SYSTEM_A SYSTEM_B   (a system may be OTHER_DIR:SYSTEM)")
    results_dir, a, b = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    if a == b:
        sys.exit(f"error: {a} against itself: give two systems")
    rows = {s: load(results_dir, s) for s in (a, b, "slm", "llm")}
    ids = sorted(set.intersection(*(set(r) for r in rows.values())), key=int)
    if not ids:
        sys.exit(f"error: no item has results for all of {a}, {b}, slm and llm in {results_dir}")
    for start in range(0, int(ids[-1]) + 1, 50):
        chunk = [i for i in ids if start <= int(i) < start + 50]
        if chunk:
            print(f"{start}-{start + 49}: " + compare(rows, a, b, chunk))
    print("all: " + compare(rows, a, b, ids))
    if all(any(rows[s][i].get("rollbacks") for i in ids) for s in (a, b)):  # both verify (verify off: none)
        print("rollbacks: " + compare_rollbacks(rows, a, b, ids))


if __name__ == "__main__":
    main()
