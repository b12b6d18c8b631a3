"""The neural router: an MLP over the SLM's hidden state, its chosen token and its top-k logits.

Architecture after the R2R paper (section 3.2, arXiv 2505.21600): each input is projected to `dim`, the projections
are concatenated and mixed, then `n_blocks` residual blocks (LayerNorm -> Linear -> GELU ->
Linear) and a LayerNorm + Linear head give one logit: "this token should come from the LLM".

The token embedding table is the SLM's own, frozen, and is never stored in a checkpoint: it is
passed in at load time, and the checkpoint records a hash of it so a router cannot silently run
with a different SLM. A checkpoint is a directory with `router.safetensors` and `router.json`; its `model` says
which architecture: this one ("mlp") or the paper's reference router ("reference", routing/reference.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from roads_to_rome import files
from roads_to_rome.errors import R2RError
from roads_to_rome.routing.reference import ReferenceConfig, ReferenceRouter, read_reference, write_reference

INPUTS = ("hidden", "token", "logits")


@dataclass
class RouterConfig:
    hidden_size: int  # the SLM's last-layer hidden size
    embed_size: int  # the SLM's token-embedding size
    inputs: tuple[str, ...] = INPUTS  # any non-empty subset of INPUTS
    top_k: int = 100  # how many of the SLM's largest log-probabilities the router reads
    dim: int = 128
    n_blocks: int = 2
    dropout: float = 0.1

    def __post_init__(self):
        self.inputs = tuple(self.inputs)
        unknown = set(self.inputs) - set(INPUTS)
        if not self.inputs or unknown:
            raise R2RError(f"router inputs must be a non-empty subset of {INPUTS}, got {self.inputs}")


class ResidualBlock(nn.Module):
    def __init__(self, dim: int, dropout: float):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.dropout(self.down(nn.functional.gelu(self.up(self.norm(x)))))


class Router(nn.Module):
    logits_input = "logprobs"  # reads the top-k log-probabilities (the reference router: raw logits)

    def __init__(self, config: RouterConfig):
        super().__init__()
        self.config = config
        in_sizes = {"hidden": config.hidden_size, "token": config.embed_size, "logits": config.top_k}
        self.proj = nn.ModuleDict({name: nn.Linear(in_sizes[name], config.dim) for name in config.inputs})
        self.mix = nn.Linear(len(config.inputs) * config.dim, config.dim)
        self.blocks = nn.ModuleList(ResidualBlock(config.dim, config.dropout) for _ in range(config.n_blocks))
        self.head = nn.Sequential(nn.LayerNorm(config.dim), nn.Linear(config.dim, 1))

    def forward(self, hidden, token_embedding, logits):
        """hidden [N, H], token_embedding [N, E], logits [N, V] (raw) -> routing logit [N]."""
        top = None
        if "logits" in self.config.inputs:
            # Log-probabilities rather than raw logits: invariant to the logits' shift.
            logits = logits.float()
            top = logits.topk(self.config.top_k, dim=-1).values - torch.logsumexp(logits, dim=-1, keepdim=True)
        return self.forward_features(hidden, token_embedding, top)

    def forward_features(self, hidden, token_embedding, top_logprobs):
        """As `forward`, with the top-k log-probabilities (sorted, descending) already taken (training)."""
        features = {"hidden": hidden, "token": token_embedding, "logits": top_logprobs}
        if top_logprobs is not None:
            features["logits"] = top_logprobs[:, : self.config.top_k]
        x = torch.cat([self.proj[name](features[name].float()) for name in self.config.inputs], dim=-1)
        x = self.mix(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)[:, 0]


def embedding_fingerprint(embedding: torch.Tensor) -> str:
    """A hash of the SLM's token-embedding table (every 97th row: enough to tell models apart, cheap)."""
    sample = embedding.detach()[::97].float().cpu().contiguous()
    return hashlib.sha256(sample.numpy().tobytes()).hexdigest()[:16]


ARCHITECTURES = {"mlp": (RouterConfig, Router), "reference": (ReferenceConfig, ReferenceRouter)}


def architecture(router: nn.Module) -> str:
    return next(name for name, (_, cls) in ARCHITECTURES.items() if isinstance(router, cls))


@dataclass
class RouterCheckpoint:
    router: Router | ReferenceRouter
    threshold: float  # route to the LLM when sigmoid(logit) >= threshold
    slm: dict = field(default_factory=dict)  # identity of the SLM it was trained on
    extra: dict = field(default_factory=dict)  # training metadata, free-form


def save_router(path: str | Path, ckpt: RouterCheckpoint) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in ckpt.router.state_dict().items()}
    # Each file whole or not at all: an interrupted save leaves the router that was there.
    files.write_atomically(path / "router.safetensors", lambda tmp: save_file(tensors, str(tmp)))
    config = {k: v for k, v in asdict(ckpt.router.config).items()
              if k != "inputs" or isinstance(ckpt.router, Router)}  # the reference's inputs are fixed
    meta = {"model": architecture(ckpt.router), "architecture": config, "threshold": ckpt.threshold,
            "slm": ckpt.slm, **ckpt.extra}
    files.write_text(path / "router.json", json.dumps(meta, indent=2))


def slm_identity(slm) -> dict:
    """What a router is tied to: the SLM backend's name, hidden size and token-embedding table."""
    embedding = slm.embedding_table()
    return {
        "name": slm.name,
        "hidden_size": slm.hidden_size,
        "vocab_size": embedding.shape[0],
        "embedding_hash": embedding_fingerprint(embedding),
    }


def load_router(path: str | Path, slm: dict | None = None) -> RouterCheckpoint:
    """Load a checkpoint; with `slm` (see `slm_identity`), refuse one trained for another SLM."""
    path = Path(path)
    if not (path / "router.json").exists() or not (path / "router.safetensors").exists():
        raise R2RError(f"{path} is not a router checkpoint (needs router.json and router.safetensors)")
    try:
        meta = json.loads((path / "router.json").read_text())
        if meta.get("model", "mlp") not in ARCHITECTURES:
            raise ValueError(f"unknown router architecture {meta['model']!r}")
        config_class, router_class = ARCHITECTURES[meta.get("model", "mlp")]
        router = router_class(config_class(**meta["architecture"]))
        router.load_state_dict(load_file(str(path / "router.safetensors")))
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        raise R2RError(f"router checkpoint {path} is damaged or of another version: {e}") from None
    trained_on = meta.get("slm", {})
    if slm is not None:
        for key in ("hidden_size", "vocab_size", "embedding_hash"):
            if key in trained_on and trained_on[key] != slm.get(key):
                raise R2RError(
                    f"router {path} was trained for SLM {trained_on.get('name')!r} ({key}={trained_on[key]}), "
                    f"but the SLM loaded is {slm.get('name')!r} ({key}={slm.get(key)}): train a router for this SLM"
                )
    router.eval()
    extra = {k: v for k, v in meta.items() if k not in ("model", "architecture", "threshold", "slm")}
    return RouterCheckpoint(router, float(meta["threshold"]), trained_on, extra)


def import_reference(file: str | Path, slm, out: str | Path) -> RouterCheckpoint:
    """A reference checkpoint (`r2r router import`) as this project's router directory, for the SLM backend `slm`."""
    embedding = slm.embedding_table()
    router, threshold, init = read_reference(Path(file), slm.hidden_size, embedding.shape[1])
    ckpt = RouterCheckpoint(router, threshold, slm_identity(slm),
                            {"imported_from": {"file": Path(file).name, "init_args": {
                                k: v for k, v in init.items() if isinstance(v, (str, int, float, bool, list))}}})
    save_router(out, ckpt)
    return ckpt


def export_reference(path: str | Path, out: str | Path) -> None:
    """A router directory of the reference architecture as the reference's own file (`r2r router export`)."""
    ckpt = load_router(path)
    if not isinstance(ckpt.router, ReferenceRouter):
        raise R2RError(f"{path} is a router of this project's own architecture, which the reference's code does not "
                       f"run: train one with `r2r train --architecture reference` to export it")
    write_reference(ckpt.router, ckpt.threshold, Path(out), ckpt.slm.get("name") or "")
