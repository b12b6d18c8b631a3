"""`r2r bench shapes` with two tiny random shapes added beside the published ones, to run a GPU part's command through
on a CPU in seconds before device time is spent on it (every system runs, a run cut short resumes from its file).
The shapes keep the real tokenizer's vocabulary, so the prepared `.gpu/cache` (scripts/gpu-prepare.sh) serves them;
their figures time Python on a toy and say nothing of speed. Arguments after the script are `r2r`'s, e.g. the
`r1-grouped` part of scripts/gpu-run.sh on the CPU:

    R2R_CACHE=.gpu/cache python scripts/shapes-dry-run.py bench shapes --backend torch --device cpu --verify "" \\
      --spec-k "" --real-from docs/results/2026-11-26-grouped-amx/shapes-7b.json --tokens 32 --prompts 1 \\
      --slm-shape tiny-slm --llm-shape tiny-llm --llm-share 0.11 --batch 1,4,8 --overlap 1,8 --out runs/dry.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))

from roads_to_rome.bench import shape_models  # noqa: E402
from roads_to_rome.cli.main import main  # noqa: E402

for shape in (shape_models.LlmShape("tiny-slm", "test", 64, 2, 4, 2, 128, 151936, False),
              shape_models.LlmShape("tiny-llm", "test", 128, 3, 4, 2, 256, 152064, False, 1e-5)):
    shape_models.SHAPES[shape.name] = shape
sys.argv = ["r2r", *sys.argv[1:]]
main()
