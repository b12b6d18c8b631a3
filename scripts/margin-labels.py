"""On-policy margin labels (an experiment for issue 20): the SLM writes the responses, the LLM reads them, and a
token is `divergent` where the LLM's log-probability of the SLM's token is more than TOL nats below its own choice
(the rule verification with tolerance TOL rejects), `neutral` where the two differ by less, `identical` where they
agree. The output directory is a label dataset `r2r train` reads (responses/ and labels.parquet).

    python scripts/margin-labels.py PROMPTS.jsonl OUT TOL [N]     # the first N prompts; re-run to resume

Measured on the default pair (240 math prompts, 1 nat): recall of divergent tokens on held-out prompts 77% at 10%
LLM tokens against entropy's 65%, yet on GSM8K no more accurate than entropy routing at the same share.
"""
import sys
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from rich.progress import Progress

from r2r import labels
from r2r.engine import Engine
from r2r.models import load_pair

prompts, out, tolerance = Path(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])
limit = int(sys.argv[4]) if len(sys.argv) > 4 else None
slm, llm, tokenizer = load_pair(backend="llamacpp")
with Progress() as progress, torch.inference_mode():
    labels.step_responses(labels.load_prompts(prompts)[:limit], Engine.alone(slm, tokenizer, "slm"), out, 512, 4,
                          progress)
    labels.step_prefill(slm, out, progress)  # the SLM's own argmax and entropy at every position
    responses = labels.Parts(out, "responses").rows()
    margins = labels.Parts(out, "margins")
    done = margins.done()
    task = progress.add_task("the LLM reads each response", total=len(responses), completed=len(done))
    for r in responses:
        if r["id"] in done:
            continue
        ids, start = r["prompt_ids"] + r["response_ids"], len(r["prompt_ids"]) - 1
        llm_logprobs = torch.log_softmax(llm.prefill(ids[:-1], start)[0].float(), -1)
        written = torch.tensor(r["response_ids"])[:, None]
        gap = llm_logprobs.max(-1).values - llm_logprobs.gather(1, written)[:, 0]
        margins.write([{"id": r["id"], "gap": gap.tolist(), "llm_tokens": llm_logprobs.argmax(-1).tolist()}])
        progress.advance(task)

domains = {r["id"]: r["domain"] for r in responses}
slm_side = {p["id"]: p for p in labels.Parts(out, "prefill").rows()}
rows = [{"id": m["id"], "domain": domains[m["id"]], "position": j, "token": llm_token, "slm_token": slm_token,
         "entropy": ent, "label": "identical" if gap == 0 else "divergent" if gap > tolerance else "neutral",
         "judge_raw": f"{gap:.3f}"}
        for m in margins.rows()
        for j, (gap, llm_token, slm_token, ent) in enumerate(zip(
            m["gap"], m["llm_tokens"], slm_side[m["id"]]["slm_tokens"], slm_side[m["id"]]["entropy"]))]
pq.write_table(pa.Table.from_pylist(rows), out / "labels.parquet")
print(Counter(r["label"] for r in rows))
