"""Where R2R pays: the default SLM with LLMs of real sizes, measured.

Speed does not depend on weight values. A model built from a published configuration with random
weights, quantized as the shipped files are (Q4_K_M), runs at that model's speed on the same kernels.
What random weights cannot give (which tokens the router sends, which drafts the LLM accepts) is set
by a fixed routing share (the `random` policy), or taken from the real pair's statistics measured in
the same run and carried over through the cost model:

    time per output token = SLM steps x t_SLM(1) + LLM catch-ups x t_LLM(tokens read per catch-up)

with t(k) the measured cost of one forward over k new tokens (interpolated between measured k).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from roads_to_rome.backends.llamacpp import LlamaCppBackend
from roads_to_rome.backends.torch_backend import TorchBackend
from roads_to_rome.bench.measure import processor, step_ms, synchronize
from roads_to_rome.core.engine import Engine, SamplingParams
from roads_to_rome.core.verification import Deferral
from roads_to_rome.errors import R2RError
from roads_to_rome.eval.tasks import gsm8k, gsm8k_prompt
from roads_to_rome.models import (
    DEFAULT_LLM,
    DEFAULT_SLM,
    cache_dir,
    gguf_path,
    load_model,
    pick_device,
    router_path_for,
    tokenizer_source,
)
from roads_to_rome.progress import QUIET
from roads_to_rome.routing import policies
from roads_to_rome.routing.router import Router, RouterCheckpoint, RouterConfig


@dataclass(frozen=True)
class LlmShape:
    """A causal LM's architecture as its published config.json gives it (Qwen2 and Qwen3 families)."""

    name: str
    config: str  # where the figures come from: the published config.json of this hub model
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab_rows: int  # rows of the embedding and output head (151,936 or the padded 152,064)
    tied: bool  # whether the output head is the embedding table
    rms_eps: float = 1e-6
    arch: str = "qwen2"  # qwen2: q, k, v biases; qwen3: no biases, q and k normed per head, head_dim given
    head_dim: int | None = None  # None: hidden / heads

    @property
    def dims(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def params(self) -> int:
        head_dim = self.dims
        weights = self.hidden * head_dim * (self.heads * 2 + self.kv_heads * 2)  # q and o; k and v
        extra = head_dim * (self.heads + 2 * self.kv_heads) if self.arch == "qwen2" else 2 * head_dim  # biases; norms
        mlp = 3 * self.hidden * self.intermediate
        per_layer = weights + extra + mlp + 2 * self.hidden
        embeddings = self.vocab_rows * self.hidden * (1 if self.tied else 2)
        return self.layers * per_layer + embeddings + self.hidden


SHAPES = {s.name: s for s in (
    LlmShape("qwen2.5-coder-0.5b", "Qwen/Qwen2.5-Coder-0.5B-Instruct", 896, 24, 14, 2, 4864, 151936, True),
    LlmShape("qwen2.5-coder-1.5b", "Qwen/Qwen2.5-Coder-1.5B-Instruct", 1536, 28, 12, 2, 8960, 151936, True),
    LlmShape("qwen2.5-coder-3b", "Qwen/Qwen2.5-Coder-3B-Instruct", 2048, 36, 16, 2, 11008, 151936, True),
    LlmShape("qwen2.5-coder-7b", "Qwen/Qwen2.5-Coder-7B-Instruct", 3584, 28, 28, 4, 18944, 152064, False),
    LlmShape("qwen2.5-coder-14b", "Qwen/Qwen2.5-Coder-14B-Instruct", 5120, 48, 40, 8, 13824, 152064, False),
    LlmShape("qwen2.5-coder-32b", "Qwen/Qwen2.5-Coder-32B-Instruct", 5120, 64, 40, 8, 27648, 152064, False),
    LlmShape("r1-distill-qwen-1.5b", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", 1536, 28, 12, 2, 8960, 151936,
             False),
    LlmShape("r1-distill-qwen-32b", "deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", 5120, 64, 40, 8, 27648, 152064,
             False, 1e-5),
    LlmShape("qwen3-0.6b", "Qwen/Qwen3-0.6B", 1024, 28, 16, 8, 3072, 151936, True, arch="qwen3", head_dim=128),
    LlmShape("qwen3-8b", "Qwen/Qwen3-8B", 4096, 36, 32, 8, 12288, 151936, False, arch="qwen3", head_dim=128),
)}
DEFAULT_SHAPES = ("qwen2.5-coder-3b", "qwen2.5-coder-7b", "qwen2.5-coder-14b")
DEFAULT_SHARES = (0.05, 0.1, 0.15, 0.2)
STEP_TOKENS = (1, 2, 4, 8, 16, 32, 64)
Q4_K_M = 15  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M: the shipped files' type


def parse_shape(text: str, option: str = "--slm-shape") -> LlmShape:
    if text not in SHAPES:
        raise R2RError(f"unknown {option} {text}: use one of {', '.join(SHAPES)}")
    return SHAPES[text]


def parse_shapes(text: str) -> list[LlmShape]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SHAPES]
    if unknown or not names:
        raise R2RError(f"unknown --llm-shape {', '.join(unknown) or repr(text)}: use one or more of "
                       f"{', '.join(SHAPES)}")
    return [SHAPES[n] for n in names]


def parse_shares(text: str) -> list[float]:
    try:
        shares = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise R2RError(f"--llm-share takes comma-separated numbers strictly between 0 and 1, got {text!r}") from None
    if not shares or any(not 0 < s < 1 for s in shares):
        raise R2RError(f"--llm-share takes shares strictly between 0 and 1, got {text!r}")
    return shares


# ---- building a random-weight model of a shape ----------------------------------------------------------------

def shape_gguf_path(shape: LlmShape) -> Path:
    return cache_dir() / "shapes" / f"{shape.name}-random-q4_k_m.gguf"


def tensor_shapes(shape: LlmShape) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model as llama.cpp names it, in (rows, columns) order."""
    head_dim = shape.hidden // shape.heads
    q, kv, h, f = shape.heads * head_dim, shape.kv_heads * head_dim, shape.hidden, shape.intermediate
    tensors = {"token_embd.weight": (shape.vocab_rows, h)}
    for i in range(shape.layers):
        tensors |= {f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.attn_q.weight": (q, h), f"blk.{i}.attn_q.bias": (q,),
                    f"blk.{i}.attn_k.weight": (kv, h), f"blk.{i}.attn_k.bias": (kv,),
                    f"blk.{i}.attn_v.weight": (kv, h), f"blk.{i}.attn_v.bias": (kv,),
                    f"blk.{i}.attn_output.weight": (h, q), f"blk.{i}.ffn_norm.weight": (h,),
                    f"blk.{i}.ffn_gate.weight": (f, h), f"blk.{i}.ffn_up.weight": (f, h),
                    f"blk.{i}.ffn_down.weight": (h, f)}
    tensors["output_norm.weight"] = (h,)
    if not shape.tied:
        tensors["output.weight"] = (shape.vocab_rows, h)
    return tensors


SKIPPED_KEYS = {"general.architecture", "general.name", "general.file_type", "general.size_label",
                "general.quantization_version", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type"}


def write_random_gguf(shape: LlmShape, template: Path, out: Path, progress=QUIET, seed: int = 0) -> Path:
    """A float16 GGUF of `shape` with random weights and the tokenizer of `template` (a Qwen2 GGUF whose
    tokenizer the SLM shares), its token list padded to the shape's rows. Tensors are written one at a time:
    the file never has to fit in memory."""
    import gguf

    reader = gguf.GGUFReader(template)
    if reader.fields["general.architecture"].contents() != "qwen2":
        raise R2RError(f"{template} is not a qwen2 GGUF: the shapes are Qwen2 models and take its tokenizer")
    tokens = list(reader.fields["tokenizer.ggml.tokens"].contents())
    types = list(reader.fields["tokenizer.ggml.token_type"].contents())
    if len(tokens) > shape.vocab_rows:
        raise R2RError(f"{template} has {len(tokens)} tokens, more than {shape.name}'s {shape.vocab_rows} rows")
    padding = range(len(tokens), shape.vocab_rows)
    writer = gguf.GGUFWriter(out, "qwen2")
    writer.add_name(f"{shape.name} (random weights, {shape.config} shape)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in SKIPPED_KEYS or name.startswith("qwen2."):
            continue
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type)
    writer.add_token_list(tokens + [f"[PAD{i}]" for i in padding])
    writer.add_token_types(types + [gguf.TokenType.UNUSED] * len(padding))
    writer.add_context_length(int(reader.fields["qwen2.context_length"].contents()))
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(float(reader.fields["qwen2.rope.freq_base"].contents()))
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    tensors = tensor_shapes(shape)
    for name, dims in tensors.items():
        dtype = np.float32 if len(dims) == 1 else np.float16
        writer.add_tensor_info(name, dims, np.dtype(dtype), math.prod(dims) * np.dtype(dtype).itemsize)
    writer.write_header_to_file(out)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    # Weights of the size a trained model has (std 0.02), drawn once and reused with an offset per tensor:
    # drawing 14 billion normals would take longer than everything else, and their values change no timing.
    pool = (np.random.default_rng(seed).standard_normal(1 << 24, dtype=np.float32) * 0.02).astype(np.float16)
    total = sum(math.prod(d) * (4 if len(d) == 1 else 2) for d in tensors.values())
    task = progress.add_task(f"write {shape.name} (random f16)", total=total)
    for i, (name, dims) in enumerate(tensors.items()):
        n = math.prod(dims)
        if len(dims) == 1:  # norms at 1 (as trained ones are, near it), biases at 0
            data = np.ones(n, np.float32) if name.endswith("norm.weight") else np.zeros(n, np.float32)
        else:
            data = np.resize(np.roll(pool, 7919 * i), n)
        writer.write_tensor_data(data.reshape(dims))
        progress.advance(task, data.nbytes)
    writer.close()
    return out


def quantize(source: Path, out: Path, ftype: int = Q4_K_M, progress=QUIET, label: str = "") -> Path:
    """llama.cpp's own quantizer (as `llama-quantize` runs it) over a GGUF file; shows the output growing."""
    import threading

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 0  # all cores
    task = progress.add_task(f"quantize {label} to Q4_K_M", total=source.stat().st_size * 0.30)
    done = threading.Event()

    def watch():
        while not done.wait(1.0):
            if out.exists():
                progress.update(task, completed=out.stat().st_size)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        code = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    finally:
        done.set()
        watcher.join()
    if code != 0:
        out.unlink(missing_ok=True)
        raise R2RError(f"llama.cpp could not quantize {source} (code {code})")
    progress.update(task, completed=out.stat().st_size, total=out.stat().st_size)
    return out


def build_shape(shape: LlmShape, template: Path, progress=QUIET) -> dict:
    """The shape's random-weight Q4_K_M GGUF, built once into the cache (beside the prepared models)."""
    if shape.arch != "qwen2":
        raise R2RError(f"{shape.name} is a {shape.arch} model: the GGUF builder writes qwen2 models; "
                       "use --backend torch")
    target = shape_gguf_path(shape)
    if target.exists():
        return {"path": str(target), "bytes": target.stat().st_size, "built_s": None}
    target.parent.mkdir(parents=True, exist_ok=True)
    f16, partial = target.with_suffix(".f16.partial"), target.with_suffix(".partial")
    start = time.perf_counter()
    try:
        write_random_gguf(shape, template, f16, progress)
        written = time.perf_counter()
        quantize(f16, partial, progress=progress, label=shape.name)
    finally:
        f16.unlink(missing_ok=True)
    partial.rename(target)
    end = time.perf_counter()
    return {"path": str(target), "bytes": target.stat().st_size, "built_s": end - start,
            "write_s": written - start, "quantize_s": end - written}


def torch_shape(shape: LlmShape, device: str, dtype: torch.dtype = torch.bfloat16):
    """The shape as a transformers model built from its configuration (random weights) on `device`, in `dtype`
    from the start (a 32B model in float32 would not fit beside itself)."""
    from transformers import (
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    config_class, model_class = (Qwen3Config, Qwen3ForCausalLM) if shape.arch == "qwen3" else (Qwen2Config,
                                                                                              Qwen2ForCausalLM)
    extra = {"head_dim": shape.head_dim} if shape.head_dim else {}
    config = config_class(vocab_size=shape.vocab_rows, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                          num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                          intermediate_size=shape.intermediate, tie_word_embeddings=shape.tied,
                          rms_norm_eps=shape.rms_eps, max_position_embeddings=32768, **extra)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return model_class(config).eval()
    finally:
        torch.set_default_dtype(default)


# ---- the cost model -----------------------------------------------------------------------------------------

def cost_at(ms: dict[int, float], k: float) -> float:
    """t(k): one forward over k new tokens, interpolated linearly between measured k (extrapolated from the
    last two beyond them)."""
    ks = sorted(ms)
    if k <= ks[0]:
        return ms[ks[0]]
    for a, b in zip(ks, ks[1:]):
        if k <= b:
            return ms[a] + (ms[b] - ms[a]) * (k - a) / (b - a)
    a, b = ks[-2], ks[-1]
    return ms[b] + (ms[b] - ms[a]) * (k - b) / (b - a)


def predicted_seconds(calls: list[int], ms: dict[int, float]) -> float:
    """What a sequence of forwards (new tokens per call) costs at these step costs."""
    return sum(cost_at(ms, k) for k in calls) / 1000


def routing_calls(prompt: int, tokens: int, share: float, rng: np.random.Generator, rows: int = 1,
                  deferral: Deferral = Deferral(), accept: float = 0.0) -> tuple[list[int], list[int]]:
    """The forwards R2R makes when a share of tokens goes to the LLM at random, `rows` rows in lockstep: the SLM
    reads the prompt, then one column per step; the LLM, at each step where its grouping rule calls it (without
    deferral: where any row is routed), every column since it last read (the prompt first). A deferred routed
    token is the SLM's with probability `accept` (parked: never); where it is not, the row goes back to it and
    what it wrote since is lost. Steps go on until every row holds `tokens` (a row that is done stays in the
    step costs' row count)."""
    length = np.zeros(rows, dtype=np.int64)  # tokens each row holds
    waiting: list[list[int]] = [[] for _ in range(rows)]  # each row's deferred routed positions
    slm, llm, read, column = [], [], 0, prompt
    park = deferral.mode == "park"
    while (length < tokens).any():
        slm.append(prompt if not slm else 1)
        active = length < tokens
        routed = (rng.random(rows) < share) & active
        if deferral.on:
            waits = np.array([bool(w) for w in waiting]) | routed
            oldest = max((length[i] - w[0] for i, w in enumerate(waiting) if w), default=0)
            due = (waits.sum() >= deferral.rows(active.sum()) or oldest >= deferral.steps
                   or (waits & (length + 1 >= tokens)).any()) and waits.any()
        else:
            due = routed.any()
        if due:
            llm.append(column - read)
            read = column
            for i in np.flatnonzero(active):
                kept = next((p for p in waiting[i] if park or rng.random() >= accept), None)
                length[i] = length[i] + 1 if kept is None else kept + 1
                waiting[i] = []
        else:
            for i in np.flatnonzero(routed):
                waiting[i].append(int(length[i]))
            length += active
        column += 1
    return slm, llm


def predicted_routing_tok_s(slm_ms: dict, llm_ms: dict, share: float, prompts: list[int], tokens: int,
                            samples: int = 100, rows: int = 1, deferral: Deferral = Deferral(),
                            accept: float = 0.0) -> float:
    """The cost model's tokens/s for routing `share` of the tokens at random, over prompts of these lengths
    (averaged over random draws); with `rows`, over batches of that many rows whose padded prompts have these
    lengths, at step costs measured with that many rows; with `deferral`, its grouping rule and a deferred routed
    token kept with probability `accept`."""
    rng = np.random.default_rng(0)
    seconds = 0.0
    for prompt in prompts:
        for _ in range(samples):
            slm, llm = routing_calls(prompt, tokens, share, rng, rows, deferral, accept)
            seconds += (predicted_seconds(slm, slm_ms) + predicted_seconds(llm, llm_ms)) / samples
    return tokens * rows * len(prompts) / seconds


def predicted_alone_tok_s(ms: dict, prompts: list[int], tokens: int, rows: int = 1) -> float:
    return tokens * rows * len(prompts) / sum(predicted_seconds([p] + [1] * (tokens - 1), ms) for p in prompts)


def batch_widths(lengths: list[int], rows: int) -> list[int]:
    """The padded prompt width of each batch of `rows` prompts, in order."""
    return [max(lengths[i : i + rows]) for i in range(0, len(lengths), rows)]


# ---- measuring ------------------------------------------------------------------------------------------------

class Recorded:
    """A backend that records how many new tokens each forward reads (everything else is the backend's)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, cache, new_ids, attention_mask):
        self.calls.append(new_ids.shape[1])
        return self.inner.forward(cache, new_ids, attention_mask)

    def forward_all(self, cache, new_ids, attention_mask, n):
        self.calls.append(new_ids.shape[1])
        return self.inner.forward_all(cache, new_ids, attention_mask, n)

    def read(self, cache, new_ids, attention_mask):
        self.calls.append(new_ids.shape[1])
        return self.inner.read(cache, new_ids, attention_mask)


class AgreesAtRate:
    """A random-weight LLM that, at each column whose next token it has read, prefers that token with probability
    `rate` (else its own choice stands): a deferred routed token is then kept at the rate a real pair keeps it,
    at the real cost of every forward."""

    def __init__(self, inner, rate: float, seed: int = 0):
        self.inner, self.rate, self.rng = inner, rate, np.random.default_rng(seed)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward_all(self, cache, new_ids, attention_mask, n):
        logits = self.inner.forward_all(cache, new_ids, attention_mask, n)
        rows, width = new_ids.shape
        with torch.inference_mode():  # torch's logits are inference tensors: written in place only in this mode
            for k in range(logits.shape[1] - 1):  # the last column's next token is not written yet
                column = width - logits.shape[1] + k + 1  # where the token that logits[:, k] predicts sits in new_ids
                for row in np.flatnonzero(self.rng.random(rows) < self.rate):
                    logits[row, k, new_ids[row, column]] = logits[row, k].max() + 1
        return logits


class RouterAtShare(policies.RoutingPolicy):
    """Runs the router every step, as R2R does, then routes a fixed share of tokens at random: the router's cost is
    real, its choices are what random weights cannot give."""

    name = "random"

    def __init__(self, router: policies.NeuralPolicy, share: float, seed: int = 0):
        self.router, self.draws = router, policies.RandomPolicy(share, seed)
        self.threshold, self.num_params = share, router.num_params

    def threshold_for_rate(self, rate: float, past_scores: list[float]) -> float:
        return rate

    def route(self, logits, hidden, tokens, thresholds=None):
        self.router.route(logits, hidden, tokens)
        return self.draws.route(logits, hidden, tokens, thresholds)


def random_router(slm) -> policies.NeuralPolicy:
    """The shipped router's architecture with random weights, for an SLM shape that has no trained router."""
    checkpoint = RouterCheckpoint(Router(RouterConfig(slm.hidden_size, slm.hidden_size)), threshold=0.5)
    return policies.NeuralPolicy(checkpoint, slm.embed, device=slm.device)


def default_tokenizer():
    """The default pair's tokenizer (its prepared folder needs only the tokenizer files), for random-weight SLMs."""
    from transformers import AutoTokenizer

    folder = tokenizer_source(DEFAULT_SLM)
    if not (folder / "tokenizer.json").exists():
        raise R2RError(f"no tokenizer at {folder}: run `r2r models prepare` (or copy its tokenizer files there)")
    return AutoTokenizer.from_pretrained(folder)


def run_system(engine: Engine, prompts: list[list[int]], tokens: int, progress=QUIET, label: str = "",
               batch: int = 1) -> dict:
    """`batch` prompts at a time, `tokens` new tokens each (EOS ignored), prompt reading included: tokens/s, the
    LLM's share, verification's rollbacks, and every forward each model made (new tokens per call, at batch 1),
    for the cost model."""
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    task = progress.add_task(label, total=len(prompts) * tokens)
    slm, llm = engine.slm, engine.llm
    if engine.writer.device.type == "cuda":  # the first steps capture CUDA graphs and load kernels: not timed
        engine.generate([prompts[0][:16]] * batch, SamplingParams(max_new_tokens=4, ignore_eos=True))
    totals = {"tokens": 0, "seconds": 0.0, "llm_tokens": 0, "rollbacks": 0, "discarded": 0, "slm_calls": [],
              "llm_calls": [], "batch": batch, "deferred": 0, "deferred_kept": 0, "deferred_replaced": 0,
              "deferred_discarded": 0}
    counted = dataclasses.replace(engine.counters)
    phases = dict.fromkeys(("slm_s", "router_s", "llm_s", "step_s"), 0.0)  # where the decode steps' time went
    for first in range(0, len(prompts), batch):
        for model in (slm, llm):
            if isinstance(model, Recorded):
                model.calls = []
        start, results = time.perf_counter(), []
        for steps in engine.stream(prompts[first: first + batch], params, results):
            progress.advance(task, len(steps))
        engine.sync()
        totals["seconds"] += time.perf_counter() - start
        for key, seconds in zip(phases, (results[0].timings.slm_s, results[0].timings.router_s,
                                         results[0].timings.llm_s, results[0].timings.total_s)):
            phases[key] += seconds  # (a batched step counts once: the first row's share of it)
        for gen in results:
            totals["tokens"] += len(gen.token_ids)
            totals["llm_tokens"] += gen.llm_tokens
            totals["rollbacks"] += gen.rollbacks
            totals["discarded"] += gen.discarded
            for key in ("deferred", "deferred_kept", "deferred_replaced", "deferred_discarded"):
                totals[key] += getattr(gen, key)
        for role, model in (("slm", slm), ("llm", llm)):
            if isinstance(model, Recorded) and batch == 1:
                totals[f"{role}_calls"].append(model.calls)
    per100 = 100 / max(totals["tokens"], 1)
    totals |= {"tokens_per_s": totals["tokens"] / totals["seconds"],
               "llm_share": totals["llm_tokens"] / max(totals["tokens"], 1),
               "rollbacks_per_100": totals["rollbacks"] * per100, "discarded_per_100": totals["discarded"] * per100,
               "llm_calls_total": (engine.counters - counted).llm_calls,
               "routed_rows_per_call": (engine.counters - counted).routed_rows_per_call,
               "deferred_accept": totals["deferred_kept"]
               / max(totals["deferred_kept"] + totals["deferred_replaced"], 1),
               "deferred_discarded_per_100": totals["deferred_discarded"] * per100,
               "phases": phases}
    return totals


ASSISTED_TOKENS = 64  # enough rounds to time one; a round's cost does not depend on how many follow


def assisted_run(slm: TorchBackend, llm: TorchBackend, prompt: list[int], tokens: int, k: int, tokenizer=None) -> dict:
    """transformers' assisted generation (speculative decoding with `k` drafts a round, greedy) of the same pair:
    what one round costs. Random weights accept almost no draft, so tokens/s at a real pair's acceptance comes
    from this cost and that pair's tokens per round (in the summary).

    Pairs whose embeddings differ in rows (the padded 152,064 beside 151,936) are different tokenizers to
    transformers: given `tokenizer`, it runs its universal assisted decoding (the drafts go through text each
    round), what a user of these published pairs gets; without, the SLM's configuration is made to claim the LLM's
    row count for the call and the LLM's padding rows are suppressed, so the plain path runs (greedy compares
    drafts by token id only)."""
    rounds = []
    slm_config, llm_rows = slm.model.config.get_text_config(), llm.model.config.get_text_config().vocab_size
    own_rows = slm_config.vocab_size
    universal = tokenizer is not None and own_rows != llm_rows
    hook = llm.model.register_forward_hook(lambda *_: rounds.append(1))
    kwargs = dict(do_sample=False, assistant_model=slm.model, num_assistant_tokens=k,
                  num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0, pad_token_id=0)
    if universal:
        kwargs |= {"tokenizer": tokenizer, "assistant_tokenizer": tokenizer}
    elif own_rows != llm_rows:  # and the LLM never picks a padding row the SLM has no embedding for
        slm_config.vocab_size = llm_rows
        kwargs["suppress_tokens"] = list(range(own_rows, llm_rows))
    try:
        ids = torch.tensor([prompt], device=llm.device)
        llm.model.generate(ids[:, :16], max_new_tokens=8, min_new_tokens=8, **kwargs)  # warm-up
        rounds.clear()
        synchronize(llm)
        start = time.perf_counter()
        out = llm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                 min_new_tokens=tokens, **kwargs)
        synchronize(llm)
        seconds = time.perf_counter() - start
    except Exception as e:  # a transformers version that refuses these settings: say so in the results
        return {"k": k, "universal": universal,
                "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"}
    finally:
        hook.remove()
        slm_config.vocab_size = own_rows
    made = out.shape[1] - len(prompt)
    return {"k": k, "universal": universal, "tokens": made, "seconds": seconds, "rounds": len(rounds),
            "tokens_per_s": made / seconds, "round_ms": 1000 * seconds / max(len(rounds), 1)}


def real_acceptance(result: dict) -> float:
    """The share of deferred routed tokens the real pair's LLM kept (the SLM's token was its own), from its batched
    run in this results file (or the one --real-from names; the largest batch's); 0 without one."""
    runs = [run for name, run in result["real"].get("systems", {}).items() if name.startswith("r2r+continue b=")]
    return max(runs, key=lambda run: run["batch"])["deferred_accept"] if runs else 0.0


def predicted_from_calls(result: dict, slm_ms: dict, llm_ms: dict) -> float:
    """Tokens/s of a measured run's exact forwards (per prompt, per model) at other step costs: how a call pattern
    measured on the real pair carries over to an LLM of another size."""
    seconds = sum(predicted_seconds(c, slm_ms) for c in result["slm_calls"])
    seconds += sum(predicted_seconds(c, llm_ms) for c in result["llm_calls"])
    return result["tokens"] / seconds


def tokens_per_round(result: dict) -> float:
    """Tokens a speculative round gives on the real pair: its tokens over the LLM's forwards (one per round)."""
    return result["tokens"] / max(sum(len(calls) for calls in result["llm_calls"]), 1)


def step_table(backend, context: int, step_tokens: list[int], prompts: list[int], rows: int = 1) -> dict[int, float]:
    """Milliseconds of a forward over k new tokens on a `context`-token cache, for each k asked and for each
    prompt's length on an empty cache (what reading the prompt costs), for `rows` rows."""
    table = {k: step_ms(backend, context, k, repeats=3, rows=rows) for k in step_tokens}
    for p in sorted(set(prompts)):
        table.setdefault(p, step_ms(backend, 0, p, repeats=1, rows=rows))
    return table


def unmeasured_batches(plan: Plan, store: dict, max_rows: int | None) -> list[int]:
    """The batch sizes above 1 whose step tables (for the batched runs' cost model) `store` lacks, where a backend
    holding `max_rows` rows (None: any) can run them."""
    return [b for b in plan.batches if b > 1 and (max_rows is None or b <= max_rows) and str(b) not in store]


def llm_backend(shape: LlmShape, tokenizer, backend: str, device: str, template: Path, progress=QUIET,
                graphs: bool = True, compile: bool = False, llama: dict | None = None):
    """The shape as an LLM backend reading the SLM's tokenizer's ids: llama.cpp on its random Q4_K_M file (built
    on first use), or transformers from its configuration."""
    if backend == "llamacpp":
        build = build_shape(shape, template, progress)
        sizes = llama or {"n_ctx": 4096, "max_rows": 2}  # a context's KV pool and rows: the run's batches must fit
        return LlamaCppBackend(build["path"], name=shape.name, vocab_size=len(tokenizer), **sizes), build
    start = time.perf_counter()
    model = torch_shape(shape, pick_device(device))
    built = {"path": None, "bytes": None, "built_s": time.perf_counter() - start}
    return TorchBackend(model, name=shape.name, vocab_size=len(tokenizer), graphs=graphs, compile=compile), built


def ms_keys(table: dict) -> dict[int, float]:
    return {int(k): v for k, v in table.items()}


@dataclass(frozen=True)
class Plan:
    """What one `r2r bench shapes` run measures."""

    shapes: tuple[LlmShape, ...]
    shares: tuple[float, ...] = DEFAULT_SHARES
    prompts: int = 4  # GSM8K items 0..prompts-1 at batch 1 (at batch b, the first multiple of b at least this)
    tokens: int = 256
    context: int = 300
    step_tokens: tuple[int, ...] = STEP_TOKENS
    verify: tuple = ()
    spec_k: tuple[int, ...] = ()
    backend: str = "llamacpp"
    device: str = "auto"
    slm_shape: LlmShape | None = None  # None: the default pair's SLM as shipped (and its router)
    batches: tuple[int, ...] = (1,)
    real_from: str | None = None  # a results file whose real-pair runs stand in for this run's (random SLM)
    cuda_graphs: bool = True  # on CUDA, reads of up to 64 tokens as CUDA graphs (off: transformers' eager forwards)
    compile: tuple[str, ...] = ("slm",)  # the roles whose CUDA graphs record their trunk compiled by torch.compile
    defer: tuple[str, ...] = ()  # deferral modes run beside lockstep R2R at each batch above 1
    deferral: Deferral = Deferral()  # their grouping rule (its mode is each of `defer` in turn)

    def config(self) -> dict:
        """What a resumed run must share with the saved one (keys only where not the default, so files of earlier
        runs resume)."""
        config = {"prompts": self.prompts, "tokens": self.tokens, "context": self.context,
                  "step_tokens": list(self.step_tokens), "backend": self.backend, "device": self.device,
                  "verify": [str(v) for v in self.verify], "spec_k": list(self.spec_k)}
        if self.slm_shape:
            config["slm_shape"] = self.slm_shape.name
        if self.batches != (1,):
            config["batches"] = list(self.batches)
        if not self.cuda_graphs:
            config["cuda_graphs"] = False
        if self.compile != ("slm",):
            config["compile"] = list(self.compile)
        if self.deferred_batches:
            config |= {"defer": list(self.defer), "defer_group": self.deferral.group,
                       "defer_steps": self.deferral.steps}
        return config

    @property
    def deferred_batches(self) -> list[int]:
        """The batches deferral runs at (a batch of one never defers)."""
        return [b for b in self.batches if b > 1] if self.defer else []

    def rule(self, mode: str) -> Deferral:
        return dataclasses.replace(self.deferral, mode=mode)

    def prompts_at(self, batch: int) -> int:
        return -(-self.prompts // batch) * batch


def assisted_key(k: int, universal: bool) -> str:
    return f"k={k}" + (" universal" if universal else "")


def system_name(name: str, batch: int) -> str:
    return name if batch == 1 else f"{name} b={batch}"


def measure(plan: Plan, saved: dict | None, save, progress=QUIET, build_only: bool = False) -> dict:
    """Everything `r2r bench shapes` prints, resuming from `saved` (what an earlier run of the same settings on
    this processor measured); `save(result)` is called after each measurement."""
    config, here = plan.config(), processor()
    gpu = torch.cuda.get_device_name() if pick_device(plan.device) == "cuda" else None
    saved_on = saved and (saved.get("device_name") or saved.get("processor"))
    if saved and (saved.get("config") != config or saved_on != (gpu or here)):
        raise R2RError("the results file holds a run with other settings or from another processor "
                       f"({saved.get('device_name') or saved.get('processor')}): give another --out, or the same "
                       "settings")
    result = saved or {"config": config, "processor": here, "real": {}, "shapes": {}}
    if gpu:  # on a GPU the figures are the GPU's (the host it sits in may differ between runs)
        result["device_name"] = gpu
    backend, device = plan.backend, plan.device
    rows = max(2, *plan.batches)
    llama = {"n_ctx": max(4096, 1024 * rows), "max_rows": rows}
    template = gguf_path(DEFAULT_LLM)
    if backend == "llamacpp" and not template.exists():
        raise R2RError(f"the default pair is not prepared ({template} is missing): run `r2r models prepare`")
    if build_only:
        for shape in plan.shapes:
            record_build(result["shapes"].setdefault(shape.name, {}), build_shape(shape, template, progress))
            save(result)
        return result
    if plan.slm_shape is None:
        slm, tokenizer = load_model(None, "slm", device, backend=backend, llama=llama, compile="slm" in plan.compile)
        router = policies.build("router", slm, None, router_path_for(None, None))
    else:
        tokenizer = default_tokenizer()
        slm = TorchBackend(torch_shape(plan.slm_shape, pick_device(device)), name=plan.slm_shape.name,
                           vocab_size=len(tokenizer), graphs=plan.cuda_graphs,
                           compile="slm" in plan.compile)
        router = random_router(slm)
    slm = Recorded(slm)
    result.setdefault("kernels", {})["slm"] = slm.kernels
    slm_engine = Engine.alone(slm, tokenizer, "slm")
    count = max(plan.prompts_at(b) for b in plan.batches)
    prompts = [slm_engine.encode_chat(gsm8k_prompt(item)) for item in gsm8k()[:count]]
    lengths = [len(p) for p in prompts[: plan.prompts]]
    result["prompt_tokens"] = lengths
    widths = {str(b): batch_widths([len(p) for p in prompts[: plan.prompts_at(b)]], b) for b in plan.batches}
    result["batch_prompt_widths"] = widths

    def batched_steps(store: dict, model) -> None:
        """Step tables with each batch's rows, for the batched runs' cost model."""
        for b in unmeasured_batches(plan, store, model.max_rows):
            store[str(b)] = step_table(model.inner, plan.context, plan.step_tokens, widths[str(b)], rows=b)
            save(result)

    def runs(engine, name, label, systems, batches=plan.batches):
        for batch in batches:
            key = system_name(name, batch)
            if key not in systems:
                systems[key] = run_system(engine, prompts[: plan.prompts_at(batch)], plan.tokens, progress,
                                          f"{label}: {key}", batch)
                save(result)

    if plan.slm_shape is None:
        measure_real_pair(plan, result, slm, slm_engine, router, tokenizer, prompts, lengths, llama, save, progress)
    else:
        own = result.setdefault("slm", {"name": plan.slm_shape.name, "params_b": plan.slm_shape.params / 1e9})
        if "steps" not in own:
            own["steps"] = step_table(slm.inner, plan.context, plan.step_tokens, lengths)
            save(result)
        runs(slm_engine, "slm", plan.slm_shape.name, own.setdefault("systems", {}))
        if plan.real_from and not result["real"]:
            real = json.loads(Path(plan.real_from).read_text()).get("real", {})
            result["real"] = {"from": plan.real_from, "systems": real.get("systems", {})}
            save(result)
    batched_steps(result.setdefault("slm_batched_steps", {}), slm)
    llm_rows = llama["max_rows"] if backend == "llamacpp" else None
    for shape in plan.shapes:
        entry = result["shapes"].setdefault(shape.name, {})
        entry.setdefault("params_b", shape.params / 1e9)
        systems = entry.setdefault("systems", {})
        todo = [system_name(n, b) for n in ["llm"] + [f"r2r@{share:g}" for share in plan.shares] for b in plan.batches]
        todo += [system_name(f"r2r@{share:g}+{mode}", b) for share in plan.shares for mode in plan.defer
                 for b in plan.deferred_batches]
        # transformers' universal path only where the rows differ (else it refuses the tokenizers)
        slm_rows = slm.inner.model.config.get_text_config().vocab_size if backend == "torch" else None
        modes = () if slm_rows is None else (False, True) if shape.vocab_rows != slm_rows else (False,)
        assisted_todo = [(k, universal) for k in plan.spec_k for universal in modes
                         if assisted_key(k, universal) not in entry.get("assisted", {})]
        batched = entry.setdefault("batched_steps", {})
        if ("steps" in entry and all(name in systems for name in todo) and not assisted_todo
                and not unmeasured_batches(plan, batched, llm_rows)):
            continue
        llm, build = llm_backend(shape, tokenizer, backend, device, template, progress, plan.cuda_graphs,
                                 "llm" in plan.compile, llama)
        record_build(entry, build)
        llm = Recorded(llm)
        result["kernels"][f"llm ({shape.name})"] = llm.kernels
        if "steps" not in entry:
            entry["steps"] = step_table(llm.inner, plan.context, plan.step_tokens, lengths)
            save(result)
        batched_steps(batched, llm)
        runs(Engine.alone(llm, tokenizer, "llm"), "llm", shape.name, systems)
        accept = real_acceptance(result)
        for share in plan.shares:
            runs(Engine(slm, llm, tokenizer, RouterAtShare(router, share, seed=0)), f"r2r@{share:g}", shape.name,
                 systems)
            for mode in plan.defer:
                # Random weights agree with nothing: at a deferred routed position the LLM keeps the SLM's token
                # at the rate the real pair kept it in this run.
                engine = Engine(slm, AgreesAtRate(llm, accept), tokenizer, RouterAtShare(router, share, seed=0),
                                defer=plan.rule(mode))
                runs(engine, f"r2r@{share:g}+{mode}", shape.name, systems, plan.deferred_batches)
        for k, universal in assisted_todo:
            run = assisted_run(slm.inner, llm.inner, prompts[0], min(plan.tokens, ASSISTED_TOKENS), k,
                               tokenizer if universal else None)
            entry.setdefault("assisted", {})[assisted_key(k, universal)] = run
            save(result)
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return summarize(result, list(plan.shares))


def measure_real_pair(plan: Plan, result: dict, slm, slm_engine, router, tokenizer, prompts, lengths, llama, save,
                      progress) -> None:
    """The default pair as shipped: its step costs and its runs (the SLM alone, the LLM alone, R2R with the router,
    verification, speculative decoding), whose forwards the cost model replays at each shape's step costs."""
    real = result["real"]
    real_llm = None  # the default pair's LLM, loaded once if anything on the real pair is left to measure

    def the_real_llm():
        nonlocal real_llm
        if real_llm is None:
            real_llm = Recorded(load_model(None, "llm", plan.device, backend=plan.backend, llama=llama)[0])
        return real_llm

    if "steps" not in real:
        real["steps"] = {"slm": step_table(slm.inner, plan.context, plan.step_tokens, lengths),
                         "llm": step_table(the_real_llm().inner, plan.context, plan.step_tokens, lengths)}
        save(result)
    systems = real.setdefault("systems", {})
    if plan.deferred_batches:  # how often the real LLM keeps the SLM's token at a deferred routed position
        batch = max(plan.deferred_batches)
        name = system_name("r2r+continue", batch)
        if name not in systems:
            engine = Engine(slm, the_real_llm(), tokenizer, router, defer=plan.rule("continue"))
            systems[name] = run_system(engine, prompts[: plan.prompts_at(batch)], plan.tokens, progress,
                                       f"{DEFAULT_LLM.name} (real): {name}", batch)
            save(result)
    prompts = prompts[: plan.prompts]
    real_runs = [("slm", None, "off", None), ("llm", None, "off", None), ("r2r", router, "off", None)]
    real_runs += [(f"r2r+verify={v}", router, v, None) for v in plan.verify]
    real_runs += [(f"spec+k={k}", policies.AlwaysSLM(), "strict", k) for k in plan.spec_k]
    for name, policy, setting, k in real_runs:
        if name in systems:
            continue
        engine = (slm_engine if name == "slm" else Engine.alone(the_real_llm(), tokenizer, "llm") if name == "llm"
                  else Engine(slm, the_real_llm(), tokenizer, policy, setting, k))
        systems[name] = run_system(engine, prompts, plan.tokens, progress, f"{DEFAULT_LLM.name} (real): {name}")
        save(result)


def record_build(entry: dict, build: dict) -> None:
    """Keep how long the build took when it was built (a later run finds the file and took no time)."""
    if build.get("built_s") is not None or "build" not in entry:
        entry["build"] = build


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
        alone = (measured.get("llm") or {}).get("tokens_per_s")
        table = [{"system": "llm", "measured": alone, "predicted": alone_predicted}]
        for share in shares:
            run = measured.get(f"r2r@{share:g}")
            table.append({"system": f"r2r@{share:g}", "share": share,
                          "measured": run["tokens_per_s"] if run else None,
                          "measured_share": run["llm_share"] if run else None,
                          "predicted": predicted_routing_tok_s(slm_ms, llm_ms, share, lengths, tokens)})
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
        for row in table:
            reference = alone or alone_predicted
            if row.get("measured"):
                row["x_llm"] = row["measured"] / reference
                row["x_model"] = row["measured"] / row["predicted"]
            # assisted generation's figure comes from its measured cost per round: beside the LLM alone as measured
            row["predicted_x_llm"] = row["predicted"] / (reference if row.get("assisted") else alone_predicted)
        for batch in batches[1:] if batches[0] == 1 else batches:
            table += batched_rows(result, entry, measured, shares, batch)
        steps = {k: llm_ms[k] for k in sorted(llm_ms) if k in result["config"]["step_tokens"]}
        rows[name] = {"params_b": params_b, "build": (entry or {}).get("build"), "rows": table, "step_ms": steps}
    slm_alone = ((own_slm or real).get("systems") or {}).get("slm", {}).get("tokens_per_s")
    return {**result, "summary": rows, "slm_tokens_per_s": slm_alone}


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
               "x_model": run["tokens_per_s"] / predicted if predicted else None}
        if "routed_rows_per_call" in run:
            row |= {"llm_calls": run["llm_calls_total"], "routed_rows_per_call": run["routed_rows_per_call"]}
        if mode != "off":
            row |= {"defer": mode, "accept": run["deferred_accept"],
                    "discarded_per_100": run["deferred_discarded_per_100"]}
        rows.append(row)
    return rows


def plot(result: dict, path: Path) -> Path:
    """Speed-up over the LLM alone against the LLM's size: the cost model's line per share, measured points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = sorted(((e["params_b"], e) for e in result["summary"].values()), key=lambda x: x[0])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    shares = sorted({row["share"] for _, e in entries for row in e["rows"] if row["system"].startswith("r2r@")
                     and not row.get("batch")})
    for i, share in enumerate(shares):
        color = f"C{i}"
        at_share = [(b, r) for b, e in entries for r in e["rows"] if r.get("share") == share and not r.get("batch")
                    and r["system"].startswith("r2r@")]
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


def grouped(entry: dict) -> bool:
    """Whether a shape's rows include batched runs that counted their LLM calls (the grouping columns)."""
    return any("routed_rows_per_call" in row for row in entry["rows"])


def row_cells(row: dict, with_grouping: bool) -> list[str]:
    """One summary row as text, in `COLUMNS` (and `GROUPED_COLUMNS`) order."""
    share = row.get("measured_share", row.get("share"))
    cells = [row["system"], "100%" if row["system"] == "llm" else f"{share:.1%}" if share is not None else "",
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


def markdown(result: dict) -> str:
    """The summary as a Markdown table (for result pages): one row per shape and system."""
    with_grouping = any(grouped(entry) for entry in result["summary"].values())
    columns = ("LLM",) + COLUMNS + (GROUPED_COLUMNS if with_grouping else ())
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for name, entry in result["summary"].items():
        for row in entry["rows"]:
            cells = [f"{name} ({entry['params_b']:.1f}B)"] + row_cells(row, with_grouping)
            lines.append("| " + " | ".join(cells) + " |")
    if note := deferral_note(result["config"]):
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
