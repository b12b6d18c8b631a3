"""LLMs of published shapes with random weights, for `r2r bench shapes`: a random GGUF written from the default
LLM's file as a template and quantized as the shipped files are (Q4_K_M), or a transformers model in memory; the
shipped router's architecture with random weights for an SLM shape without a trained router."""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from roads_to_rome.backends.llamacpp import LlamaCppBackend
from roads_to_rome.backends.torch_backend import TorchBackend
from roads_to_rome.errors import R2RError
from roads_to_rome.models import (
    DEFAULT_SLM,
    cache_dir,
    pick_device,
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
