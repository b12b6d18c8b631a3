"""Command-line options that several commands share, declared once (typer `Annotated` aliases)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
import typer.core
from rich.console import Console

from roads_to_rome.routing import POLICIES

console = Console()  # where the commands print

# The panels a command's help groups its options in, in this order (an option named in none: "Options").
PANELS = {
    "Model and engine": ("--slm", "--llm", "--device", "--dtype", "--backend", "--threads", "--llm-retry",
                         "--llm-api-key", "--kv-cache-tokens", "--chat-template"),
    "Routing": ("--router", "--threshold", "--router-path", "--verify", "--max-unverified", "--defer",
                "--defer-group", "--defer-steps", "--overlap", "--overlap-ahead"),
    "Sampling and output": ("--max-new-tokens", "--temperature", "--top-p", "--top-k", "--presence-penalty",
                            "--frequency-penalty", "--repetition-penalty", "--min-p", "--min-tokens", "--stop",
                            "--json-schema", "--regex", "--choice", "--grammar-file", "--seed", "--json",
                            "--logprobs", "--raw", "--suffix"),
    "Server and network": ("--host", "--port", "--model-name", "--api-key", "--allow-unauthenticated", "--docs",
                           "--drain-timeout"),
    "Limits": ("--max-batch", "--max-queue", "--max-tokens", "--prefill-chunk", "--prefix-cache-tokens",
               "--enable-prefix-caching", "--scheduling-policy", "--max-stop-strings", "--max-stop-chars",
               "--max-tokenizing", "--max-body-bytes", "--max-head-seconds", "--max-body-seconds",
               "--max-connections", "--max-request-seconds", "--responses-store-mib"),
    "Compatibility": ("--reasoning-parser", "--tool-call-parser", "--trust-request-chat-template"),
}


class PanelledCommand(typer.core.TyperCommand):
    """A command whose help click writes (every option's name whole, at any width: rich's tables cut long names
    short at 80 columns), its options grouped under `PANELS`."""

    def format_help(self, ctx, formatter) -> None:
        super(typer.core.TyperCommand, self).format_help(ctx, formatter)  # click's own, past typer's rich one

    def format_options(self, ctx, formatter) -> None:
        panel_of = {name: panel for panel, names in PANELS.items() for name in names}
        grouped: dict[str, list] = {panel: [] for panel in [*PANELS, "Options"]}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                grouped[next((panel_of[o] for o in param.opts if o in panel_of), "Options")].append(record)
        for panel, records in grouped.items():
            if records:
                with formatter.section(panel):
                    formatter.write_dl(records)

RouterChoice = Enum("RouterChoice", {name: name for name in POLICIES}, type=str)

# Options that many commands share, declared once.
Slm = Annotated[str | None, typer.Option("--slm", help="SLM: local dir, .gguf file or hub id (default: the "
                                         "prepared Qwen2.5-Coder-0.5B)")]
Llm = Annotated[str | None, typer.Option("--llm", help="LLM: local dir, .gguf file, hub id, or the address of a "
                                         "server running it (http://host:port, llama.cpp's server; "
                                         "?model=NAME picks a served model) (default: the prepared "
                                         "Qwen2.5-Coder-1.5B)")]
LlmRetry = Annotated[float | None, typer.Option("--llm-retry", min=0.0, help="With --llm http://...: seconds a "
                                                "failing call to the LLM's server (unreachable, 5xx, stalled) is "
                                                "retried before the requests that need it fail (default 30).",
                                                show_default=False)]
LlmApiKey = Annotated[str | None, typer.Option("--llm-api-key", envvar="R2R_LLM_API_KEY", help="With --llm "
                                               "http://...: the key its server was started with (--api-key there), "
                                               "sent as a Bearer token (also from $R2R_LLM_API_KEY).",
                                               show_default=False)]
Device = Annotated[str, typer.Option("--device", help="auto (CUDA when present), cpu, cuda or cuda:N, for both "
                                     "models or per role: slm=cuda:0,llm=cuda:1.")]
Dtype = Annotated[str, typer.Option("--dtype",
                                    help="Weights and compute on torch: auto (bf16 on CUDA and on CPUs with native "
                                    "bf16, AVX512-BF16 or AMX; float32 on other CPUs), bfloat16, float16 or float32.")]
BackendOpt = Annotated[str, typer.Option("--backend", help="auto (llama.cpp on a CPU for GGUF files, the default "
                                         "pair's included, when it is installed; torch on CUDA and for model "
                                         "directories), torch (transformers) or llamacpp, for both models or per role: "
                                         "slm=llamacpp,llm=torch. --dtype and --device apply to torch.")]
RouterOpt = Annotated[RouterChoice | None, typer.Option("--router", show_default=False, help="Routing policy "
                                                        "(default: the shipped router for the default pair, "
                                                        "entropy for other pairs).")]
Threshold = Annotated[float | None, typer.Option("--threshold", help="router: probability; entropy: nats; "
                                                 "random: LLM rate")]
RouterPath = Annotated[Path | None, typer.Option("--router-path", help="Router checkpoint directory (for "
                                                 "--router router).")]
Out = Annotated[Path | None, typer.Option("--out", help="Also write the figures as JSON here.")]
Seed = Annotated[int | None, typer.Option("--seed")]
JudgeKind = Annotated[str, typer.Option("--judge", help="local (the pair's LLM), remote, semantic, facts "
                                        "(numbers and names, no model) or answer (the LLM writes each branch to "
                                        "its final answer; divergent when the answer changes) or margin (the LLM's "
                                        "log-probability gap between its token and the SLM's, see --margin).")]
JudgeUrl = Annotated[str | None, typer.Option("--judge-url", help="OpenAI-compatible base URL (remote judge).")]
JudgeModel = Annotated[str | None, typer.Option("--judge-model", help="Model name at that endpoint (remote judge).")]
EntropyThreshold = Annotated[float, typer.Option("--threshold", help="Entropy threshold (nats).")]
AsJson = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
Logprobs = Annotated[int | None, typer.Option("--logprobs", help="With --json: each token's log-probability under "
                                              "the model that wrote it, with that model's N most likely tokens "
                                              "(0 to 20).")]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens")]
Temperature = Annotated[float, typer.Option("--temperature", help="0 is greedy.")]
TopP = Annotated[float, typer.Option("--top-p")]
TopK = Annotated[int, typer.Option("--top-k", help="0 turns it off.")]
PresencePenalty = Annotated[float, typer.Option("--presence-penalty", help="Subtracted from the logit of each token "
                                                "the output already holds (-2 to 2; 0 is none).")]
FrequencyPenalty = Annotated[float, typer.Option("--frequency-penalty", help="Times each token's count in the "
                                                 "output, subtracted from its logit (-2 to 2; 0 is none).")]
RepetitionPenalty = Annotated[float, typer.Option("--repetition-penalty", help="Divides the positive logits (and "
                                                  "multiplies the negative ones) of the tokens in the prompt and "
                                                  "the output (0.01 to 100; 1 is none).")]
MinP = Annotated[float, typer.Option("--min-p", help="When sampling, drop tokens less likely than this times the "
                                     "likeliest one (0 to 1; 0 is none).")]
MinTokens = Annotated[int, typer.Option("--min-tokens", help="Nothing but --max-new-tokens ends the answer before "
                                        "it holds this many tokens.")]

JsonSchemaOpt = Annotated[str | None, typer.Option("--json-schema", help="The answer is JSON following this schema: "
                                                   "the schema itself, or the path of a file holding it ('{}': any "
                                                   "JSON).", show_default=False)]
RegexOpt = Annotated[str | None, typer.Option("--regex", help="The answer matches this regular expression.",
                                              show_default=False)]
ChoiceOpt = Annotated[list[str] | None, typer.Option("--choice", help="The answer is one of these strings "
                                                     "(repeatable).", show_default=False)]
SuffixOpt = Annotated[str | None, typer.Option("--suffix", help="Fill in the middle: the answer goes between the "
                                               "prompt and this text, asked with a code model's fill-in-the-middle "
                                               "tokens (no chat template).", show_default=False)]
GrammarFileOpt = Annotated[Path | None, typer.Option("--grammar-file", help="The answer follows this grammar (Lark, or "
                                                     "llama.cpp's GBNF).", show_default=False)]


def count(default: int, name: str, help: str | None = None):
    """A whole-number option that must be at least 1."""
    return typer.Option(default, name, min=1, help=help)
Verify = Annotated[str | None, typer.Option("--verify", help="Check the SLM's tokens at each LLM catch-up: off, "
                                            "strict (the LLM's own output: lossless) or a tolerance in nats (keep "
                                            "a token the LLM finds within that of its own choice). Default: 1 "
                                            "when routing, off for --router slm or llm.", show_default=False)]
VerifyList = Annotated[str, typer.Option("--verify", help="Comma-separated verification settings (off, strict or "
                                         "tolerances in nats), one system each (empty: none).")]
Defer = Annotated[str | None, typer.Option("--defer", help="Whether a routed row's LLM token may wait for an LLM "
                                           "call grouped with other rows' (the server; a batch of prompts): off; "
                                           "continue (the row keeps the SLM's token and goes on; where the LLM's "
                                           "token differs, the row goes back to it); park (the row's tokens after "
                                           "it are thrown away); auto, the default when routing: continue when the "
                                           "LLM runs on CUDA or on torch in bf16 on a CPU with native bf16 (AMX, "
                                           "AVX512-BF16), else off "
                                           "(llama.cpp's CPU kernels, where grouping measured slower: "
                                           "docs/benchmarks.md). Greedy output is the same either way.",
                                           show_default=False)]
DeferGroup = Annotated[float | None, typer.Option("--defer-group", min=0.0, max=1.0, help="With --defer: the LLM "
                                                  "runs once this share of the batch's rows wait (default 0.6).",
                                                  show_default=False)]
DeferSteps = Annotated[int | None, typer.Option("--defer-steps", min=1, help="With --defer: ... or once a routed "
                                                "token has waited this many steps (default 16).",
                                                show_default=False)]
ReasoningParserOpt = Annotated[str, typer.Option("--reasoning-parser", help="Reasoning models' thinking "
                                                 "(<think>...</think>) apart from the answer: deepseek_r1, qwen3, "
                                                 "none, or auto (a parser when the chat template opens <think>).")]
ToolCallParserOpt = Annotated[str, typer.Option("--tool-call-parser", help="How chat replies' tool calls are "
                                                "read: hermes (<tool_call>{...}</tool_call>, Qwen's and Hermes' "
                                                "templates), llama3_json ({\"name\", \"parameters\"} objects, "
                                                "Llama 3.1's and 3.2's), mistral ([TOOL_CALLS] and a list of calls), "
                                                "none (tools refused), or auto (hermes when the chat template shows "
                                                "<tool_call>, mistral when it shows [TOOL_CALLS], llama3_json when "
                                                "it teaches Llama 3's calls).")]
ChatTemplateOpt = Annotated[str | None, typer.Option("--chat-template", help="A Jinja chat template, or the path of "
                                                    "a file holding one, to write chat prompts in instead of the "
                                                    "tokenizer's own (a base model has none).", show_default=False)]
MaxUnverified = Annotated[int | None, typer.Option("--max-unverified", help="With --verify: catch up "
                                                   "and check once this many tokens are unread by the LLM "
                                                   "(default: no limit). --router slm --verify strict "
                                                   "--max-unverified k is speculative decoding.")]
Overlap = Annotated[str | None, typer.Option("--overlap", help="Whether the LLM's calls run beside the SLM's steps "
                                             "(the SLM keeps writing while the LLM reads; what the LLM then rejects "
                                             "is rolled back): on, off, or auto, the default: on where the LLM runs "
                                             "elsewhere (--llm http://..., another device), off where both share "
                                             "this machine's cores. Greedy output is the same either way.",
                                             show_default=False)]
Threads = Annotated[str | None, typer.Option("--threads", help="CPU threads: a number for both models, or per role "
                                             "like slm=1,llm=1 (each model on its own cores with --overlap on). "
                                             "Default: the cores this process may use.", show_default=False)]
OverlapAhead = Annotated[int | None, typer.Option("--overlap-ahead", min=1, help="With --overlap: tokens the batch's "
                                                  "rows may write, each, beyond what the LLM's call in flight reads "
                                                  "(a budget they share, at least 1 each; default 2).",
                                                  show_default=False)]


# `r2r serve`: where it listens, who may use it, and the limits each request meets (serving/limits.py's `Limits`).
Host = Annotated[str, typer.Option("--host", help="Address to listen on. On a loopback address (the default) requests "
                                   "must name localhost in Host and Origin; any other needs --api-key.")]
Port = Annotated[int, typer.Option("--port", min=1, max=65535)]
ModelName = Annotated[str, typer.Option("--model-name", "--served-model-name", help="The model id clients ask for "
                                        "(--served-model-name: vLLM's name).")]
ApiKey = Annotated[str | None, typer.Option("--api-key", envvar="R2R_API_KEY", help="Require 'Authorization: Bearer "
                                            "KEY' on /v1/ and /metrics (also from $R2R_API_KEY).", show_default=False)]
AllowUnauthenticated = Annotated[bool, typer.Option("--allow-unauthenticated", help="Serve on a non-loopback --host "
                                                    "without --api-key (refused otherwise): anyone who reaches the "
                                                    "port can use the models.")]
TrustRequestChatTemplate = Annotated[bool, typer.Option("--trust-request-chat-template", help="Let chat requests "
                                                        "bring their own chat_template (refused otherwise): a "
                                                        "client's template runs sandboxed, but may take long.")]
Docs = Annotated[bool, typer.Option("--docs", help="Serve the API docs at /docs and /openapi.json.")]
DrainTimeout = Annotated[float, typer.Option("--drain-timeout", min=0, help="On SIGINT/SIGTERM: seconds in-flight "
                                             "requests get to finish before they are cut (a second signal exits at "
                                             "once).")]
KvCacheTokens = Annotated[int | None, typer.Option("--kv-cache-tokens", min=1, help="llama.cpp: the KV-cache tokens "
                                                   "all requests share, per model (default: --max-batch x 4096). A "
                                                   "request holds prompt + max_tokens of them while it runs.",
                                                   show_default=False)]
MaxBatch = Annotated[int, typer.Option("--max-batch", "--max-num-seqs", min=1, help="Requests decoding (or having "
                                       "their prompt read) at once (--max-num-seqs: vLLM's name).")]
MaxQueue = Annotated[int, typer.Option("--max-queue", min=1, help="Requests waiting for a slot (then 429).")]
MaxTokens = Annotated[int, typer.Option("--max-tokens", min=1, help="The most new tokens a request may ask for.")]
PrefillChunk = Annotated[int, typer.Option("--prefill-chunk", min=1, help="Prompt tokens read between two decode "
                                           "steps (running streams keep going while a long prompt is read).")]
PrefixCacheTokens = Annotated[int, typer.Option("--prefix-cache-tokens", min=0, help="Prompt tokens each model keeps "
                                                "read for later prompts that begin the same way (a conversation's "
                                                "next turn, a shared system message), the least recently used "
                                                "dropped beyond it or when a request needs the KV room; 0: none.")]
EnablePrefixCaching = Annotated[bool, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching",
                                                   help="Prefix caching (vLLM's switch; --prefix-cache-tokens sizes "
                                                   "it).")]
SchedulingPolicy = Enum("SchedulingPolicy", {name: name for name in ("fcfs", "priority")}, type=str)
SchedulingPolicyOpt = Annotated[SchedulingPolicy, typer.Option("--scheduling-policy", help="fcfs: waiting requests "
                                "are admitted first come first served; priority: by the request's `priority` (lower "
                                "first; vLLM's field and flag), then in arrival order, a request that finds no room "
                                "preempting less urgent running ones (they resume later where they were).")]
MaxStopStrings = Annotated[int, typer.Option("--max-stop-strings", min=1, help="Stop strings one request may give "
                                             "(then 400).")]
MaxStopChars = Annotated[int, typer.Option("--max-stop-chars", min=1, help="The longest stop string, in characters.")]
MaxTokenizing = Annotated[int, typer.Option("--max-tokenizing", min=1, help="Long prompts (over 16k characters) "
                                            "tokenized or waiting to be at once (then 429); short ones have a lane "
                                            "of their own.")]
MaxCompileSeconds = Annotated[float, typer.Option("--max-compile-seconds", min=0.1, help="Seconds a request's "
                                                  "structured output (a JSON schema, grammar, regex) may take to "
                                                  "compile, off the event loop and one at a time (then 400 naming "
                                                  "the field).")]
MaxBodyBytes = Annotated[int, typer.Option("--max-body-bytes", min=1, help="A request body's size limit (then 413).")]
MaxBodySeconds = Annotated[float, typer.Option("--max-body-seconds", min=0.1, help="Seconds a request body may take "
                                               "to arrive (then 408: a trickling client is cut off).")]
MaxHeadSeconds = Annotated[float, typer.Option("--max-head-seconds", min=0.1, help="Seconds a request's line and "
                                               "headers may take to arrive, from the connection's first byte or its "
                                               "opening (then 408 and the connection is closed).")]
MaxConnections = Annotated[int, typer.Option("--max-connections", min=1, help="Requests in the server at once, "
                                             "streaming ones included (then 429); connections open at once may be "
                                             "twice this (then closed as they open).")]
ResponsesStoreMib = Annotated[int, typer.Option("--responses-store-mib", min=0, help="Memory for the Responses "
                                                "API's stored responses (MiB; the least recently used dropped "
                                                "beyond it; 0 keeps none).")]
MaxRequestSeconds = Annotated[float, typer.Option("--max-request-seconds", min=0.1, help="A whole (not streamed) "
                                                  "answer's deadline (then 408).")]
