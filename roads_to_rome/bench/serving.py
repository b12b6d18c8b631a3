"""The OpenAI-compatible server under load: its own module, so that the other benchmarks need no serving
dependencies (a GPU box may have torch and transformers and nothing else).

For each system and each number of clients, that many clients send the same GSM8K dev prompts back to back until
all are answered: aggregate throughput, each request's latency, and how the LLM's calls were grouped. The systems are
what a serving user would run: R2R with its LLM calls in the step (lockstep, or grouped: +defer=MODE) or beside the
SLM's steps (+overlap); the LLM or the SLM alone behind the same server and backends (`llm`, `slm`), or the LLM asked
directly on its own server (`llm-direct`, with --llm http://...); speculative decoding in this engine (`spec+k=K`:
the SLM drafts, the LLM checks every K tokens strictly); R2R's server with every request forcing one model
(`r2r+force=slm|llm`: what such a request costs on a server that routes; `+force=llm/2`: every second request,
the others routed: a mixed load). Greedy decoding gives every R2R system the
same tokens, so they do the same work."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import openai

from roads_to_rome.backends.remote import is_remote
from roads_to_rome.bench.measure import kernels
from roads_to_rome.core.context import Counters
from roads_to_rome.core.engine import DEFAULT_VERIFY, Engine
from roads_to_rome.core.llm_calls import DEFER_MODES, Deferral
from roads_to_rome.core.prefix_cache import PREFIX_TOKENS
from roads_to_rome.data.benchmarks import GSM8K_DEV_ITEMS, gsm8k, gsm8k_prompt, gsm8k_worked
from roads_to_rome.errors import R2RError
from roads_to_rome.models import load_pair, systems
from roads_to_rome.models.loading import choose_policy, llama_rows
from roads_to_rome.plots import pyplot
from roads_to_rome.progress import QUIET
from roads_to_rome.routing import policies
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.limits import SERVER_SCHEDULING, Limits
from roads_to_rome.serving.server import create_app

DEFAULT_SYSTEMS = "r2r,r2r+overlap,llm,spec+k=4"


@dataclass(frozen=True)
class ServedSystem:
    """One row of `r2r bench serve`, by name: r2r[+overlap][+defer=MODE][+force=MODEL], llm, slm, llm-direct or
    spec[+k=K]."""

    name: str
    kind: str  # r2r, llm, slm, llm-direct, spec
    overlap: bool = False
    defer: str = "off"
    k: int = 4
    force: str | None = None  # each request's r2r_policy
    every: int = 1  # ... of every `every`-th request only (the others routed)

    @classmethod
    def parse(cls, name: str) -> ServedSystem:
        kind, *parts = name.strip().split("+")
        fields = {}
        for part in parts:
            key, _, value = part.partition("=")
            if kind in ("r2r", "spec") and key == "overlap" and not value:
                fields["overlap"] = True
            elif kind == "r2r" and key == "defer" and value in DEFER_MODES:
                fields["defer"] = value
            elif kind == "spec" and key == "k" and value.isdigit() and int(value) >= 1:
                fields["k"] = int(value)
            elif kind == "r2r" and key == "force" and forced_share(value) is not None:
                fields["force"], fields["every"] = forced_share(value)
            else:
                raise R2RError(f"bad system {name!r} in --systems: use r2r[+overlap][+defer=continue|park]"
                               "[+force=slm|llm[/N]], llm, slm, llm-direct or spec[+k=K][+overlap]")
        if kind not in ("r2r", "llm", "slm", "llm-direct", "spec"):
            raise R2RError(f"unknown system {kind!r} in --systems: use r2r, llm, slm, llm-direct or spec")
        return cls(name.strip(), kind, **fields)

    @classmethod
    def check(cls, names: list[str], llm: str | None, threshold: float | None = None, defer_group: float | None = None,
              defer_steps: int | None = None, overlap_ahead: int | None = None) -> list[ServedSystem]:
        """The systems of --systems, checked before anything loads, with the settings only some systems read (None:
        not given)."""
        chosen = [cls.parse(name) for name in names]
        if len({s.name for s in chosen}) < len(chosen):
            raise R2RError(f"--systems names a system twice: {', '.join(names)}")
        if any(s.kind == "llm-direct" for s in chosen) and not is_remote(llm):
            raise R2RError("--systems llm-direct asks the LLM's own server: give it with --llm http://...")
        grouped, overlapped = any(s.defer != "off" for s in chosen), any(s.overlap for s in chosen)
        for option, value, reader, read in (
                ("--threshold", threshold, "r2r", any(s.kind == "r2r" for s in chosen)),
                ("--defer-group", defer_group, "r2r+defer=...", grouped),
                ("--defer-steps", defer_steps, "r2r+defer=... or +overlap", grouped or overlapped),
                ("--overlap-ahead", overlap_ahead, "+overlap", overlapped)):
            if value is not None and not read:
                raise R2RError(f"{option} is for {reader} systems, and --systems {','.join(names)} has none: add one, "
                               "or leave it out")
        return chosen

    def engine(self, slm, llm, tokenizer, policy, rule: Deferral) -> Engine | None:
        """The engine the server runs for this system (None: the LLM's own server answers)."""
        if self.kind == "llm-direct":
            return None
        if self.kind in ("llm", "slm"):
            return systems.alone(llm if self.kind == "llm" else slm, tokenizer, self.kind)
        if self.kind == "spec":
            return systems.routed(slm, llm, tokenizer, "slm", verify="strict", max_unverified=self.k,
                                  overlap=self.overlap)
        return systems.routed(slm, llm, tokenizer, policy, verify=DEFAULT_VERIFY,
                              defer=dataclasses.replace(rule, mode=self.defer), overlap=self.overlap)


def forced_share(value: str) -> tuple[str, int] | None:
    """`+force=MODEL` or `+force=MODEL/N` as (the model, every how many requests force it); None if malformed."""
    model, slash, every = value.partition("/")
    if model not in ("slm", "llm") or (slash and not (every.isdigit() and int(every) >= 1)):
        return None
    return model, int(every or 1)


def serving(slm: str | None, llm: str | None, device: str, dtype: str, clients: list[int], n_tokens: int,
            requests: int, names: list[str], rule: Deferral = Deferral(), backend: str = "auto",
            threshold: float | None = None, rounds: int = 1, progress=QUIET, threads: dict | None = None) -> dict:
    """The server with the pair's default policy (the shipped router for the default pair) and verification, beside
    what users would run instead: for each system of `names` (`ServedSystem`) and each count in `clients`,
    `requests` GSM8K dev prompts sent by that many clients; `rounds` times over, the systems taking turns (a
    machine's speed drifts between minutes: alternating spreads the drift over all of them)."""
    chosen = ServedSystem.check(names, llm)
    rows = max(clients)
    slm_backend, llm_backend, tokenizer = load_pair(slm, llm, device, dtype=dtype, backend=backend,
                                                    llama={"max_rows": rows, "n_ctx": rows * 4096}, threads=threads)
    kind, router_path = choose_policy(None, None, slm)
    policy = policies.build(kind, slm_backend, threshold, router_path)
    prompts = [gsm8k_prompt(item) for item in gsm8k()[:requests]]
    engines = {s.name: s.engine(slm_backend, llm_backend, tokenizer, policy, rule) for s in chosen}
    answered: dict[str, list] = {}  # "system xN" -> per round: (answers, seconds, what the engine counted)
    task = progress.add_task("serving", total=rounds * len(chosen) * len(clients) * requests)
    for _ in range(rounds):
        for system in chosen:
            name, engine = system.name, engines[system.name]
            with (BackgroundServer(create_app(engine, "r2r", Limits(max_batch=rows))) if engine is not None
                  else nullcontext(None)) as server:
                url = server.url if server is not None else llm_backend.client.url
                model = "r2r" if server is not None else llm_backend.api.model
                client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)

                def ask(prompt, index=0):
                    start = time.perf_counter()
                    forced = system.force and index % system.every == 0
                    out = client.chat.completions.create(model=model, temperature=0, max_tokens=n_tokens,
                                                         messages=[{"role": "user", "content": prompt}],
                                                         extra_body={"r2r_policy": system.force} if forced else None)
                    progress.advance(task)
                    extra = out.usage.model_extra or {}
                    return out.usage.completion_tokens, extra.get("llm_tokens", out.usage.completion_tokens), \
                        time.perf_counter() - start

                ask(prompts[0][:50])  # warm-up
                for count in clients:
                    before = dataclasses.replace(engine.counters) if engine is not None else Counters()
                    start = time.perf_counter()
                    with concurrent.futures.ThreadPoolExecutor(count) as pool:
                        answers = list(pool.map(ask, prompts, range(len(prompts))))
                    counted = engine.counters - before if engine is not None else Counters()
                    answered.setdefault(f"{name} x{count}", []).append(
                        (answers, time.perf_counter() - start, counted))
    baseline = chosen[0].name
    runs = summarise(answered, baseline)
    return {"clients": clients, "requests": requests, "tokens": n_tokens, "rounds": rounds, "dtype": dtype,
            "backend": backend, "device": str(slm_backend.device), "threads": threads or {},
            "kernels": kernels(slm=slm_backend, llm=llm_backend), "policy": policy.name, "verify": DEFAULT_VERIFY,
            "defer_group": rule.group, "defer_steps": rule.steps, "overlap_ahead": rule.ahead, "baseline": baseline,
            "systems": [s.name for s in chosen], "runs": runs}


def summarise(answered: dict[str, list], baseline: str) -> dict:
    """Each "system xN" run's figures over its rounds, and its throughput and p95 latency against the baseline
    system's at the same number of clients."""
    runs = {}
    for key, per_round in answered.items():
        name, count = key.rsplit(" x", 1)
        counted = sum((r[2] for r in per_round), Counters())
        runs[key] = {"system": name, "clients": int(count),
                     **load_figures([a for r in per_round for a in r[0]], sum(r[1] for r in per_round)),
                     "tokens_per_s_rounds": [sum(a[0] for a in r[0]) / r[1] for r in per_round],
                     "llm_calls": counted.llm_calls, "steps": counted.steps,
                     "routed_rows_per_call": counted.routed_rows_per_call}
    for run in runs.values():
        base = runs[f"{baseline} x{run['clients']}"]
        run["x_throughput"] = run["tokens_per_s"] / base["tokens_per_s"]
        run["x_p95"] = run["p95_s"] / base["p95_s"]
    return runs


def load_figures(answers: list[tuple[int, int, float]], seconds: float) -> dict:
    """Aggregate throughput of (tokens, LLM tokens, latency) per request over `seconds`, and the latencies'
    median and 95th percentile."""
    tokens = sum(a[0] for a in answers)
    latencies = np.array([a[2] for a in answers])
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "llm_rate": sum(a[1] for a in answers) / max(tokens, 1),
            "p50_s": float(np.percentile(latencies, 50)), "p95_s": float(np.percentile(latencies, 95))}


def conversations(slm: str | None, llm: str | None, device: str, dtype: str, clients: int, turns: int, n_tokens: int,
                  backend: str = "auto", prefix_tokens: int = PREFIX_TOKENS, rounds: int = 1, progress=QUIET,
                  threads: dict | None = None, shots: int = 0, n: int = 1) -> dict:
    """Conversations through the server with prefix caching and without, side by side: each of `clients` clients
    holds one conversation of `turns` GSM8K dev questions, each turn's prompt the earlier turns with their answers
    and the next question, streamed; `rounds` times over, the two servers taking turns. Greedy decoding gives both
    the same answers: they differ only in what they read of each prompt. Per turn: prompt tokens, tokens found
    kept, time to the first token; per conversation, its seconds.

    With `shots`, every conversation opens with the same system message: that many worked GSM8K dev solutions (the
    last dev items, no question of the conversations), as few-shot prompts and agents' long instructions are shared
    by every request. The clients then arrive one after another, each once the one before has its first token, so
    that what the first read can be found by the others (clients that start together all read it at once).

    With `n` above 1, each turn asks for n choices, sampled (temperature 0.7, seeded), and the conversation goes on
    with the first: with prefix caching the choices read their prompt once."""
    slm_backend, llm_backend, tokenizer = load_pair(
        slm, llm, device, dtype=dtype, backend=backend, threads=threads,
        llama={"max_rows": llama_rows(clients * n), "n_ctx": clients * n * 4096 + prefix_tokens})
    kind, router_path = choose_policy(None, None, slm)
    policy = policies.build(kind, slm_backend, None, router_path)
    engine = systems.routed(slm_backend, llm_backend, tokenizer, policy, verify=DEFAULT_VERIFY)
    items = gsm8k()
    questions = [gsm8k_prompt(item) for item in items[: clients * turns]]
    examples = items[GSM8K_DEV_ITEMS - shots: GSM8K_DEV_ITEMS] if shots else []
    opening = [{"role": "system", "content": few_shot_message(examples)}] if shots else []
    settings = {"kept": prefix_tokens, "none": 0}
    measured: dict[str, list] = {name: [] for name in settings}  # per round: each client's turns
    task = progress.add_task("conversations", total=rounds * len(settings) * clients * turns)
    for _ in range(rounds):
        for name, kept in settings.items():
            limits = Limits(max_batch=clients * n, max_tokens=n_tokens)
            scheduling = dataclasses.replace(SERVER_SCHEDULING, prefix_tokens=kept)
            with BackgroundServer(create_app(engine, "r2r", limits, scheduling=scheduling)) as server:
                client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=3600)

                # Client k may start once client k - 1 has its first token (with shots; all at once otherwise).
                arrived = [threading.Event() for _ in range(clients + 1)]
                for event in arrived[: 1 if shots else clients]:
                    event.set()

                def converse(k: int) -> list[dict]:
                    arrived[k].wait()
                    messages, done = list(opening), []
                    try:
                        for question in questions[k * turns: (k + 1) * turns]:
                            messages.append({"role": "user", "content": question})
                            done.append(timed_turn(client, messages, n_tokens, arrived[k + 1].set, n))
                            messages.append({"role": "assistant", "content": done[-1]["text"]})
                            progress.advance(task)
                    finally:
                        arrived[k + 1].set()  # an answer without text, or a failed one, lets the next start too
                    return done

                with concurrent.futures.ThreadPoolExecutor(clients) as pool:
                    measured[name].append(list(pool.map(converse, range(clients))))
    return {"clients": clients, "turns": turns, "tokens": n_tokens, "rounds": rounds, "shots": shots, "n": n,
            "prefix_cache_tokens": prefix_tokens, "dtype": dtype, "backend": backend, "device": str(slm_backend.device),
            "threads": threads or {}, "kernels": kernels(slm=slm_backend, llm=llm_backend), "policy": policy.name,
            **conversation_figures(measured)}


def few_shot_message(examples: list[dict]) -> str:
    """A system message of worked GSM8K solutions, as a few-shot prompt gives them."""
    shown = "\n\n".join(f"Question: {item['question']}\nAnswer: {gsm8k_worked(item)}" for item in examples)
    return f"You solve math word problems step by step. Worked examples:\n\n{shown}"


def timed_turn(client, messages: list[dict], n_tokens: int, on_first_token=lambda: None, n: int = 1,
               priority: int = 0) -> dict:
    """One turn, streamed: its (first choice's) answer's text, seconds to the first token of any choice and to the
    last, its usage. Greedy; n choices are sampled (temperature 0.7, seeded). `priority`: vLLM's field (0: not
    sent)."""
    start, first = time.perf_counter(), None
    text, usage = [], None
    sampling = {"temperature": 0} if n == 1 else {"temperature": 0.7, "seed": 0, "n": n}
    try:
        stream = client.chat.completions.create(model="r2r", messages=messages, max_tokens=n_tokens, stream=True,
                                                stream_options={"include_usage": True}, **sampling,
                                                extra_body={"priority": priority} if priority else None)
    except openai.BadRequestError as e:
        raise R2RError(f"the server refused a turn: {e.message}") from None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter()
                on_first_token()
            if chunk.choices[0].index == 0:
                text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    return {"text": "".join(text), "ttft_s": (first or end) - start, "seconds": end - start,
            "prompt_tokens": usage.prompt_tokens, "cached_tokens": usage.prompt_tokens_details.cached_tokens,
            "completion_tokens": usage.completion_tokens}


def conversation_figures(measured: dict[str, list]) -> dict:
    """Per setting and turn, the means over clients and rounds; each setting's mean conversation; the ratios of the
    setting without kept prompts to the one with (above 1: prefix caching is faster)."""
    talks = {name: [talk for clients in per_round for talk in clients] for name, per_round in measured.items()}
    per_turn, whole = {}, {}
    for name, held in talks.items():
        per_turn[name] = [{key: float(np.mean([talk[t][key] for talk in held]))
                           for key in ("prompt_tokens", "cached_tokens", "ttft_s", "seconds", "completion_tokens")}
                          for t in range(len(held[0]))]
        whole[name] = {"seconds": float(np.mean([sum(turn["seconds"] for turn in talk) for talk in held])),
                       "ttft_s": float(np.mean([sum(turn["ttft_s"] for turn in talk) for talk in held]))}
    kept, none = per_turn["kept"], per_turn["none"]
    # Where each conversation's answers first differ between the two (None: nowhere): a near-tie read another way
    # falls the other way, and every later turn's prompt differs from there.
    first_difference = [next((t + 1 for t, (a, b) in enumerate(zip(x, y)) if a["text"] != b["text"]), None)
                        for x, y in zip(talks["kept"], talks["none"])]
    return {"per_turn": per_turn, "conversation": whole,
            "x_ttft_per_turn": [b["ttft_s"] / a["ttft_s"] for a, b in zip(kept, none)],
            "x_ttft": whole["none"]["ttft_s"] / whole["kept"]["ttft_s"],
            "x_seconds": whole["none"]["seconds"] / whole["kept"]["seconds"],
            "first_difference": first_difference,
            "same_answers": sum(a["text"] == b["text"] for x, y in zip(talks["kept"], talks["none"])
                                for a, b in zip(x, y)),
            "answers": sum(len(x) for x in talks["kept"])}


def plot_conversations(result: dict, path) -> None:
    """Each turn's time to the first token, with prefix caching and without, against the turn's prompt length."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6, 4))
    for name, label in (("none", "no prefix caching"), ("kept", "prefix caching")):
        turns = result["per_turn"][name]
        axis.plot([t["prompt_tokens"] for t in turns], [t["ttft_s"] for t in turns], marker="o", label=label)
    axis.set_xlabel("prompt tokens (the conversation so far)")
    axis.set_ylabel("time to first token (s)")
    shared = f", {result['shots']}-shot system message" if result.get("shots") else ""
    axis.set_title(f"{result['clients']} conversation(s) at once{shared}, {result['backend']} on {result['device']}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# The urgent requests' priority and the batch job's under the priority policy (vLLM's order: lower first).
URGENT, BATCH_JOB = 0, 10


def urgent_requests(slm: str | None, llm: str | None, device: str, dtype: str, batch_clients: int, urgent: int,
                    n_tokens: int, urgent_tokens: int, backend: str = "auto", rounds: int = 1, progress=QUIET,
                    threads: dict | None = None, pause_s: float = 1.0) -> dict:
    """Urgent requests on a server whose batch a batch job fills, scheduling first come first served and by
    priority, side by side. `batch_clients` clients send GSM8K dev questions back to back (priority 10 under the
    priority policy), as many as the batch holds (`--max-batch`); once each has its first token, `urgent` other
    questions (priority 0) come one after another, each `pause_s` after the one before is answered. First come first
    served, an urgent request waits for a batch request to finish; by priority it preempts one. Per urgent request:
    seconds to its first token and to its last; the server's tokens per second over the run (the batch job's and the
    urgent ones': what preempting costs it) and the batch job's alone; the preemptions. `rounds` times over, the two
    servers taking turns."""
    slm_backend, llm_backend, tokenizer = load_pair(
        slm, llm, device, dtype=dtype, backend=backend, threads=threads,
        llama={"max_rows": llama_rows(batch_clients), "n_ctx": batch_clients * 4096 + PREFIX_TOKENS})
    kind, router_path = choose_policy(None, None, slm)
    policy = policies.build(kind, slm_backend, None, router_path)
    engine = systems.routed(slm_backend, llm_backend, tokenizer, policy, verify=DEFAULT_VERIFY)
    items = gsm8k()
    urgent_questions = [gsm8k_prompt(item) for item in items[:urgent]]
    batch_questions = [gsm8k_prompt(item) for item in items[urgent: GSM8K_DEV_ITEMS]]
    measured: dict[str, list] = {"fcfs": [], "priority": []}
    task = progress.add_task("urgent requests", total=rounds * len(measured) * urgent)
    for _ in range(rounds):
        for scheduling in measured:
            measured[scheduling].append(urgent_run(engine, scheduling, batch_questions, urgent_questions,
                                                   batch_clients, n_tokens, urgent_tokens, pause_s,
                                                   lambda: progress.advance(task)))
    return {"batch_clients": batch_clients, "urgent": urgent, "tokens": n_tokens, "urgent_tokens": urgent_tokens,
            "pause_s": pause_s, "rounds": rounds, "dtype": dtype, "backend": backend,
            "device": str(slm_backend.device), "threads": threads or {},
            "kernels": kernels(slm=slm_backend, llm=llm_backend), "policy": policy.name,
            **urgency_figures(measured)}


def urgent_run(engine: Engine, scheduling: str, batch_questions: list[str], urgent_questions: list[str],
               batch_clients: int, n_tokens: int, urgent_tokens: int, pause_s: float, advance) -> dict:
    """One server of `urgent_requests` under one scheduling policy: the batch job filling its batch, the urgent
    requests one after another beside it; what they measured."""
    by_priority = scheduling == "priority"
    limits = Limits(max_batch=batch_clients, max_tokens=max(n_tokens, urgent_tokens))
    before = dataclasses.replace(engine.counters)
    admitted = dataclasses.replace(SERVER_SCHEDULING, by_priority=by_priority)
    with BackgroundServer(create_app(engine, "r2r", limits, scheduling=admitted)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=3600)
        started = [threading.Event() for _ in range(batch_clients)]
        urgent_done = threading.Event()

        def batch_job(k: int) -> list[dict]:
            answers, asked = [], k
            while not urgent_done.is_set():
                question = batch_questions[asked % len(batch_questions)]
                answers.append(timed_turn(client, [{"role": "user", "content": question}], n_tokens,
                                          started[k].set, priority=BATCH_JOB if by_priority else 0))
                asked += batch_clients
            return answers

        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(batch_clients) as pool:
            jobs = [pool.submit(batch_job, k) for k in range(batch_clients)]
            try:
                for event in started:
                    event.wait()
                answers = []
                for question in urgent_questions:
                    time.sleep(pause_s)
                    answers.append(timed_turn(client, [{"role": "user", "content": question}], urgent_tokens,
                                              priority=URGENT))
                    advance()
            finally:
                urgent_done.set()
            batch = [answer for job in jobs for answer in job.result()]
        seconds = time.perf_counter() - start
    return {
        "urgent": answers, "preemptions": (engine.counters - before).preemptions,
        "batch_requests": len(batch), "batch_tokens": sum(a["completion_tokens"] for a in batch),
        "urgent_tokens": sum(a["completion_tokens"] for a in answers), "seconds": seconds}


def urgency_figures(measured: dict[str, list]) -> dict:
    """Per scheduling policy, over rounds: each urgent request's seconds to its first token and to its last (means
    over rounds), their means and the worst, the server's tokens per second (all requests') and the batch job's, the
    preemptions; the ratios of first come first served to priority (above 1: priority answers urgent requests
    sooner), priority's share of first come first served's throughput, and whether the urgent answers are the same
    under both (greedy: they should be, but for near-ties read in another batch). The batch job's own tokens per
    second is lower by priority also because the urgent requests, answered sooner, take a larger share of a shorter
    run: the server's is what preempting costs."""
    figures = {}
    for scheduling, runs in measured.items():
        ttft = [float(np.mean([run["urgent"][i]["ttft_s"] for run in runs])) for i in range(len(runs[0]["urgent"]))]
        last = [float(np.mean([run["urgent"][i]["seconds"] for run in runs])) for i in range(len(runs[0]["urgent"]))]
        seconds = sum(run["seconds"] for run in runs)
        figures[scheduling] = {
            "ttft_s": ttft, "seconds": last, "mean_ttft_s": float(np.mean(ttft)), "worst_ttft_s": max(ttft),
            "mean_seconds": float(np.mean(last)), "preemptions": sum(run["preemptions"] for run in runs),
            "batch_requests": sum(run["batch_requests"] for run in runs),
            "tokens_per_s": sum(run["batch_tokens"] + run["urgent_tokens"] for run in runs) / seconds,
            "batch_tokens_per_s": sum(run["batch_tokens"] for run in runs) / seconds}
    fcfs, priority = figures["fcfs"], figures["priority"]
    same = sum(a["text"] == b["text"] for x, y in zip(measured["fcfs"], measured["priority"])
               for a, b in zip(x["urgent"], y["urgent"]))
    return {"by_scheduling": figures, "x_ttft": fcfs["mean_ttft_s"] / priority["mean_ttft_s"],
            "x_seconds": fcfs["mean_seconds"] / priority["mean_seconds"],
            "throughput_kept": priority["tokens_per_s"] / fcfs["tokens_per_s"],
            "same_urgent_answers": same, "urgent_answers": sum(len(run["urgent"]) for run in measured["fcfs"])}


def plot_urgency(result: dict, path) -> None:
    """Each urgent request's time to its first token, first come first served and by priority."""
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(6, 4))
    for scheduling, label in (("fcfs", "first come first served"), ("priority", "by priority (preempting)")):
        ttft = result["by_scheduling"][scheduling]["ttft_s"]
        axis.plot(range(1, len(ttft) + 1), ttft, marker="o", label=label)
    axis.set_xticks(range(1, len(ttft) + 1))
    axis.set_xlabel("urgent request")
    axis.set_ylabel("time to first token (s)")
    axis.set_ylim(bottom=0)
    axis.set_title(f"{result['batch_clients']} batch-job clients filling the batch, {result['backend']} on "
                   f"{result['device']}")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
