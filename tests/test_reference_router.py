"""The paper's reference router: checkpoints built here in the reference's layout (a torch.save'd dict, its state-dict
keys, no token embeddings) import, score as the format's forward written below from its description, export back
to the same file, train with `r2r train --architecture reference`, and every malformed one is refused in a line."""

import json
import os

import pytest
import torch
from helpers import TOP_K, format_forward, planted_dataset, reference_checkpoint
from transformers import AutoModelForCausalLM

from roads_to_rome.backends.torch_backend import TorchBackend
from roads_to_rome.routing.policies import router_policy
from roads_to_rome.routing.router import export_reference, import_reference, load_router


def features(slm, n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, slm.embedding_table().shape[0], (n,), generator=g)
    hidden = torch.randn(n, slm.hidden_size, generator=g)
    logits = torch.randn(n, slm.embedding_table().shape[0], generator=g) * 3
    return hidden, tokens, logits


@pytest.mark.parametrize("normalize", [False, True])
def test_an_imported_checkpoint_scores_as_the_formats_forward(slm, tmp_path, normalize):
    checkpoint = reference_checkpoint(slm.hidden_size, slm.embedding_table().shape[1], normalize=normalize)
    hidden, tokens, logits = features(slm)
    expected = format_forward(checkpoint, hidden, slm.embed(tokens), logits)
    threshold = float(expected.median())  # half the rows routed
    checkpoint["common_args"]["threshold"] = threshold
    torch.save(checkpoint, tmp_path / "router.pt")
    import_reference(tmp_path / "router.pt", slm, tmp_path / "imported")
    policy = router_policy(tmp_path / "imported", slm)
    routed, scores = policy.route(logits, hidden, tokens)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(routed, expected >= threshold) and 0 < int(routed.sum()) < len(routed)
    assert policy.threshold == threshold


def test_import_export_round_trip(slm, tmp_path):
    checkpoint = reference_checkpoint(slm.hidden_size, slm.embedding_table().shape[1], threshold=0.37)
    torch.save(checkpoint, tmp_path / "router.pt")
    import_reference(tmp_path / "router.pt", slm, tmp_path / "imported")
    export_reference(tmp_path / "imported", tmp_path / "again.pt")
    again = torch.load(tmp_path / "again.pt", weights_only=True)
    assert again["model_type"] == checkpoint["model_type"] and again["model_specific_args"] == {}
    assert again["common_args"] == {"threshold": 0.37, "input_type": ["hidden_states", "token", "logits"]}
    for key in ("hidden_states_size", "logits_size", "hidden_dims", "expansion_factor", "normalize_input",
                "use_position_embedding"):
        assert again["init_args"][key] == checkpoint["init_args"][key], key
    assert "token_embeddings.weight" not in again["state_dict"]
    assert again["state_dict"].keys() == checkpoint["state_dict"].keys()
    assert all(torch.equal(again["state_dict"][k], v) for k, v in checkpoint["state_dict"].items())
    import_reference(tmp_path / "again.pt", slm, tmp_path / "twice")
    hidden, tokens, logits = features(slm, seed=1)
    first, second = (router_policy(tmp_path / d, slm).route(logits, hidden, tokens)[1] for d in ("imported", "twice"))
    assert torch.equal(first, second)


class Payload:
    """What a hostile pickle does when unpickled without restrictions."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.mark.parametrize("change, message", [
    ({"model_type": "LogitsClassifier"}, "only HiddenStatesTokenLMHeadLogitsClassifier"),
    ({"init_args": {"hidden_states_size": 1536, "logits_size": TOP_K, "hidden_dims": [24, 24, 16]}},
     "hidden size 1536, but this SLM's is 32"),
    ({"common_args": {"threshold": 0.5, "input_type": ["logits"]}}, "reads ['logits']"),
    ("no state_dict", "it has no state_dict"),
    ("missing weights", "missing backbone.input_projection.bias"),
    ("position", "position embeddings"),
    ("a list", "holds a list"),
    ("code", "loads safely (tensors and plain values only): Trying to load unsupported GLOBAL posix.mkdir"),
    ("not a pickle", "loads safely (tensors and plain values only): not a file torch.save wrote"),
    ("huge", "more than a router's limit"),
    ("wrong shape", "has the wrong shape"),
])
def test_refusals(slm, tmp_path, run_cli, change, message):
    checkpoint = reference_checkpoint(slm.hidden_size, slm.embedding_table().shape[1])
    if change == "no state_dict":
        del checkpoint["state_dict"]
    elif change == "missing weights":
        del checkpoint["state_dict"]["backbone.input_projection.bias"]
    elif change == "position":
        checkpoint["init_args"]["use_position_embedding"] = True
    elif change == "huge":  # a crafted file whose sizes alone would take terabytes to build
        checkpoint["init_args"]["hidden_dims"] = [1_000_000] * 3
    elif change == "wrong shape":
        checkpoint["state_dict"]["backbone.input_projection.bias"] = torch.zeros(3)
    elif change == "a list":
        checkpoint = [checkpoint]
    elif change == "code":
        checkpoint["model_specific_args"] = {"hook": Payload(str(tmp_path / "ran"))}
    elif change != "not a pickle":
        checkpoint.update(change)
    torch.save(checkpoint, tmp_path / "router.pt")
    if change == "not a pickle":
        (tmp_path / "router.pt").write_text("a router, in words\n")
    with pytest.raises(Exception) as refused:
        import_reference(tmp_path / "router.pt", slm, tmp_path / "out")
    assert type(refused.value).__name__ == "R2RError" and message in str(refused.value)
    assert "\n" not in str(refused.value)
    assert "weights_only" not in str(refused.value)  # (torch's advice to load it unsafely, which r2r never does)
    assert not (tmp_path / "ran").exists() and not (tmp_path / "out").exists()


def test_the_cli_imports_trains_and_exports(run_cli, slm, tokenizer, tmp_path):
    from tiny import save_pair

    slm_dir, _ = save_pair(tmp_path)
    torch.save(reference_checkpoint(32, 32), tmp_path / "router.pt")
    code, out, err = run_cli("router", "import", tmp_path / "router.pt", "--slm", slm_dir, "--out",
                             tmp_path / "imported", "--backend", "torch")
    assert code == 0, err
    assert "--router-path" in out and load_router(tmp_path / "imported").threshold == 0.5
    code, _, err = run_cli("generate", "What is 48 / 2?", "--slm", slm_dir, "--llm", tmp_path / "llm",
                           "--router-path", tmp_path / "imported", "--backend", "torch", "--max-new-tokens", "6",
                           "--json")
    assert code == 0, err
    code, _, err = run_cli("router", "import", tmp_path / "nothing.pt", "--slm", slm_dir, "--out", tmp_path / "x")
    assert code == 2 and "no such file" in err

    dataset = planted_dataset(tmp_path / "labels", slm, tokenizer, n_prompts=24, length=20)
    code, out, err = run_cli("train", dataset, "--out", tmp_path / "trained", "--slm", slm_dir, "--dim", "16",
                             "--blocks", "2", "--epochs", "2", "--architecture", "reference", "--backend", "torch",
                             "--dtype", "float32")
    assert code == 0, err
    meta = json.loads((tmp_path / "trained" / "router.json").read_text())
    assert meta["model"] == "reference" and meta["architecture"]["hidden_dims"] == [16, 16]
    code, _, err = run_cli("router", "export", tmp_path / "trained", "--out", tmp_path / "trained.pt")
    assert code == 0, err
    exported = torch.load(tmp_path / "trained.pt", weights_only=True)
    saved_slm = TorchBackend(AutoModelForCausalLM.from_pretrained(slm_dir), name=str(slm_dir))
    hidden, tokens, logits = features(saved_slm, seed=2)
    trained = router_policy(tmp_path / "trained", saved_slm)
    torch.testing.assert_close(trained.route(logits, hidden, tokens)[1],
                               format_forward(exported, hidden, saved_slm.embed(tokens), logits), atol=1e-5,
                               rtol=1e-5)
    code, _, err = run_cli("train", dataset, "--out", tmp_path / "t2", "--slm", slm_dir, "--architecture",
                           "reference", "--inputs", "hidden")
    assert code == 2 and "every input" in err
    code, _, err = run_cli("router", "export", tmp_path / "imported-not-ref", "--out", tmp_path / "x.pt")
    assert code == 2


def test_an_interrupted_import_leaves_the_router_that_was_there(slm, tmp_path, monkeypatch):
    import safetensors.torch

    from roads_to_rome.routing import router as router_module

    checkpoint = reference_checkpoint(slm.hidden_size, slm.embedding_table().shape[1], threshold=0.25)
    torch.save(checkpoint, tmp_path / "router.pt")
    import_reference(tmp_path / "router.pt", slm, tmp_path / "imported")
    before = {f.name: f.read_bytes() for f in (tmp_path / "imported").iterdir()}

    def dies_half_way(tensors, filename):
        safetensors.torch.save_file(dict(list(tensors.items())[:1]), filename)
        raise KeyboardInterrupt

    monkeypatch.setattr(router_module, "save_file", dies_half_way)
    checkpoint["common_args"]["threshold"] = 0.75
    torch.save(checkpoint, tmp_path / "other.pt")
    with pytest.raises(KeyboardInterrupt):
        import_reference(tmp_path / "other.pt", slm, tmp_path / "imported")
    assert {f.name: f.read_bytes() for f in (tmp_path / "imported").iterdir()} == before  # no temporary left either
    assert load_router(tmp_path / "imported").threshold == 0.25
