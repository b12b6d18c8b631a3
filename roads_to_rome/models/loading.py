"""Loading models and engines: backends from model specs, and the engine a configuration describes (put together
by `systems`, the one place that wires backends, routing and the engine).

A model spec is None (the default pair's model for its role), a local directory, a .gguf file, a
hub id, or (for the LLM) the address of a server running it.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path

from roads_to_rome import hardware
from roads_to_rome.backends import AUTO, BACKENDS
from roads_to_rome.backends.llamacpp import MAX_SEQUENCES, LlamaCppBackend, llama_cpp_available
from roads_to_rome.backends.remote import DEFAULT_LLM_RETRY, RemoteBackend, is_remote
from roads_to_rome.backends.torch_backend import TorchBackend
from roads_to_rome.core.engine import Engine, default_verify
from roads_to_rome.core.llm_calls import DEFAULT_DEFER, Deferral, parse_overlap, resolve_defer, resolve_overlap
from roads_to_rome.core.prefix_cache import kept_prompt_rows
from roads_to_rome.core.sampling import Verify, check_max_unverified, parse_verify
from roads_to_rome.errors import R2RError
from roads_to_rome.models import systems
from roads_to_rome.models.packaged import (
    DEFAULT_LLM,
    DEFAULT_SLM,
    PackagedModel,
    bf16_dir,
    converted_dir,
    gguf_path,
    is_converted,
    is_prepared,
    shipped_router,
    tokenizer_source,
)
from roads_to_rome.progress import console_progress
from roads_to_rome.routing import policies


def resolve(spec: str | None, default: PackagedModel) -> str:
    """Turn a user's model spec (None, local dir, .gguf file, hub id) into something from_pretrained reads: for the
    default pair's model, its bf16 copy (made now if this is the first time a torch backend asks)."""
    if spec is None:
        if not is_prepared(default):
            raise R2RError(f"default model {default.name} is not prepared. "
                           "Run `r2r models prepare` (or `make models`).")
        if is_converted(default):
            return str(converted_dir(default))
        with console_progress() as progress:
            return str(bf16_dir(default, progress))
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
    if path.is_dir():
        check_model_dir(path, role)
    kwargs = {"gguf_file": path.name} if path.is_file() else {}
    source = str(path.parent if path.is_file() else (path if looks_local else spec))
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **kwargs)
    except Exception as e:  # transformers raises OSError, ValueError, gguf reader errors...
        said = " ".join(str(e).split())[:400] or type(e).__name__  # its messages run over several lines
        hint = "" if looks_local else " (not a local path, so it was tried as a hub id)"
        raise R2RError(f"cannot load {role} model {spec!r}{hint}: {said}") from None
    return model.to(device), tokenizer


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def check_model_dir(path: Path, role: str) -> None:
    """A model directory holds a config and a tokenizer: said by name before transformers says it less plainly."""
    tokenizer = f"tokenizer files ({', '.join(TOKENIZER_FILES[:-1])} or {TOKENIZER_FILES[-1]})"
    missing = [what for what, present in (("config.json", (path / "config.json").exists()),
                                          (tokenizer, any((path / name).exists() for name in TOKENIZER_FILES)))
               if not present]
    if missing:
        raise R2RError(f"{role} model directory {path} holds no {' and no '.join(missing)}: give a transformers model "
                       "directory (as save_pretrained writes it) or a .gguf file")


PADDING_TOKEN = re.compile(r"\[PAD\d+\]")  # what converters name the rows an embedding has beyond the vocabulary


def same_tokenizer(a, b) -> bool:
    """The same tokens with the same ids; placeholder rows padding a model's embedding (151,936 or 152,064 rows
    for one Qwen vocabulary) are not tokens and may differ."""
    def real(tokenizer):
        return {t: i for t, i in tokenizer.get_vocab().items() if not PADDING_TOKEN.fullmatch(t)}

    return real(a) == real(b)


def pick_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise R2RError("--device cuda asked for, but torch sees no CUDA device (use --device cpu)")
    if device != "cpu" and not device.startswith("cuda"):
        raise R2RError(f"unknown device {device!r}: use auto, cpu or cuda")
    return device


DTYPES = ("auto", "bfloat16", "float16", "float32")


def pick_dtype(dtype: str, device: str) -> str:
    """What torch computes in: as asked, or for `auto` bf16 where the hardware has it (CUDA; a CPU with
    AVX512-BF16 or AMX) and float32 on other CPUs, where bf16 is emulated and runs several times slower."""
    if dtype not in DTYPES:
        raise R2RError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    if dtype != "auto":
        return dtype
    on_gpu = any(pick_device(d) != "cpu" for d in parse_devices(device).values())
    return "bfloat16" if on_gpu or hardware.has_native_bf16() else "float32"


def per_role(spec: str, option: str, valid, usage: str, default: str) -> dict[str, str]:
    """An option's value for both roles, or per role (`slm=X,llm=Y`; a role left out gets `default`)."""
    roles = {"slm": default, "llm": default}
    for part in (p.strip() for p in spec.split(",")):
        role, _, name = part.rpartition("=")
        targets = [role] if role else list(roles)
        if not valid(name) or any(t not in roles for t in targets):
            raise R2RError(f"bad {option} {spec!r}: use {usage}")
        for t in targets:
            roles[t] = name
    return roles


def parse_backends(spec: str) -> dict[str, str]:
    """`auto`, `torch`, `llamacpp`, or per role: `slm=llamacpp,llm=torch` (a role left out stays torch)."""
    return per_role(spec, "--backend", lambda name: name in (*BACKENDS, AUTO),
                    "auto, torch, llamacpp, or per role like slm=llamacpp,llm=torch", "torch")


def parse_devices(spec: str) -> dict[str, str]:
    """`auto`, `cpu`, `cuda`, `cuda:N`, or per role: `slm=cuda:0,llm=cuda:1` (a role left out: auto)."""
    return per_role(spec, "--device", lambda name: name in ("auto", "cpu") or re.fullmatch(r"cuda(:\d+)?", name),
                    "auto, cpu, cuda, cuda:N, or per role like slm=cuda:0,llm=cuda:1", "auto")


def auto_backend(spec: str | None, device: str) -> str:
    """What `--backend auto` runs a model on: llama.cpp on a CPU when it is installed and the model is a GGUF file
    (the default pair's prepared files, or a .gguf path): its quantized kernels are the fast CPU path for the
    one-token steps that dominate R2R; torch on CUDA and for model directories and hub ids."""
    if pick_device(device) != "cpu" or not llama_cpp_available():
        return "torch"
    return "llamacpp" if spec is None or str(spec).endswith(".gguf") else "torch"


def backend_for(spec: str | None, role: str, device: str = "auto", backend: str = "auto") -> str:
    """What runs a role's model ("slm" or "llm"), known before it loads: "torch", "llamacpp", or "remote" (an LLM
    on a serving engine)."""
    if role == "llm" and is_remote(spec):
        return "remote"
    name = parse_backends(backend)[role]
    return auto_backend(spec, parse_devices(device)[role]) if name == AUTO else name


def _load_llamacpp(spec: str | None, default: PackagedModel, role: str, llama: dict, vocab_size: int | None):
    """(backend, tokenizer) for a GGUF file run by llama.cpp; the tokenizer comes from transformers. `llama`:
    the context's sizes (`n_ctx`, `max_rows`) when not llama.cpp's defaults here."""
    from transformers import AutoTokenizer

    if spec is None:
        if not is_prepared(default):
            raise R2RError(f"default model {default.name} is not prepared. "
                           "Run `r2r models prepare` (or `make models`).")
        gguf_file, source = gguf_path(default), {"pretrained_model_name_or_path": str(tokenizer_source(default))}
    else:
        gguf_file = Path(spec).expanduser()
        if gguf_file.suffix != ".gguf" or not gguf_file.is_file():
            raise R2RError(f"{role} model {spec}: the llama.cpp backend runs GGUF files; give an existing .gguf file "
                           "or use --backend torch")
        source = {"pretrained_model_name_or_path": str(gguf_file.parent), "gguf_file": gguf_file.name}
    try:
        tokenizer = AutoTokenizer.from_pretrained(**source)
    except Exception as e:
        reason = str(e).strip().splitlines()[0]
        raise R2RError(f"cannot read the tokenizer of {role} model {gguf_file}: {reason}") from None
    return LlamaCppBackend(gguf_file, name=spec or default.name, vocab_size=vocab_size or len(tokenizer), **llama), \
        tokenizer


ROLES = {"slm": DEFAULT_SLM, "llm": DEFAULT_LLM}


def load_model(spec: str | None, role: str, device: str = "auto", dtype: str = "auto", backend: str = "auto",
               llama: dict | None = None, vocab_size: int | None = None, compile: bool | None = None,
               threads: int | None = None):
    """One model on its backend: `spec` (None: the default pair's model for `role`, "slm" or "llm").

    Returns (backend, tokenizer). The backend returns logits over the tokenizer's ids only (`vocab_size` of them
    when given: another model's, whose tokenizer this one shares but for padding rows). `llama`: sizes for a
    llama.cpp context (`n_ctx`: the KV pool its rows share; `max_rows`). `compile`: on CUDA, whether torch's graphs
    record the trunk compiled (default: the SLM's do, the LLM's do not). `threads`: llama.cpp's CPU threads for this
    model (torch's are the process's, or the LLM worker's: `Engine`)."""
    import torch

    name = backend_for(spec, role, device, backend)
    device = parse_devices(device)[role]
    dtype = pick_dtype(dtype, device)
    default, label = ROLES[role], role.upper()
    if name == "llamacpp":
        return _load_llamacpp(spec, default, label, {**(llama or {}), **({"n_threads": threads} if threads else {})},
                              vocab_size)
    model, tokenizer = _load_one(resolve(spec, default), label, pick_device(device), getattr(torch, dtype))
    # On CUDA the SLM's graphs record its trunk compiled: its step is bound by kernel launches, and it compiles in
    # seconds. The LLM's step is bound mostly by its weights, and a large one takes minutes to compile.
    return TorchBackend(model, name=spec or default.name, vocab_size=vocab_size or len(tokenizer),
                        compile=role == "slm" if compile is None else compile), tokenizer


def load_pair(slm: str | None = None, llm: str | None = None, device: str = "auto", need_llm: bool = True,
              dtype: str = "auto", backend: str = "auto", llama: dict | None = None, llm_retry: float | None = None,
              threads: dict[str, int] | None = None, llm_api_key: str | None = None,
              chat_template: str | None = None):
    """Load the SLM and (if `need_llm`) the LLM, each on its backend; refuse pairs whose tokenizers differ.
    `llm_retry`: for an LLM on a server, seconds a failing call is retried (None: `DEFAULT_LLM_RETRY`);
    `llm_api_key`: its server's key (None: $R2R_LLM_API_KEY, if set). `chat_template`: a template's text for the
    tokenizer's own (`use_chat_template`), what every chat prompt is written in and what "auto" parsers read.

    `threads`: CPU threads per role ("slm", "llm"); the SLM's also set torch's for this process.

    Returns (slm_backend, llm_backend or None, tokenizer)."""
    import torch

    threads = threads or {}
    if threads.get("slm"):
        torch.set_num_threads(threads["slm"])
    slm_backend, tokenizer = load_model(slm, "slm", device, dtype, backend, llama, threads=threads.get("slm"))
    if chat_template is not None:
        use_chat_template(tokenizer, chat_template)
    if not need_llm:
        return slm_backend, None, tokenizer
    if is_remote(llm):  # an LLM on a serving engine: it must share the SLM's tokenizer (checked on connecting)
        retry = DEFAULT_LLM_RETRY if llm_retry is None else llm_retry
        return slm_backend, RemoteBackend(llm, tokenizer, slm_backend.eos_ids, vocab_size=slm_backend.vocab_size,
                                          retry=retry, api_key=llm_api_key), tokenizer
    llm_backend, llm_tokenizer = load_model(llm, "llm", device, dtype, backend, llama, slm_backend.vocab_size,
                                            threads=threads.get("llm"))
    if not same_tokenizer(tokenizer, llm_tokenizer):
        raise R2RError(
            f"the SLM and LLM tokenizers differ ({len(tokenizer)} vs {len(llm_tokenizer)} tokens): "
            "R2R needs a pair that shares one tokenizer"
        )
    return slm_backend, llm_backend, tokenizer


def load_alone(spec: str | None, role: str, device: str = "auto", dtype: str = "auto", backend: str = "auto"):
    """One model writing every token by itself (`Engine.alone`): "slm" or "llm"."""
    model, tokenizer = load_model(spec, role, device, dtype, backend)
    return systems.alone(model, tokenizer, role)


def router_path_for(router_path: Path | None, slm_spec: str | None) -> Path | None:
    """The router checkpoint to use: the one given, else the one shipped for the default SLM (none
    for another SLM: a router is tied to the SLM it was trained on)."""
    if router_path is not None:
        return Path(router_path)
    return shipped_router() if slm_spec is None else None


def choose_policy(kind: str | None, router_path: Path | None, slm_spec: str | None) -> tuple[str, Path | None]:
    """`policies.choose` with the shipped router as the default SLM's default."""
    return policies.choose(kind, router_path_for(router_path, slm_spec), router_path is not None)


@dataclass(frozen=True)
class EngineConfig:
    """What `load_engine` builds: the pair and where it runs, how it routes, how routed tokens are verified, and how
    the LLM's calls are grouped and run. `verify`, `defer` and `overlap` are checked and parsed here, once."""

    slm: str | None = None  # a model spec (None: the default pair's SLM)
    llm: str | None = None  # a model spec or a server's address (None: the default pair's LLM)
    device: str = "auto"
    dtype: str = "auto"
    backend: str = "auto"  # a backend for both models, or per role: slm=llamacpp,llm=torch
    policy: str | None = None  # None: the shipped router for the default pair, else entropy
    threshold: float | None = None  # None: the policy's own (a router's calibrated one)
    router_path: Path | None = None
    seed: int | None = None  # the random policy's draws
    verify: Verify | str | float | None = None  # None: `default_verify` (DEFAULT_VERIFY where routed, else off)
    max_unverified: int | None = None
    defer: str | None = None  # off, continue, park or auto (None: `DEFAULT_DEFER` when routing, off for one model)
    defer_group: float | None = None  # None: the grouping rule's default (`Deferral`)
    defer_steps: int | None = None
    overlap: str | bool | None = None  # off, on or auto (None: `DEFAULT_OVERLAP`): the LLM's calls beside the SLM
    overlap_ahead: int | None = None  # None: the rule's default (`Deferral.ahead`)
    threads: str | int | None = None  # CPU threads: a number for both models, or per role: slm=1,llm=1
    llama: dict | None = None  # a llama.cpp context's sizes: n_ctx (the KV pool its rows share), max_rows
    llm_retry: float | None = None  # an LLM on a server: seconds a failing call is retried (None: the default)
    llm_api_key: str | None = field(default=None, repr=False)  # ... and its key (None: $R2R_LLM_API_KEY)
    chat_template: str | None = None  # a Jinja chat template, or a file holding one, for the tokenizer's own


    def __post_init__(self):
        if self.verify is not None:
            object.__setattr__(self, "verify", parse_verify(self.verify))
        object.__setattr__(self, "max_unverified", check_max_unverified(self.max_unverified))
        if self.defer is not None and self.defer != "auto":
            Deferral(self.defer)  # says which modes there are
        object.__setattr__(self, "overlap", parse_overlap(self.overlap))
        object.__setattr__(self, "threads", parse_threads(self.threads))
        if self.chat_template is not None:
            object.__setattr__(self, "chat_template", read_chat_template(self.chat_template))


def read_chat_template(spec: str) -> str:
    """--chat-template: the text of a file, or a Jinja template given inline (vLLM's flag)."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in spec or "{%" in spec:
        return spec
    raise R2RError(f"--chat-template: no file at {spec}, and it is not a Jinja template (no {{{{ or {{%): give the "
                   "path of a template file or the template itself")


def template_hash(template: str | None) -> str | None:
    """What a run records of the template given for the tokenizer's (None: none given), to refuse a resume with
    another."""
    import hashlib

    return None if template is None else hashlib.sha256(template.encode()).hexdigest()[:16]


def use_chat_template(tokenizer, template: str) -> None:
    """Make `template` the tokenizer's chat template, compiled once here (as transformers compiles it) so that a
    syntax error stops the start rather than every chat request."""
    import jinja2

    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], chat_template=template, tokenize=False)
    except jinja2.TemplateSyntaxError as e:
        raise R2RError(f"--chat-template is not a valid Jinja template (line {e.lineno}: {e.message})") from None
    except jinja2.TemplateError:
        pass  # the template's own refusal of a lone user message: its requests are checked one by one
    tokenizer.chat_template = template


def parse_threads(spec: str | int | dict | None) -> dict[str, int]:
    """--threads: a number for both models, or per role (`slm=1,llm=1`); {} for each backend's own choice."""
    if spec is None or isinstance(spec, dict):
        return dict(spec or {})
    roles = {}
    for part in str(spec).split(","):
        role, _, value = part.strip().rpartition("=")
        targets = [role] if role else ["slm", "llm"]
        if not value.isdigit() or int(value) < 1 or any(t not in ("slm", "llm") for t in targets):
            raise R2RError(f"bad --threads {spec!r}: a number of threads for both models, or per role like "
                           "slm=1,llm=1")
        roles.update(dict.fromkeys(targets, int(value)))
    return roles


def load_engine(config: EngineConfig | None = None, **fields) -> Engine:
    """The engine a config describes (`fields` override it: `load_engine(llm="...")`). For the `slm` policy without
    verification, the SLM alone: no LLM is loaded."""
    config = dataclasses.replace(config or EngineConfig(), **fields)
    kind, router_path = choose_policy(config.policy, config.router_path, config.slm)
    verify = config.verify if config.verify is not None else default_verify(kind not in ("slm", "llm"))
    check_max_unverified(config.max_unverified, verify.on)
    check_routing_settings(config, kind, verify)
    mode, rule = grouping_rule(config, kind)
    slm_b, llm_b, tokenizer = load_pair(config.slm, config.llm, config.device,
                                        need_llm=kind != "slm" or verify.on,
                                        dtype=config.dtype, backend=config.backend, llama=config.llama,
                                        llm_retry=config.llm_retry, threads=config.threads,
                                        llm_api_key=config.llm_api_key, chat_template=config.chat_template)
    deferral = dataclasses.replace(rule, mode=resolve_defer(mode, llm_b))
    overlap = resolve_overlap(config.overlap if overlaps(kind, verify) else "off", slm_b, llm_b)
    return systems.routed(slm_b, llm_b, tokenizer, kind, config.threshold, router_path, config.seed, verify,
                          config.max_unverified, deferral, overlap, config.threads.get("llm"))


def overlaps(kind: str, verify: Verify) -> bool:
    """Whether the LLM's calls can run beside the SLM's steps: where tokens are routed, or where the SLM drafts
    alone and the LLM checks (speculative decoding), not where one model writes alone."""
    return kind not in ("slm", "llm") or (kind == "slm" and verify.on)


def check_routing_settings(config: EngineConfig, kind: str, verify: Verify) -> None:
    """Settings of routed tokens are refused where one model writes every token: none of them would be read, and a
    run that silently ignored --threshold would be taken for one that used it. Likewise a grouping share where
    nothing is grouped."""
    if kind not in ("slm", "llm"):
        if config.defer == "off" and config.defer_group is not None:
            raise R2RError("--defer-group is the share of a batch's rows that wait for one grouped LLM call, and "
                           "--defer off groups none: leave it out, or group (--defer continue, park or auto)")
        return
    given = {"--threshold": config.threshold is not None, "--defer": config.defer not in (None, "off", "auto"),
             "--defer-group": config.defer_group is not None, "--defer-steps": config.defer_steps is not None}
    if not overlaps(kind, verify):
        given |= {"--overlap": config.overlap == "on", "--overlap-ahead": config.overlap_ahead is not None}
    unread = [flag for flag, set_ in given.items() if set_]
    if unread:
        drafts = ", or have the LLM check the SLM's tokens (--verify)" if kind == "slm" and not verify.on else ""
        raise R2RError(f"{', '.join(unread)} {'sets' if len(unread) == 1 else 'set'} how routed tokens go to the "
                       f"LLM; --router {kind} writes every token with the {kind.upper()}"
                       f"{' (the LLM checks them)' if verify.on else ''}: leave {'it' if len(unread) == 1 else 'them'}"
                       f" out, or route (--router router, entropy or random){drafts}")
    if kind == "llm" and verify.on:
        raise R2RError("--router llm writes every token with the LLM: there is nothing for it to check, so leave "
                       "--verify out (--router slm --verify strict is speculative decoding)")


def grouping_rule(config: EngineConfig, kind: str) -> tuple[str, Deferral]:
    """The config's deferral mode (`auto` resolves once the LLM is loaded) and its rule, checked before anything
    loads: the default rule's settings where the config gives none."""
    mode = config.defer if config.defer is not None else "off" if kind in ("slm", "llm") else DEFAULT_DEFER
    return mode, Deferral.of("off" if mode == "auto" else mode, config.defer_group, config.defer_steps,
                             config.overlap_ahead)


def llama_rows(batch_rows: int, keeps_prompts: bool = True) -> int:
    """The sequences a llama.cpp context is made with for a batch of `batch_rows`: one per row, and one per kept
    prompt where prompts are kept."""
    return batch_rows + (kept_prompt_rows(batch_rows, MAX_SEQUENCES) if keeps_prompts else 0)
