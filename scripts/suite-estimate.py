"""What `make test` from a fresh machine would take on the AVX2-only EPYC (Zen 3, no native bf16), from a run on
the AMX Xeon (family 6 model 167): its set-up x 2.36 and unit phase x 1.94 (docs/results/2026-12-05-suite-fresh-xeon.md:
the ratios of that machine's runs to the Xeon's), and each of the end-to-end phase's 30 slowest steps by the ratio
earlier pages measured for it (or for the steps it merged), the rest x 1.94. The ratios are that Xeon's: a run on
another processor is scaled instead, phase by phase, against a run of a commit whose estimate is known, on that same
processor (docs/results/2026-12-06-suite-fresh-zen4.md).

The log is `make test`'s output with each line prefixed by the Unix time it was printed:

    XDG_CACHE_HOME=$(mktemp -d) make test 2>&1 | while IFS= read -r l; do echo "$(date +%s) $l"; done > test.log
    python scripts/suite-estimate.py test.log

An estimate, not a measurement, and a high one: the ratios come from an older run on that machine, and the steps
that changed on both sides since ran faster there than they say (docs/results/2026-12-06-suite-fresh-avx2.md
measured `make test` on it). A run on that machine is what settles it.
"""

import re
import sys

SETUP_RATIO, UNIT_RATIO = 2.36, 1.94
# (part of the step's name, pytest phase or None for any, AVX2/here ratio, where the ratio comes from)
RATIOS = [
    ("always_the_llm_and_strict", "setup", 0.0, "where float32 is all there is, the SLM proof's pair is this one"),
    ("always_the_llm_and_strict", "call", 2.77, "(222.1 + 119.4) / (68.5 + 54.9): the two steps it merged"),
    ("always_the_slm_equals", None, 4.66, "(73.56 + 65.71 setup) / (25.26 + 4.6 setup): float32 there"),
    ("strict_verification_gives_the_llms_greedy_output_on_llamacpp", "call", 2.11, "103.8 / 49.2"),
    ("on_llamacpp_equals_llamacpps_own_greedy_output[llm]", "call", 1.30, "78.8 / 60.5"),
    ("hardened_server", "call", 2.00, "94.9 / 47.4"),
    ("remote_llm_end_to_end", "call", 1.84, "99.2 / 54.0"),
    ("imported_reference_router", "call", 2.09, "93.9 / 45.0"),
    ("eval_grades", "call", 1.72, "84.0 / 48.8"),
    ("eval_fills_in", "call", 2.31, "74.3 / 32.2"),
    ("shipped_router_is_the_default", "call", 1.72, "64.1 / 37.3"),
    ("stalled_llm_holds", "call", 1.01, "55.8 / 55.0 (a wall-clock bound)"),
    ("one_router_serves_both", "call", 3.73, "93.62 / 25.11"),
]


def main(path: str) -> None:
    log = []
    for line in open(path).read().splitlines():
        stamp, _, text = line.partition(" ")
        if stamp.isdigit():
            log.append((int(stamp), text.strip()))
    start, end = log[0][0], log[-1][0]
    unit_start = next(t for t, text in log if text.startswith("== unit tests"))
    e2e_start = next(t for t, text in log if text.startswith("== fault and end-to-end"))
    setup, unit, e2e = unit_start - start, e2e_start - unit_start, end - e2e_start
    print("set-up steps (each one's own time; some run at once):")
    step = ""
    for _, text in log:
        if text.startswith("== set-up:"):
            step = text.removeprefix("== set-up: ")
        elif text.startswith("took "):
            print(f"  {text.removeprefix('took ')}: {step}")
    slowest = max(i for i, (_, text) in enumerate(log) if "slowest 30 durations" in text)
    steps = []
    for _, text in log[slowest + 1:slowest + 31]:
        if m := re.match(r"([\d.]+)s (\w+)\s+(\S+)", text):
            steps.append((float(m[1]), m[2], m[3]))
    total = float(re.search(r" in ([\d.]+)s", next(text for _, text in log[slowest:] if " passed" in text))[1])
    rows, estimate = [], 0.0
    for seconds, phase, name in steps:
        ratio = next((r for part, ph, r, _ in RATIOS if part in name and ph in (None, phase)), UNIT_RATIO)
        rows.append((seconds, ratio, phase, name.split("::")[-1]))
        estimate += seconds * ratio
    rest = total - sum(s for s, _, _ in steps)
    estimate += (rest + e2e - total) * UNIT_RATIO  # the other steps, and pytest's start-up and collection
    print("\n| step | s here | x | AVX2 estimate, s |\n|---|---|---|---|")
    for seconds, ratio, phase, name in rows:
        print(f"| {name} ({phase}) | {seconds:.1f} | {ratio:.2f} | {seconds * ratio:.0f} |")
    print(f"| the other steps, start-up and collection | {rest + e2e - total:.1f} | {UNIT_RATIO} | "
          f"{(rest + e2e - total) * UNIT_RATIO:.0f} |")
    avx2 = setup * SETUP_RATIO + unit * UNIT_RATIO + estimate
    print("\n| | here, s | AVX2 estimate, s |\n|---|---|---|")
    print(f"| set-up | {setup} | {setup * SETUP_RATIO:.0f} (x {SETUP_RATIO}) |")
    print(f"| unit tests | {unit} | {unit * UNIT_RATIO:.0f} (x {UNIT_RATIO}) |")
    print(f"| fault and end-to-end tests | {e2e} | {estimate:.0f} (per step; {e2e * UNIT_RATIO:.0f} at x "
          f"{UNIT_RATIO} throughout) |")
    print(f"| **`make test`** | **{end - start} ({(end - start) / 60:.1f} min)** | **{avx2:.0f} ({avx2 / 60:.1f} "
          f"min)** |")
    print("\nratios:")
    for part, phase, ratio, why in RATIOS:
        print(f"  {part} ({phase or 'any'}): x {ratio}: {why}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python scripts/suite-estimate.py MAKE_TEST_LOG (each line prefixed by its Unix time)")
    main(sys.argv[1])
