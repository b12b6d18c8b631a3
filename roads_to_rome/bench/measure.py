"""Benchmarks: each compares things measured side by side in one run (absolute times drift here)."""

from __future__ import annotations

import statistics
import time

import torch
from transformers import DynamicCache

from roads_to_rome import models
from roads_to_rome.backends.remote import RemoteBackend
from roads_to_rome.core.request import Totals
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.data.benchmarks import gsm8k, gsm8k_prompt
from roads_to_rome.errors import R2RError
from roads_to_rome.hardware import describe_cpu
from roads_to_rome.models import load_model, load_pair, systems
from roads_to_rome.progress import QUIET
from roads_to_rome.routing import policies
from roads_to_rome.routing.policies import entropy

BENCH_PROMPT = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Explain step by step."
)


def processor() -> str:
    """The machine a figure came from: the CPU (`hardware.describe_cpu`) and the GPU if any."""
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return describe_cpu() + gpu


def kernels(**models) -> dict[str, str]:
    """What ran each model of a measurement (`Backend.kernels`), by its role."""
    return {role: backend.kernels for role, backend in models.items() if backend is not None}


@torch.inference_mode()
def bare_loop(model, prompt_ids: list[int], n_tokens: int, static: bool = False,
              forward=None) -> tuple[list[int], float]:
    """The floor for any engine: the SLM's forward with its KV cache and argmax, nothing else. Returns the
    tokens and tokens/s.
    `static`: a preallocated StaticCache (what torch.compile needs for fixed shapes); `forward`: the
    model's forward to call (e.g. a compiled one)."""
    from transformers import StaticCache

    forward = forward or model
    cache = StaticCache(config=model.config, max_cache_len=len(prompt_ids) + n_tokens + 1) if static else \
        DynamicCache(config=model.config)
    start = time.perf_counter()  # like the engine's timings: the prompt's prefill included
    ids = torch.tensor([prompt_ids], device=model.device)
    position = torch.arange(len(prompt_ids), device=model.device)
    tokens = []
    for step in range(n_tokens):
        # The cache by position: transformers 5 renamed its keyword (past_key_values, then cache).
        logits = (forward if step else model)(ids, None, None, cache, use_cache=True, cache_position=position,
                                              logits_to_keep=1).logits
        ids, position = logits[:, -1].argmax(-1, keepdim=True), position[-1:] + 1
        tokens.append(ids)
    tokens = torch.cat(tokens, dim=1)[0].tolist()  # waits for the device
    return tokens, n_tokens / (time.perf_counter() - start)


def phase(results: list[tuple[int, int]], seconds: float) -> dict:
    """Aggregate throughput of (tokens, LLM tokens) per request over `seconds` of wall time."""
    tokens = sum(r[0] for r in results)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "llm_rate": sum(r[1] for r in results) / max(tokens, 1)}


def overhead(slm: str | None, device: str, dtype: str, n_tokens: int, rounds: int, compile: bool = False,
             progress=QUIET) -> dict:
    """The engine (always-SLM policy) against a bare forward loop on the same prompt, and the bare loop
    on a static KV cache; with `compile`, also that with the forward compiled by torch.compile. On torch:
    the bare loops drive the transformers model itself."""
    slm_backend, tokenizer = load_model(slm, "slm", device, dtype, backend="torch")
    engine = systems.alone(slm_backend, tokenizer, "slm")
    prompt_ids = engine.prompts.chat(BENCH_PROMPT)
    params = SamplingParams(max_new_tokens=n_tokens, ignore_eos=True)
    model = slm_backend.model

    def engine_loop():
        gen = engine.generate([prompt_ids], params)[0]
        return len(gen.token_ids) / gen.timings.total_s

    loops = {"bare": lambda: bare_loop(model, prompt_ids, n_tokens)[1], "engine": engine_loop,
             "static": lambda: bare_loop(model, prompt_ids, n_tokens, static=True)[1]}
    compile_s = None
    if compile:
        compiled = torch.compile(model.forward, dynamic=False)
        started = time.perf_counter()
        # compiles for these shapes (minutes on a CPU)
        bare_loop(model, prompt_ids, n_tokens, static=True, forward=compiled)
        compile_s = time.perf_counter() - started
        loops["static_compiled"] = lambda: bare_loop(model, prompt_ids, n_tokens, static=True, forward=compiled)[1]
    bare_loop(model, prompt_ids, 8)  # warm-up
    runs = {name: [] for name in loops}
    task = progress.add_task("overhead", total=rounds * len(loops))
    for _ in range(rounds):  # alternate, so drift in machine speed hits all alike
        for name, loop in loops.items():
            runs[name].append(loop())
            progress.advance(task)
    medians = {name: statistics.median(r) for name, r in runs.items()}
    return {"tokens": n_tokens, "rounds": rounds, "device": str(slm_backend.device), "dtype": dtype,
            "kernels": kernels(slm=slm_backend), "runs": runs, "tokens_per_s": medians, "compile_s": compile_s,
            "ratio": medians["engine"] / medians["bare"],
            "vs_bare": {name: m / medians["bare"] for name, m in medians.items()}}


def batching(slm: str | None, llm: str | None, device: str, dtype: str, threshold: float, batch_size: int,
             n_tokens: int, backend: str = "auto") -> dict:
    """R2R (entropy routing) on `batch_size` GSM8K dev prompts: one at a time vs all in one batch."""
    slm_backend, llm_backend, tokenizer = load_pair(slm, llm, device, dtype=dtype, backend=backend)
    engine = systems.routed(slm_backend, llm_backend, tokenizer, "entropy", threshold)
    prompts = [engine.prompts.chat(gsm8k_prompt(item)) for item in gsm8k()[:batch_size]]
    params = SamplingParams(max_new_tokens=n_tokens)
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=4))  # warm-up
    start = time.perf_counter()
    one_by_one = [engine.generate([p], params)[0] for p in prompts]
    sequential_s = time.perf_counter() - start
    start = time.perf_counter()
    batched = engine.generate(prompts, params)
    batched_s = time.perf_counter() - start

    seq = phase([(len(g.token_ids), g.llm_tokens) for g in one_by_one], sequential_s)
    bat = phase([(len(g.token_ids), g.llm_tokens) for g in batched], batched_s)
    return {"batch_size": batch_size, "dtype": dtype, "backend": backend, "device": str(slm_backend.device),
            "kernels": kernels(slm=slm_backend, llm=llm_backend), "threshold": threshold, "sequential": seq,
            "batched": bat, "speedup": bat["tokens_per_s"] / seq["tokens_per_s"]}


def step_costs(slm: str | None, llm: str | None, device: str, dtype: str, context: int, new_tokens: list[int],
               backend: str = "auto", progress=QUIET, rows: tuple[int, ...] = (1,)) -> dict:
    """Milliseconds of one forward step per model, for k new tokens on top of a `context`-token cache, over one row
    (`ms`: the numbers behind the README's cost model, an SLM step and an LLM catch-up over k tokens) and over each
    larger number of `rows` (`batched_ms`: a batch's step, and a grouped LLM call's read of several rows' columns)."""
    slm_backend, llm_backend, _ = load_pair(slm, llm, device, dtype=dtype, backend=backend)
    by_role = (("slm", slm_backend), ("llm", llm_backend))
    batched = sorted({r for r in rows if r > 1})
    for role, b in by_role:
        if batched and b.max_rows is not None and batched[-1] > b.max_rows:
            raise R2RError(f"--rows {batched[-1]} is more than the {role.upper()}'s backend holds ({b.max_rows} rows)")
    task = progress.add_task("steps", total=2 * len(new_tokens) * (1 + len(batched)))

    def table(n: int) -> dict:
        def timed(b, k):
            ms = step_ms(b, context, k, rows=n)
            progress.advance(task)
            return ms

        return {role: {k: timed(b, k) for k in new_tokens} for role, b in by_role}

    result = {"dtype": dtype, "backend": backend, "device": str(slm_backend.device),
              "kernels": kernels(slm=slm_backend, llm=llm_backend), "context": context, "ms": table(1)}
    if batched:
        result["batched_ms"] = {n: table(n) for n in batched}
    return result


def remote(llm_url: str, backend: str, dtype: str, context: int, new_tokens: list[int], n_prompts: int,
           n_tokens: int, router_path=None, progress=QUIET) -> dict:
    """The LLM on a server (`llm_url`) against the same LLM here (`backend`), in one run: one catch-up of k
    new tokens on a `context`-token prefix the server has cached and on one it has never seen, and R2R's
    tokens/s on the same GSM8K dev prompts with either LLM (same SLM, same router)."""
    slm_b, local_llm, tokenizer = load_pair(None, None, "cpu", dtype=dtype, backend=backend)
    llms = {"local": local_llm, "remote": RemoteBackend(llm_url, tokenizer, slm_b.eos_ids, vocab_size=slm_b.vocab_size)}
    task = progress.add_task("bench remote", total=2 * len(new_tokens) * 2 + 4)
    catch_up = {}
    for where, llm in llms.items():
        catch_up[where] = {}
        for k in new_tokens:
            catch_up[where][k] = {"cached_ms": step_ms(llm, context, k), "cold_ms": cold_ms(llm, context + k)}
            progress.advance(task, 2)
    kind, router = models.choose_policy(None, router_path, None)
    prompts = [systems.alone(slm_b, tokenizer, "slm").prompts.chat(gsm8k_prompt(item)) for item in gsm8k()[:n_prompts]]
    params = SamplingParams(max_new_tokens=n_tokens)
    figures, outputs = {}, {}
    for where, llm in llms.items():
        for name, engine in ((f"LLM alone ({where})", systems.alone(llm, tokenizer, "llm")),
                             (f"R2R ({where})", systems.routed(slm_b, llm, tokenizer, kind, None, router))):
            engine.generate(prompts[:1], SamplingParams(max_new_tokens=4))  # warm-up
            start = time.perf_counter()
            gens = [engine.generate([p], params)[0] for p in prompts]
            seconds = time.perf_counter() - start
            tokens = sum(len(g.token_ids) for g in gens)
            figures[name] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                             "llm_rate": sum(g.llm_tokens for g in gens) / tokens}
            outputs[name] = [g.token_ids for g in gens]
            progress.advance(task)
    same = {system: sum(a == b for a, b in zip(outputs[f"{system} (local)"], outputs[f"{system} (remote)"]))
            for system in ("LLM alone", "R2R")}
    return {"llm_url": llm_url, "remote": llms["remote"].name, "backend": backend, "dtype": dtype,
            "kernels": kernels(slm=slm_b, **{f"llm ({name})": llm for name, llm in llms.items()}), "context": context,
            "catch_up": catch_up, "prompts": n_prompts, "max_new_tokens": n_tokens, "systems": figures,
            "same_output": same}


@torch.inference_mode()
def cold_ms(backend, n: int, repeats: int = 3) -> float:
    """Median milliseconds of one forward over n tokens nobody has read before (random ids, a fresh cache)."""
    times = []
    for _ in range(repeats):
        ids = torch.randint(0, min(1000, backend.vocab_size), (1, n), device=backend.device)
        start = time.perf_counter()
        backend.forward(backend.new_cache(), ids, torch.ones_like(ids))
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def backend_agreement(n_prompts: int, n_tokens: int, router_path, entropy_threshold: float, dtype: str,
                      progress=QUIET) -> dict:
    """Does one router serve both backends? The SLM on torch and on llama.cpp reads the same GSM8K
    dev answers (written by the SLM on llama.cpp); at every answer position compare their last hidden
    states, their argmax, and the routing decisions the entropy policy and the router take on each."""
    import torch.nn.functional as F

    router_path = models.router_path_for(router_path, None)
    slms = {name: load_model(None, "slm", "cpu", dtype, name) for name in ("torch", "llamacpp")}
    tokenizer = slms["torch"][1]
    writer = systems.alone(slms["llamacpp"][0], tokenizer, "slm")
    routers = {name: policies.build("router", b, None, router_path) for name, (b, _) in slms.items()} \
        if router_path else {}
    task = progress.add_task("backends", total=n_prompts)
    found = {name: {"hidden": [], "argmax": [], "entropy": [], "router": []} for name in slms}
    for item in gsm8k()[:n_prompts]:
        prompt = writer.prompts.chat(gsm8k_prompt(item))
        answer = writer.generate([prompt], SamplingParams(max_new_tokens=n_tokens))[0].token_ids
        ids = prompt + answer
        for name, (slm, _) in slms.items():
            # the positions that propose answer tokens
            logits, hidden = slm.forward_sequence(ids[:-1], start=len(prompt) - 1)
            logits, hidden = logits.float().cpu(), hidden.float().cpu()
            argmax = logits.argmax(-1)
            f = found[name]
            f["hidden"].append(hidden)
            f["argmax"].append(argmax)
            f["entropy"].append(entropy(logits))
            if name in routers:
                f["router"].append(routers[name].route(logits.to(slm.device), hidden.to(slm.device),
                                                       argmax.to(slm.device))[1].float().cpu())
        progress.advance(task)
    t, lc = ({k: torch.cat(v) if v else None for k, v in found[name].items()} for name in ("torch", "llamacpp"))
    cosine = F.cosine_similarity(t["hidden"], lc["hidden"], dim=-1)
    result = {"prompts": n_prompts, "positions": len(cosine), "dtype": dtype,
              "kernels": kernels(**{f"slm ({name})": b for name, (b, _) in slms.items()}),
              "hidden_cosine_mean": cosine.mean().item(), "hidden_cosine_min": cosine.min().item(),
              "argmax_agreement": (t["argmax"] == lc["argmax"]).float().mean().item(),
              "entropy_threshold": entropy_threshold,
              "entropy_decision_agreement": ((t["entropy"] >= entropy_threshold) ==
                                             (lc["entropy"] >= entropy_threshold)).float().mean().item()}
    if routers:
        threshold = routers["torch"].threshold
        gap = (t["router"] - lc["router"]).abs()
        result |= {"router": str(router_path), "router_threshold": threshold,
                   "router_decision_agreement":
                       ((t["router"] >= threshold) == (lc["router"] >= threshold)).float().mean().item(),
                   "router_score_gap_mean": gap.mean().item(), "router_score_gap_max": gap.max().item()}
    return result


@torch.inference_mode()
def speculative_torch(draft_model, target_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' assisted generation (greedy, lossless): the reference speculative decoder."""
    ids = torch.tensor([prompt_ids], device=target_model.device)
    out = target_model.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft_model,
                                do_sample=False, max_new_tokens=max_new_tokens)
    return out[0, len(prompt_ids):].tolist()


def compare(n_prompts: int, n_tokens: int, dtype: str, router_path, threshold: float | None, spec_k: list[int],
            entropy_threshold: float, progress=QUIET, verify: list = (), max_unverified: int | None = None,
            backends: tuple[str, ...] = ("torch", "llamacpp")) -> dict:
    """Every way to get answers from the pair on the same GSM8K dev prompts, one prompt at a time, on each
    backend: each model alone, R2R, R2R with each verification setting, and speculative decoding (this
    engine: the SLM drafts k tokens, the LLM checks them strictly); transformers' assisted generation as
    an outside anchor."""
    router_path = models.router_path_for(router_path, None)
    pairs = {name: load_pair(None, None, "cpu", dtype=dtype, backend=name) for name in backends}
    first_slm, _, tokenizer = next(iter(pairs.values()))
    prompts = [systems.alone(first_slm, tokenizer, "slm").prompts.chat(gsm8k_prompt(item))
               for item in gsm8k()[:n_prompts]]
    params = SamplingParams(max_new_tokens=n_tokens)

    def r2r(slm_b, llm_b, verify_with="off", n=None):
        if router_path is None:
            return systems.routed(slm_b, llm_b, tokenizer, "entropy",
                                  threshold if threshold is not None else entropy_threshold, verify=verify_with,
                                  max_unverified=n)
        return systems.routed(slm_b, llm_b, tokenizer, "router", threshold, router_path, verify=verify_with,
                              max_unverified=n)

    engines = {}
    for name, (slm_b, llm_b, _) in pairs.items():
        engines[f"LLM alone ({name})"] = systems.alone(llm_b, tokenizer, "llm")
        engines[f"SLM alone ({name})"] = systems.alone(slm_b, tokenizer, "slm")
        engines[f"R2R ({name})"] = r2r(slm_b, llm_b)
        for v in verify:
            label = f"R2R verify={v.value}{f' n={max_unverified}' if max_unverified else ''} ({name})"
            engines[label] = r2r(slm_b, llm_b, v, max_unverified)
        for k in spec_k:
            engines[f"speculative k={k} ({name})"] = systems.System("spec", "spec", k).engine(slm_b, llm_b, tokenizer)
    results = {}
    task = progress.add_task("bench", total=len(engines) + ("torch" in pairs))
    for name, engine in engines.items():
        results[name] = one_at_a_time(engine, prompts, params)
        progress.advance(task)
    if "torch" in pairs:
        results["speculative (transformers assisted)"] = assisted_generation(pairs["torch"], prompts, n_tokens)
        progress.advance(task)
    prompt = round(statistics.mean(len(p) for p in prompts))
    for name, (slm_b, llm_b, _) in pairs.items():
        r = results[f"R2R ({name})"]
        r["cost_model"] = cost_model_figures(slm_b, llm_b, r, prompt, int(prompt + n_tokens / 2), len(prompts))
    fastest_llm = max((f"LLM alone ({name})" for name in pairs), key=lambda n: results[n]["tokens_per_s"])
    for r in results.values():
        r["vs_fastest_llm"] = r["tokens_per_s"] / results[fastest_llm]["tokens_per_s"]
    return {"prompts": n_prompts, "max_new_tokens": n_tokens, "dtype": dtype, "router": str(router_path or "entropy"),
            "kernels": kernels(**{f"{role} ({name})": b for name, pair in pairs.items()
                                  for role, b in zip(("slm", "llm"), pair[:2])}),
            "baseline": fastest_llm, "systems": results}


def one_at_a_time(engine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """One system's figures over the prompts, answered one at a time after a warm-up."""
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=4))  # warm-up
    totals, start = Totals(), time.perf_counter()
    for p in prompts:
        totals.add(engine.generate([p], params)[0])
    seconds, tokens, timed = time.perf_counter() - start, totals.tokens, totals.timings
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "llm_rate": totals.llm_tokens / tokens if engine.routes else None,
            "rollbacks": totals.rollbacks, "llm_calls": timed.llm_calls,
            "router_ms": 1000 * timed.router_s / max(timed.steps, 1),
            # What the steps cost inside the run (the first of each includes the prompt):
            "slm_ms_per_step": 1000 * timed.slm_s / max(timed.steps, 1),
            "llm_ms_per_call": 1000 * timed.llm_s / timed.llm_calls if timed.llm_calls else None}


def assisted_generation(pair, prompts: list[list[int]], n_tokens: int) -> dict:
    """transformers' assisted generation on the torch pair, as an outside anchor."""
    slm_t, llm_t = pair[0], pair[1]
    speculative_torch(slm_t.model, llm_t.model, prompts[0][:32], 4)  # warm-up
    tokens, start = 0, time.perf_counter()
    for p in prompts:
        tokens += len(speculative_torch(slm_t.model, llm_t.model, p, n_tokens))
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "llm_rate": None}


def cost_model_figures(slm_b, llm_b, r: dict, prompt: int, context: int, n_prompts: int) -> dict:
    """The cost model (README, "What bounds the speed") from per-step costs measured now, at this run's context
    length: per request, both prompts' prefill, then per token t_SLM(1) + t_router + c * t_LLM(1/c), where
    c = LLM calls per generated token (a call reads the 1/c tokens since the last one)."""
    calls_per_token = r["llm_calls"] / r["tokens"]
    catch_up = max(1, round(1 / calls_per_token)) if calls_per_token else 1
    m = {"prompt_tokens": prompt, "context": context, "t_slm_prompt_ms": step_ms(slm_b, 0, prompt),
         "t_llm_prompt_ms": step_ms(llm_b, 0, prompt), "t_slm_ms": step_ms(slm_b, context, 1),
         "t_router_ms": r["router_ms"], "catch_up_tokens": catch_up,
         "t_llm_catch_up_ms": step_ms(llm_b, context, catch_up), "llm_calls_per_token": calls_per_token}
    per_token_ms = m["t_slm_ms"] + m["t_router_ms"] + calls_per_token * m["t_llm_catch_up_ms"]
    predicted_ms = n_prompts * (m["t_slm_prompt_ms"] + m["t_llm_prompt_ms"]) + r["tokens"] * per_token_ms
    m["predicted_tokens_per_s"] = 1000 * r["tokens"] / predicted_ms
    return m


@torch.inference_mode()
def synchronize(backend) -> None:
    """Wait for the device's queued work: a timer read on the host otherwise stops before a GPU has finished."""
    if backend.device.type == "cuda":
        torch.cuda.synchronize()


def step_ms(backend, context: int, k: int, repeats: int = 5, rows: int = 1) -> float:
    """Median milliseconds of one forward over k new tokens on top of a `context`-token cache, for `rows` rows."""
    cache = backend.new_cache()
    ids = torch.randint(0, min(1000, backend.vocab_size), (rows, context + k), device=backend.device)
    mask = torch.ones_like(ids)
    if context:
        backend.forward(cache, ids[:, :context], mask)
    times = []
    for _ in range(repeats):
        # New tokens each time: a server's prefix cache would otherwise hold them from the last repeat.
        ids[:, context:] = torch.randint(0, min(1000, backend.vocab_size), (rows, k), device=backend.device)
        start = time.perf_counter()
        backend.forward(cache, ids[:, context:], mask)
        synchronize(backend)
        times.append((time.perf_counter() - start) * 1000)
        backend.truncate(cache, context)
    return statistics.median(times)
