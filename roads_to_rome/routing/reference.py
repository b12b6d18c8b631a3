"""The paper's reference router (thu-nics/R2R, `HiddenStatesTokenLMHeadLogitsClassifier`) as a second router
architecture, and its checkpoint file: `r2r router import` reads one, `r2r router export` writes one.

What the reference computes, from its published format: the top-k raw logits (sorted, no softmax) are projected to
the SLM's hidden size; the hidden state (after the final norm), the chosen token's input embedding and that
projection are concatenated and projected to the first block's width; an input projection, residual blocks
(LayerNorm -> Linear(x expansion) -> GELU -> Linear, plus the input, projected where the width changes) and a
LayerNorm + Linear head give one logit; a token goes to the LLM when sigmoid >= the checkpoint's threshold.
Everything in float32. The module names below are the format's state-dict keys, so a checkpoint loads as it is.

The file is a `torch.save`d dict: `model_type`, `init_args`, `common_args` ({threshold, input_type}),
`model_specific_args`, and a `state_dict` without `token_embeddings.weight` (the SLM's own embeddings, supplied when
it runs). It is a pickle: it is read with `weights_only` loading, which builds tensors and plain values only."""

from __future__ import annotations

import math
import pickle
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from roads_to_rome import files
from roads_to_rome.errors import R2RError

MODEL_TYPE = "HiddenStatesTokenLMHeadLogitsClassifier"
INPUT_TYPE = ["hidden_states", "token", "logits"]
# Far past any router's (the reference's have a few million parameters): a file past these is not a router.
MAX_FILE_BYTES = 1 << 30
MAX_PARAMETERS = 200_000_000


@dataclass
class ReferenceConfig:
    hidden_size: int  # the SLM's hidden size (the format's hidden_states_size)
    embed_size: int  # the SLM's token-embedding size
    top_k: int = 100  # raw logits read (logits_size)
    hidden_dims: tuple[int, ...] = (1024,) * 6  # the blocks' widths (the R1 pair's routers: six of 1024)
    expansion: int = 4
    dropout: float = 0.1
    normalize_input: bool = False  # LayerNorm on hidden state and embedding, softmax over the top-k logits
    inputs: tuple[str, ...] = field(default=("hidden", "token", "logits"), init=False)

    def __post_init__(self):
        self.hidden_dims = tuple(self.hidden_dims)
        if not self.hidden_dims:
            raise R2RError("the reference router needs at least one block width")


class ReferenceBlock(nn.Module):
    def __init__(self, width: int, out: int, expansion: int, dropout: float):
        super().__init__()
        self.layer_norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, width * expansion), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(width * expansion, out), nn.Dropout(dropout))
        self.dim_change = nn.Linear(width, out) if width != out else nn.Identity()

    def forward(self, x):
        return self.dim_change(x) + self.mlp(self.layer_norm(x))


class ReferenceBackbone(nn.Module):
    def __init__(self, config: ReferenceConfig):
        super().__init__()
        dims = list(config.hidden_dims) + [config.hidden_dims[-1]]
        self.input_projection = nn.Linear(dims[0], dims[0])
        self.blocks = nn.ModuleList(ReferenceBlock(dims[i], dims[i + 1], config.expansion, config.dropout)
                                    for i in range(len(config.hidden_dims)))
        self.output_layer = nn.Sequential(nn.LayerNorm(dims[-1]), nn.Linear(dims[-1], 1))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.kaiming_normal_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x):
        x = self.input_projection(x)
        for block in self.blocks:
            x = block(x)
        return self.output_layer(x)


class ReferenceRouter(nn.Module):
    logits_input = "raw"  # reads the top-k raw logits (this project's own router: log-probabilities)

    def __init__(self, config: ReferenceConfig):
        super().__init__()
        self.config = config
        if config.normalize_input:
            self.layer_norm_hidden_states = nn.LayerNorm(config.hidden_size)
            self.layer_norm_token = nn.LayerNorm(config.embed_size)
        self.logits_projection = nn.Linear(config.top_k, config.hidden_size)
        self.combined_projection = nn.Linear(2 * config.hidden_size + config.embed_size, config.hidden_dims[0])
        self.backbone = ReferenceBackbone(config)

    def forward(self, hidden, token_embedding, logits):
        """hidden [N, H], token_embedding [N, E], logits [N, V] (raw) -> routing logit [N]."""
        return self.forward_features(hidden, token_embedding, logits.float().topk(self.config.top_k, dim=-1).values)

    def forward_features(self, hidden, token_embedding, top_logits):
        """As `forward`, with the top-k raw logits (sorted, descending) already taken (training)."""
        hidden, token_embedding, top_logits = hidden.float(), token_embedding.float(), top_logits.float()
        if self.config.normalize_input:
            hidden = self.layer_norm_hidden_states(hidden)
            token_embedding = self.layer_norm_token(token_embedding)
            top_logits = top_logits.softmax(-1)
        x = torch.cat([hidden, token_embedding, self.logits_projection(top_logits)], dim=-1)
        return self.backbone(self.combined_projection(x))[:, 0]


# ---- the reference's checkpoint file ------------------------------------------------------------------------------

def read_reference(path: Path, hidden_size: int, embed_size: int) -> tuple[ReferenceRouter, float, dict]:
    """A reference checkpoint as a router for an SLM of these sizes: (router, threshold, the file's init_args).
    Refuses, in one line each, a file that is not one, an architecture it is not, another SLM's sizes, and sizes
    past what any router needs (checked before anything is allocated from them)."""
    saved = _load_checkpoint(path)
    init, common = saved["init_args"], saved["common_args"]
    state = {k: v for k, v in saved["state_dict"].items() if k != "token_embeddings.weight"}
    _check_inputs(path, init, common, state, hidden_size, embed_size)
    config = _checked_config(path, init, state, hidden_size, embed_size)
    router = ReferenceRouter(config)
    try:
        router.load_state_dict({k: v.float() for k, v in state.items()})
    except RuntimeError as e:
        raise R2RError(f"{path}'s weights do not match its init_args: {str(e).splitlines()[-1].strip()}") from None
    threshold = float(common.get("threshold", 0.5))
    if not 0 <= threshold <= 1:
        raise R2RError(f"{path}'s threshold {threshold} is not a probability")
    return router.eval(), threshold, dict(init)


def unpickler_detail(error: Exception) -> str:
    """Why torch's safe loader refused a file, on one line: not a file `torch.save` wrote, or what it holds that the
    loader does not build (an object of a class, a function), without torch's advice to load it unsafely or to allow
    the class, which r2r never does."""
    text = " ".join(str(error).split())
    if isinstance(error, pickle.UnpicklingError):
        text = text.split("WeightsUnpickler error:")[-1].split("trusted source.")[-1]
        for advice in ("Please use `torch.serialization", "Check the documentation of torch.load"):
            text = text.split(advice)[0]
        text = text.strip()
        if not text.startswith("Unsupported operand"):  # (a pickle instruction it does not know: not a checkpoint)
            return text or type(error).__name__
    return f"not a file torch.save wrote ({text or type(error).__name__})"


def _load_checkpoint(path: Path) -> dict:
    """The file's dict, loaded safely (tensors and plain values only), with the reference's keys and model type."""
    if path.exists() and path.stat().st_size > MAX_FILE_BYTES:
        raise R2RError(f"{path} has {path.stat().st_size:,} bytes, more than a router's limit of {MAX_FILE_BYTES:,}: "
                       "it is not a router checkpoint")
    try:
        with warnings.catch_warnings():  # (a pickle of another protocol: torch warns, then reads it or says why not)
            warnings.simplefilter("ignore")
            saved = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise R2RError(f"{path}: no such file") from None
    except Exception as e:  # weights_only refuses any class it does not know: nothing in the file runs
        raise R2RError(f"{path} is not a router checkpoint that loads safely (tensors and plain values only): "
                       f"{unpickler_detail(e)}") from None
    if not isinstance(saved, dict):
        raise R2RError(f"{path} is not a reference router checkpoint: it holds a {type(saved).__name__}, not a dict")
    missing = [key for key in ("model_type", "init_args", "common_args", "state_dict") if key not in saved]
    if missing:
        raise R2RError(f"{path} is not a reference router checkpoint: it has no {', '.join(missing)}")
    if saved["model_type"] != MODEL_TYPE:
        raise R2RError(f"{path} holds a {saved['model_type']!r} router; only {MODEL_TYPE} (the reference's published "
                       f"routers) can be imported")
    return saved


def _check_inputs(path: Path, init: dict, common: dict, state: dict, hidden_size: int, embed_size: int) -> None:
    """What the router reads, against what this project's router reads and this SLM's sizes."""
    if sorted(common.get("input_type") or []) != sorted(INPUT_TYPE):
        raise R2RError(f"{path} reads {common.get('input_type')}; a {MODEL_TYPE} reads {INPUT_TYPE}")
    if init.get("use_position_embedding"):
        raise R2RError(f"{path} adds position embeddings, which this project's router does not: it cannot be imported")
    if init.get("hidden_states_size", 1536) != hidden_size:
        raise R2RError(f"{path} was trained for an SLM of hidden size {init.get('hidden_states_size', 1536)}, but this "
                       f"SLM's is {hidden_size}: import it with the SLM it was trained on (--slm)")
    combined = state.get("combined_projection.weight")
    if combined is not None and combined.shape[1] != 2 * hidden_size + embed_size:
        raise R2RError(f"{path} was trained for token embeddings of size {combined.shape[1] - 2 * hidden_size}, but "
                       f"this SLM's are {embed_size}: import it with the SLM it was trained on (--slm)")


def _checked_config(path: Path, init: dict, state: dict, hidden_size: int, embed_size: int) -> ReferenceConfig:
    """The architecture the file's init_args describe, sized on the meta device (nothing allocated), within the
    limits, with every weight of the file in its shape."""
    try:
        config = ReferenceConfig(hidden_size, embed_size, top_k=int(init.get("logits_size", 100)),
                                 hidden_dims=tuple(int(d) for d in init.get("hidden_dims", (256, 512, 256))),
                                 expansion=int(init.get("expansion_factor", 4)),
                                 dropout=float(init.get("dropout_rate", 0.3)),
                                 normalize_input=bool(init.get("normalize_input", False)))
        with torch.device("meta"):
            shapes = {k: v.shape for k, v in ReferenceRouter(config).state_dict().items()}
    except (RuntimeError, ValueError, TypeError) as e:
        raise R2RError(f"{path}'s init_args describe no router: {str(e).splitlines()[0]}") from None
    parameters = sum(math.prod(shape) for shape in shapes.values())
    if parameters > MAX_PARAMETERS:
        raise R2RError(f"{path}'s init_args describe a router of {parameters:,} parameters, more than a router's "
                       f"limit of {MAX_PARAMETERS:,}: it is not a router checkpoint for this SLM")
    absent, unknown = sorted(shapes.keys() - set(state)), sorted(set(state) - shapes.keys())
    if absent or unknown:
        raise R2RError(f"{path}'s weights do not match its init_args: "
                       + "; ".join(f"{what} {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}"
                                   for what, keys in (("missing", absent), ("unexpected", unknown)) if keys))
    wrong = [k for k, shape in shapes.items() if not isinstance(state[k], torch.Tensor) or state[k].shape != shape]
    if wrong:
        raise R2RError(f"{path}'s weights do not match its init_args: {wrong[0]} has the wrong shape")
    return config


def write_reference(router: ReferenceRouter, threshold: float, path: Path, slm_name: str) -> None:
    """The reference's file for a router of this architecture, so that its code runs a router trained here.
    `slm_name` is what its loader rebuilds the token embeddings from (a hub id)."""
    config = router.config
    init = {"hidden_states_size": config.hidden_size, "logits_size": config.top_k,
            "hidden_dims": list(config.hidden_dims), "expansion_factor": config.expansion,
            "dropout_rate": config.dropout, "pretrained_model_name": slm_name, "use_position_embedding": False,
            "max_position_embeddings": 1024, "topk": None, "normalize_input": config.normalize_input,
            "freeze_lm_head": True}
    state = {k: v.detach().cpu().float().clone() for k, v in router.state_dict().items()}
    saved = {"model_type": MODEL_TYPE, "init_args": init,
             "common_args": {"threshold": float(threshold), "input_type": list(INPUT_TYPE)},
             "model_specific_args": {}, "state_dict": state}
    files.write_atomically(path, lambda tmp: torch.save(saved, tmp))
