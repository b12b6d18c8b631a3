"""How many CUDA graphs R2R would record in each pass over the same batch, counted on the CPU.

On CUDA each (cache buffers, read size) pair a model reads for the first time is a graph recording (a warm-up and a
capture): one-time work where the buffers stay, work at every step where they do not. This runs `r2r bench
shapes`' systems (lockstep, each --defer mode, with and without --overlap) over tiny random models with the static
cache CUDA uses, reads padded as graphs pad them, and counts the pairs each pass reads first:

    python scripts/graph-recordings.py --batch 1,4,8,32 --passes 3
"""

from __future__ import annotations

import argparse
import sys
import weakref
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parents[1]), str(Path(__file__).parents[1] / "tests")]

from tiny import tiny_model, tiny_tokenizer  # noqa: E402

from roads_to_rome.backends.static_cache import padded_size  # noqa: E402
from roads_to_rome.backends.torch_backend import TorchBackend  # noqa: E402
from roads_to_rome.bench import shapes, stand_ins  # noqa: E402
from roads_to_rome.bench.shape_models import random_router  # noqa: E402
from roads_to_rome.models import systems  # noqa: E402


class Counted(TorchBackend):
    """A static-cache backend that counts the (buffers, read size) pairs read for the first time."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, static=True, pad_reads=True, **kwargs)
        self.seen, self.first_reads = weakref.WeakKeyDictionary(), 0

    def _static_read(self, cache, new_ids, mask, size, graphed):
        hidden = super()._static_read(cache, new_ids, mask, size, graphed)
        sizes = self.seen.setdefault(cache.kv, set())
        if padded_size(new_ids.shape[1]) is not None and size not in sizes:
            sizes.add(size)
            self.first_reads += 1
        return hidden


def batches(text: str) -> list[int]:
    """`--batch`: positive row counts, comma-separated."""
    sizes = [int(b) for b in text.split(",")]
    if min(sizes) < 1:
        raise ValueError(text)
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=batches, default="1,4,8,32", help="batches, comma-separated")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256, help="new tokens a row")
    args = parser.parse_args()
    tokenizer = tiny_tokenizer()
    slm = Counted(tiny_model(tokenizer, hidden=32, seed=0), name="slm")
    llm = Counted(tiny_model(tokenizer, hidden=64, seed=1), name="llm")
    router = random_router(slm)
    recorded = stand_ins.Recorded(slm)
    chat = systems.alone(recorded, tokenizer, "slm")
    prompts = [chat.prompts.chat(f"What is {i} times {i + 3}? Explain step by step, please, with care.")
               for i in range(max(args.batch))]
    print("system        batch  first reads per pass (SLM + LLM)")
    for batch in args.batch:
        for mode in ("off", "continue", "park"):
            for overlap in (False, True):
                if batch == 1 and mode != "off":
                    continue
                proposals = stand_ins.Proposals(recorded)
                llm_side = stand_ins.AgreesAtRate(stand_ins.Recorded(llm), 0.68, proposals=proposals)
                engine = systems.routed(recorded, llm_side,
                                        tokenizer, stand_ins.RouterAtShare(router, 0.11, seed=0, proposals=proposals),
                                        defer=mode, overlap=overlap)
                counts = []
                for _ in range(args.passes):
                    before = slm.first_reads, llm.first_reads
                    shapes.run_system(engine, prompts[:batch], args.tokens, batch=batch)
                    counts.append(f"{slm.first_reads - before[0]} + {llm.first_reads - before[1]}")
                name = ("lockstep" if mode == "off" else mode) + ("+overlap" if overlap else "")
                print(f"{name:16s} {batch:3d}  " + ", ".join(counts), flush=True)


if __name__ == "__main__":
    main()
