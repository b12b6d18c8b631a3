"""A reference-layout router of the real 0.5B's sizes (random weights from a seed), imported with `r2r router import`
and run by `r2r generate`, routes exactly the tokens that the format's forward (tests/test_reference_router.py),
computed here on the SLM's own features, marks. On torch in float32, where a prefill's features equal the decode
steps' to rounding (llama.cpp's depend on the batch's company, docs/backends.md)."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import format_forward, reference_checkpoint

from roads_to_rome.data.benchmarks import gsm8k, gsm8k_prompt

pytestmark = pytest.mark.e2e


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "roads_to_rome", *args], capture_output=True, text=True, timeout=900)


def test_an_imported_reference_router_routes_as_its_format_says(tmp_path):
    from roads_to_rome.models import load_alone

    engine = load_alone(None, "slm", "cpu", "float32", "torch")
    slm, tokenizer = engine.slm, engine.tokenizer
    embedding = slm.embedding_table().float()
    checkpoint = reference_checkpoint(slm.hidden_size, embedding.shape[1], dims=(256, 256), seed=3)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": gsm8k_prompt(gsm8k()[0])}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)

    def scores(ids: list[int], start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The format's score at each position from `start` on, with the token the SLM proposes there (greedy)."""
        logits, hidden = slm.forward_sequence(ids, start)
        proposals = logits.float().argmax(-1)
        return format_forward(checkpoint, hidden.float(), embedding[proposals], logits.float()), proposals

    # A threshold that routes some of the prompt's own positions and not others.
    checkpoint["common_args"]["threshold"] = float(scores(prompt, 0)[0].quantile(0.7))
    torch.save(checkpoint, tmp_path / "reference.pt")
    result = run_cli("router", "import", tmp_path / "reference.pt", "--out", tmp_path / "router", "--backend",
                     "torch", "--dtype", "float32")
    assert result.returncode == 0, result.stderr
    result = run_cli("generate", gsm8k_prompt(gsm8k()[0]), "--router-path", tmp_path / "router", "--verify", "off",
                     "--max-new-tokens", "48", "--backend", "torch", "--dtype", "float32", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    threshold = checkpoint["common_args"]["threshold"]
    # Without verification nothing is taken back: position j was decided after prompt + the tokens before it.
    expected, proposals = scores(prompt + out["token_ids"][:-1], len(prompt) - 1)
    routed = [source == "llm" for source in out["sources"]]
    assert routed == (expected >= threshold).tolist()
    assert 0 < sum(routed) < len(routed)
    assert torch.allclose(torch.tensor(out["scores"]), expected, atol=1e-4)
    # Where the SLM kept its token, it is the proposal the features were computed with.
    assert all(t == p for t, p, r in zip(out["token_ids"], proposals.tolist(), routed) if not r)
