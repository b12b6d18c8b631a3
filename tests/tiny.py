"""Tiny randomly initialised causal LMs with a real (tiny) byte-level BPE tokenizer: no download."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

CORPUS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "def add(a, b):\n    return a + b\n",
    "The answer is 72. Let us think step by step: first, 48 / 2 = 24; then 48 + 24 = 72.",
    "Paris is the capital of France. Bonjour! Über naïve café — 東京 🙂",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2.5's template, cut to what it does with tools: they go in the system turn with the call syntax, earlier calls
# are written back in it (arguments with tojson), and tools' answers go in a user turn.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% if m.content %}{{ m.content }}\n{% endif %}{% for c in m.tool_calls %}<tool_call>\n{\"name\": \""
    "{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer(vocab_size: int = 300, extra_words: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS + list(extra_words) * 50, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )
    return fast


# The architectures users bring: Qwen2 (the default pair, R1-Distill's Qwen models), Qwen3 (q and k normed per head,
# no attention biases: five of the reference's six routers are for Qwen3 pairs) and Llama (R1-Distill's Llama models).
FAMILIES = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
            "llama": (LlamaConfig, LlamaForCausalLM)}


def tiny_model(tokenizer, hidden: int = 32, layers: int = 2, seed: int = 0, dtype=torch.float32,
               vocab_rows: int | None = None, family: str = "qwen2", max_positions: int = 512):
    """`vocab_rows`: embedding and output-head rows, more than the tokenizer's to pad (as real pairs do)."""
    torch.manual_seed(seed)
    config_class, model_class = FAMILIES[family]
    extra = {"head_dim": hidden // 4} if family == "qwen3" else {}
    config = config_class(**extra,
        vocab_size=vocab_rows or len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = model_class(config).to(dtype).eval()
    # Larger output weights than the default init, so that logits are far apart and argmax is stable.
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def save_pair(tmp_path, tokenizer=None, llm_tokenizer=None, max_positions: int = 512):
    """Write a tiny SLM and LLM (same tokenizer unless `llm_tokenizer` is given) as model directories."""
    tokenizer = tokenizer or tiny_tokenizer()
    llm_tokenizer = llm_tokenizer or tokenizer
    dirs = []
    for name, tok, hidden, seed in (("slm", tokenizer, 32, 0), ("llm", llm_tokenizer, 64, 1)):
        path = tmp_path / name
        tiny_model(tok, hidden=hidden, seed=seed, max_positions=max_positions).save_pretrained(path)
        tok.save_pretrained(path)
        dirs.append(path)
    return dirs


def save_gguf(model, tokenizer, path) -> None:
    """Write a tiny model of one of `FAMILIES` as an F32 GGUF file that llama.cpp runs (same weights, same
    vocabulary)."""
    import json

    import gguf

    config = model.config
    arch = {"qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3, "llama": gguf.MODEL_ARCH.LLAMA}[
        config.model_type]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    vocab = tokenizer.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    # Padding rows beyond the tokenizer get placeholder tokens, as converted real models have.
    padding = [f"[PAD{i}]" for i in range(len(tokens), config.vocab_size)]
    specials = set(tokenizer.all_special_tokens) | set(SPECIALS)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens + padding)
    writer.add_token_types([gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens]
                           + [gguf.TokenType.UNUSED] * len(padding))
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if arch == gguf.MODEL_ARCH.LLAMA and name.endswith(("q_proj.weight", "k_proj.weight")):
            # llama.cpp rotates a Llama model's q and k as pairs of adjacent dimensions, transformers as halves.
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            tensor = rope_pairs(tensor, heads)
        writer.add_tensor(gguf_name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def rope_pairs(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q or k projection from transformers' rotary layout (each head's two halves) to llama.cpp's Llama
    layout (adjacent pairs), as llama.cpp's own converter writes them."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)
