"""Where R2R pays: the default SLM with LLMs of real sizes, measured.

Speed does not depend on weight values. A model built from a published configuration with random
weights, quantized as the shipped files are (Q4_K_M), runs at that model's speed on the same kernels.
What random weights cannot give (which tokens the router sends, which drafts the LLM accepts) is set
by a fixed routing share (the `random` policy), or taken from the real pair's statistics measured in
the same run and carried over through the cost model:

    time per output token = SLM steps x t_SLM(1) + LLM catch-ups x t_LLM(tokens read per catch-up)

with t(k) the measured cost of one forward over k new tokens (interpolated between measured k).
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from roads_to_rome.backends.torch_backend import TorchBackend
from roads_to_rome.bench.cost_model import batch_widths, real_acceptance
from roads_to_rome.bench.measure import processor, step_ms, synchronize
from roads_to_rome.bench.shape_models import (
    DEFAULT_SHARES,
    STEP_TOKENS,
    LlmShape,
    build_shape,
    default_tokenizer,
    llm_backend,
    random_router,
    torch_shape,
)
from roads_to_rome.bench.shapes_report import WARM_RUNS, overlapped_systems, summarize, system_name
from roads_to_rome.bench.stand_ins import AgreesAtRate, Proposals, Recorded, RouterAtShare
from roads_to_rome.core.engine import Engine
from roads_to_rome.core.llm_calls import Deferral
from roads_to_rome.core.request import Totals
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.data.benchmarks import gsm8k, gsm8k_prompt
from roads_to_rome.errors import R2RError
from roads_to_rome.models import (
    DEFAULT_LLM,
    gguf_path,
    load_model,
    pick_device,
    router_path_for,
    systems,
)
from roads_to_rome.progress import QUIET
from roads_to_rome.routing import policies


def run_system(engine: Engine, prompts: list[list[int]], tokens: int, progress=QUIET, label: str = "",
               batch: int = 1) -> dict:
    """`batch` prompts at a time, `tokens` new tokens each (EOS ignored), prompt reading included: tokens/s, the
    LLM's share, verification's rollbacks, and every forward each model made (new tokens per call, at batch 1),
    for the cost model. On CUDA the first steps of a read size record its graph (and compile the trunk): a run
    that recorded any is run again, up to WARM_RUNS times in all, and `recorded_while_timed` says what the last one
    still recorded."""
    slm, llm = engine.slm, engine.llm
    if engine.writer.device.type == "cuda":  # the first steps capture CUDA graphs and load kernels: not timed
        engine.generate([prompts[0][:16]] * batch, SamplingParams(max_new_tokens=4, ignore_eos=True))
    for run in range(1, WARM_RUNS + 1):
        before = recorded_graphs(slm, llm)
        totals = timed_run(engine, prompts, tokens, progress, label if run == 1 else f"{label} (again)", batch)
        recorded = recorded_graphs(slm, llm) - before
        if not recorded:
            break
    return totals | {"runs": run, "recorded_while_timed": recorded}


def recorded_graphs(*models) -> int:
    return sum(getattr(model, "captures", 0) for model in models if model is not None)


def timed_run(engine: Engine, prompts: list[list[int]], tokens: int, progress, label: str, batch: int) -> dict:
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    task = progress.add_task(label, total=len(prompts) * tokens)
    slm, llm = engine.slm, engine.llm
    counts, wall_s, calls = Totals(), 0.0, {"slm_calls": [], "llm_calls": []}
    counted = dataclasses.replace(engine.counters)
    phases = dict.fromkeys(("slm_s", "router_s", "llm_s", "step_s"), 0.0)  # where the decode steps' time went
    for first in range(0, len(prompts), batch):
        for model in (slm, llm):
            if isinstance(model, Recorded):
                model.calls = []
        start, results = time.perf_counter(), []
        for steps in engine.stream(prompts[first: first + batch], params, results):
            progress.advance(task, len(steps))
        engine.sync()
        wall_s += time.perf_counter() - start
        for key, seconds in zip(phases, (results[0].timings.slm_s, results[0].timings.router_s,
                                         results[0].timings.llm_s, results[0].timings.total_s)):
            phases[key] += seconds  # (a batched step counts once: the first row's share of it)
        for gen in results:
            counts.add(gen)
        for role, model in (("slm", slm), ("llm", llm)):
            if isinstance(model, Recorded) and batch == 1:
                calls[f"{role}_calls"].append(model.calls)
    totals = {"tokens": counts.tokens, "seconds": wall_s, "llm_tokens": counts.llm_tokens,
              "rollbacks": counts.rollbacks, "discarded": counts.discarded, **calls, "batch": batch,
              **{key: getattr(counts, key) for key in ("deferred", "deferred_kept", "deferred_replaced",
                                                       "deferred_discarded")}}
    per100 = 100 / max(totals["tokens"], 1)
    totals |= {"tokens_per_s": totals["tokens"] / totals["seconds"],
               "llm_share": totals["llm_tokens"] / max(totals["tokens"], 1),
               "rollbacks_per_100": totals["rollbacks"] * per100, "discarded_per_100": totals["discarded"] * per100,
               "llm_calls_total": (engine.counters - counted).llm_calls,
               "routed_rows_per_call": (engine.counters - counted).routed_rows_per_call,
               "deferred_accept": totals["deferred_kept"]
               / max(totals["deferred_kept"] + totals["deferred_replaced"], 1),
               "deferred_discarded_per_100": totals["deferred_discarded"] * per100,
               "phases": phases}
    return totals


ASSISTED_TOKENS = 64  # enough rounds to time one; a round's cost does not depend on how many follow


def assisted_run(slm: TorchBackend, llm: TorchBackend, prompt: list[int], tokens: int, k: int, tokenizer=None) -> dict:
    """transformers' assisted generation (speculative decoding with `k` drafts a round, greedy) of the same pair:
    what one round costs. Random weights accept almost no draft, so tokens/s at a real pair's acceptance comes
    from this cost and that pair's tokens per round (in the summary).

    Pairs whose embeddings differ in rows (the padded 152,064 beside 151,936) are different tokenizers to
    transformers: given `tokenizer`, it runs its universal assisted decoding (the drafts go through text each
    round), what a user of these published pairs gets; without, the SLM's configuration is made to claim the LLM's
    row count for the call and the LLM's padding rows are suppressed, so the plain path runs (greedy compares
    drafts by token id only)."""
    rounds = []
    slm_config, llm_rows = slm.model.config.get_text_config(), llm.model.config.get_text_config().vocab_size
    own_rows = slm_config.vocab_size
    universal = tokenizer is not None and own_rows != llm_rows
    hook = llm.model.register_forward_hook(lambda *_: rounds.append(1))
    kwargs = dict(do_sample=False, assistant_model=slm.model, num_assistant_tokens=k,
                  num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0, pad_token_id=0)
    if universal:
        kwargs |= {"tokenizer": tokenizer, "assistant_tokenizer": tokenizer}
    elif own_rows != llm_rows:  # and the LLM never picks a padding row the SLM has no embedding for
        slm_config.vocab_size = llm_rows
        kwargs["suppress_tokens"] = list(range(own_rows, llm_rows))
    try:
        ids = torch.tensor([prompt], device=llm.device)
        llm.model.generate(ids[:, :16], max_new_tokens=8, min_new_tokens=8, **kwargs)  # warm-up
        rounds.clear()
        synchronize(llm)
        start = time.perf_counter()
        out = llm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                 min_new_tokens=tokens, **kwargs)
        synchronize(llm)
        seconds = time.perf_counter() - start
    except Exception as e:  # a transformers version that refuses these settings: say so in the results
        return {"k": k, "universal": universal,
                "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"}
    finally:
        hook.remove()
        slm_config.vocab_size = own_rows
    made = out.shape[1] - len(prompt)
    return {"k": k, "universal": universal, "tokens": made, "seconds": seconds, "rounds": len(rounds),
            "tokens_per_s": made / seconds, "round_ms": 1000 * seconds / max(len(rounds), 1)}


def step_table(backend, context: int, step_tokens: list[int], prompts: list[int], rows: int = 1) -> dict[int, float]:
    """Milliseconds of a forward over k new tokens on a `context`-token cache, for each k asked and for each
    prompt's length on an empty cache (what reading the prompt costs), for `rows` rows."""
    table = {k: step_ms(backend, context, k, repeats=3, rows=rows) for k in step_tokens}
    for p in sorted(set(prompts)):
        table.setdefault(p, step_ms(backend, 0, p, repeats=1, rows=rows))
    return table


def unmeasured_batches(plan: Plan, store: dict, max_rows: int | None) -> list[int]:
    """The batch sizes above 1 whose step tables (for the batched runs' cost model) `store` lacks, where a backend
    holding `max_rows` rows (None: any) can run them."""
    return [b for b in plan.batches if b > 1 and (max_rows is None or b <= max_rows) and str(b) not in store]


@dataclass(frozen=True)
class Plan:
    """What one `r2r bench shapes` run measures."""

    shapes: tuple[LlmShape, ...]
    shares: tuple[float, ...] = DEFAULT_SHARES
    prompts: int = 4  # GSM8K items 0..prompts-1 at batch 1 (at batch b, the first multiple of b at least this)
    tokens: int = 256
    context: int = 300
    step_tokens: tuple[int, ...] = STEP_TOKENS
    verify: tuple = ()
    spec_k: tuple[int, ...] = ()
    backend: str = "llamacpp"
    device: str = "auto"
    slm_shape: LlmShape | None = None  # None: the default pair's SLM as shipped (and its router)
    batches: tuple[int, ...] = (1,)
    real_from: str | None = None  # a results file whose real-pair runs stand in for this run's (random SLM)
    cuda_graphs: bool = True  # on CUDA, reads of up to 64 tokens as CUDA graphs (off: transformers' eager forwards)
    compile: tuple[str, ...] = ("slm",)  # the roles whose CUDA graphs record their trunk compiled by torch.compile
    defer: tuple[str, ...] = ()  # deferral modes run beside lockstep R2R at each batch above 1
    deferral: Deferral = Deferral()  # their grouping rule (its mode is each of `defer` in turn)
    overlap: tuple[int, ...] = ()  # batches at which R2R also runs with the LLM's calls beside the SLM's steps

    def config(self) -> dict:
        """What a resumed run must share with the saved one (keys only where not the default, so files of earlier
        runs resume)."""
        config = {"prompts": self.prompts, "tokens": self.tokens, "context": self.context,
                  "step_tokens": list(self.step_tokens), "backend": self.backend, "device": self.device,
                  "verify": [str(v.value) for v in self.verify], "spec_k": list(self.spec_k)}
        if self.slm_shape:
            config["slm_shape"] = self.slm_shape.name
        if self.batches != (1,):
            config["batches"] = list(self.batches)
        if not self.cuda_graphs:
            config["cuda_graphs"] = False
        if self.compile != ("slm",):
            config["compile"] = list(self.compile)
        if self.deferred_batches:
            config |= {"defer": list(self.defer), "defer_group": self.deferral.group,
                       "defer_steps": self.deferral.steps}
        if self.overlap:
            config |= {"overlap": list(self.overlap), "overlap_ahead": self.deferral.ahead}
        return config

    @property
    def deferred_batches(self) -> list[int]:
        """The batches deferral runs at (a batch of one never defers)."""
        return [b for b in self.batches if b > 1] if self.defer else []

    def rule(self, mode: str) -> Deferral:
        return dataclasses.replace(self.deferral, mode=mode)

    def prompts_at(self, batch: int) -> int:
        return -(-self.prompts // batch) * batch


def assisted_key(k: int, universal: bool) -> str:
    return f"k={k}" + (" universal" if universal else "")


def measure(plan: Plan, saved: dict | None, save, progress=QUIET, build_only: bool = False) -> dict:
    """Everything `r2r bench shapes` prints, resuming from `saved` (what an earlier run of the same settings on
    this processor measured); `save(result)` is called after each measurement."""
    run = Measurement(plan, resumed(plan, saved), save, progress)
    if build_only:
        for shape in plan.shapes:
            record_build(run.result["shapes"].setdefault(shape.name, {}), build_shape(shape, run.template, progress))
            save(run.result)
        return run.result
    run.measure_slm()
    for shape in plan.shapes:
        run.measure_shape(shape)
    return summarize(run.result, list(plan.shares))


def resumed(plan: Plan, saved: dict | None) -> dict:
    """The result to add to: `saved` where it holds a run of the same settings on this processor, else a fresh one."""
    config, here = plan.config(), processor()
    gpu = torch.cuda.get_device_name() if pick_device(plan.device) == "cuda" else None
    saved_on = saved and (saved.get("device_name") or saved.get("processor"))
    if saved and (saved.get("config") != config or saved_on != (gpu or here)):
        raise R2RError("the results file holds a run with other settings or from another processor "
                       f"({saved.get('device_name') or saved.get('processor')}): give another --out, or the same "
                       "settings")
    result = saved or {"config": config, "processor": here, "real": {}, "shapes": {}}
    if gpu:  # on a GPU the figures are the GPU's (the host it sits in may differ between runs)
        result["device_name"] = gpu
    return result


class Measurement:
    """One `r2r bench shapes` run: the SLM (the default pair's, or one of a shape, with the shipped or a random
    router) and its prompts, then each LLM shape alone, with R2R at each share and deferral mode, and assisted
    generation; each figure saved as soon as it is measured."""

    def __init__(self, plan: Plan, result: dict, save, progress):
        self.plan, self.result, self.save, self.progress = plan, result, save, progress
        rows = max(2, *plan.batches)
        self.llama = {"n_ctx": max(4096, 1024 * rows), "max_rows": rows}
        self.template = gguf_path(DEFAULT_LLM)
        if plan.backend == "llamacpp" and not self.template.exists():
            raise R2RError(f"the default pair is not prepared ({self.template} is missing): run `r2r models prepare`")

    def load_slm(self) -> None:
        plan = self.plan
        if plan.slm_shape is None:
            slm, self.tokenizer = load_model(None, "slm", plan.device, backend=plan.backend, llama=self.llama,
                                             compile="slm" in plan.compile)
            self.router = policies.build("router", slm, None, router_path_for(None, None))
        else:
            self.tokenizer = default_tokenizer()
            slm = TorchBackend(torch_shape(plan.slm_shape, pick_device(plan.device)), name=plan.slm_shape.name,
                               vocab_size=len(self.tokenizer), graphs=plan.cuda_graphs, compile="slm" in plan.compile)
            self.router = random_router(slm)
        self.slm = Recorded(slm)
        self.result.setdefault("kernels", {})["slm"] = self.slm.kernels
        self.slm_engine = systems.alone(self.slm, self.tokenizer, "slm")
        count = max(plan.prompts_at(b) for b in plan.batches)
        self.prompts = [self.slm_engine.prompts.chat(gsm8k_prompt(item)) for item in gsm8k()[:count]]
        self.lengths = self.result["prompt_tokens"] = [len(p) for p in self.prompts[: plan.prompts]]
        self.widths = {str(b): batch_widths([len(p) for p in self.prompts[: plan.prompts_at(b)]], b)
                       for b in plan.batches}
        self.result["batch_prompt_widths"] = self.widths

    def batched_steps(self, store: dict, model) -> None:
        """Step tables with each batch's rows, for the batched runs' cost model."""
        plan = self.plan
        for b in unmeasured_batches(plan, store, model.max_rows):
            store[str(b)] = step_table(model.inner, plan.context, plan.step_tokens, self.widths[str(b)], rows=b)
            self.save(self.result)

    def runs(self, engine, name: str, label: str, measured: dict, batches=None) -> None:
        plan = self.plan
        for batch in plan.batches if batches is None else batches:
            key = system_name(name, batch)
            if key not in measured:
                measured[key] = run_system(engine, self.prompts[: plan.prompts_at(batch)], plan.tokens,
                                           self.progress, f"{label}: {key}", batch)
                self.save(self.result)

    def measure_slm(self) -> None:
        self.load_slm()
        plan, result = self.plan, self.result
        if plan.slm_shape is None:
            measure_real_pair(plan, result, self.slm, self.slm_engine, self.router, self.tokenizer, self.prompts,
                              self.lengths, self.llama, self.save, self.progress)
        else:
            own = result.setdefault("slm", {"name": plan.slm_shape.name, "params_b": plan.slm_shape.params / 1e9})
            if "steps" not in own:
                own["steps"] = step_table(self.slm.inner, plan.context, plan.step_tokens, self.lengths)
                self.save(result)
            self.runs(self.slm_engine, "slm", plan.slm_shape.name, own.setdefault("systems", {}))
            if plan.real_from and not result["real"]:
                real = json.loads(Path(plan.real_from).read_text()).get("real", {})
                result["real"] = {"from": plan.real_from, "systems": real.get("systems", {})}
                self.save(result)
        self.batched_steps(result.setdefault("slm_batched_steps", {}), self.slm)

    def to_do(self, shape, entry: dict) -> tuple[list[str], list[tuple[int, bool]]]:
        """A shape's systems and assisted runs not yet measured."""
        plan = self.plan
        todo = [system_name(n, b) for n in ["llm"] + [f"r2r@{share:g}" for share in plan.shares] for b in plan.batches]
        todo += [system_name(f"r2r@{share:g}+{mode}", b) for share in plan.shares for mode in plan.defer
                 for b in plan.deferred_batches]
        todo += [system_name(name, b) for b in plan.overlap
                 for name, _, _ in overlapped_systems(plan.shares, plan.defer, b)]
        # transformers' universal path only where the rows differ (else it refuses the tokenizers)
        slm_rows = self.slm.inner.model.config.get_text_config().vocab_size if plan.backend == "torch" else None
        modes = () if slm_rows is None else (False, True) if shape.vocab_rows != slm_rows else (False,)
        assisted = [(k, universal) for k in plan.spec_k for universal in modes
                    if assisted_key(k, universal) not in entry.get("assisted", {})]
        return [name for name in todo if name not in entry.get("systems", {})], assisted

    def measure_shape(self, shape) -> None:
        plan, result = self.plan, self.result
        entry = result["shapes"].setdefault(shape.name, {})
        entry.setdefault("params_b", shape.params / 1e9)
        measured, batched = entry.setdefault("systems", {}), entry.setdefault("batched_steps", {})
        todo, assisted_todo = self.to_do(shape, entry)
        llm_rows = self.llama["max_rows"] if plan.backend == "llamacpp" else None
        if "steps" in entry and not todo and not assisted_todo and not unmeasured_batches(plan, batched, llm_rows):
            return
        llm, build = llm_backend(shape, self.tokenizer, plan.backend, plan.device, self.template, self.progress,
                                 plan.cuda_graphs, "llm" in plan.compile, self.llama)
        record_build(entry, build)
        llm = Recorded(llm)
        result["kernels"][f"llm ({shape.name})"] = llm.kernels
        if "steps" not in entry:
            entry["steps"] = step_table(llm.inner, plan.context, plan.step_tokens, self.lengths)
            self.save(result)
        self.batched_steps(batched, llm)
        self.runs(systems.alone(llm, self.tokenizer, "llm"), "llm", shape.name, measured)
        self.routed_runs(shape, llm, measured)
        for k, universal in assisted_todo:
            run = assisted_run(self.slm.inner, llm.inner, self.prompts[0], min(plan.tokens, ASSISTED_TOKENS), k,
                               self.tokenizer if universal else None)
            entry.setdefault("assisted", {})[assisted_key(k, universal)] = run
            self.save(result)
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def routed_runs(self, shape, llm, measured: dict) -> None:
        """R2R at each share of LLM tokens, in lockstep and in each deferral mode."""
        plan, slm, tokenizer = self.plan, self.slm, self.tokenizer
        accept = real_acceptance(self.result)
        for share in plan.shares:
            self.runs(systems.routed(slm, llm, tokenizer, RouterAtShare(self.router, share, seed=0)),
                      f"r2r@{share:g}", shape.name, measured)
            def agreeing(mode: str, overlap: bool = False) -> Engine:
                # Random weights agree with nothing: at a deferred routed position the LLM keeps the SLM's token
                # at the rate the real pair kept it in this run.
                proposals = Proposals(slm)
                return systems.routed(slm, AgreesAtRate(llm, accept, proposals=proposals), tokenizer,
                                      RouterAtShare(self.router, share, seed=0, proposals=proposals),
                                      defer=plan.rule(mode), overlap=overlap)

            for mode in plan.defer:
                self.runs(agreeing(mode), f"r2r@{share:g}+{mode}", shape.name, measured, plan.deferred_batches)
            for batch in plan.overlap:
                for name, _, mode in overlapped_systems([share], plan.defer, batch):
                    self.runs(agreeing(mode, overlap=True), name, shape.name, measured, [batch])


def measure_real_pair(plan: Plan, result: dict, slm, slm_engine, router, tokenizer, prompts, lengths, llama, save,
                      progress) -> None:
    """The default pair as shipped: its step costs and its runs (the SLM alone, the LLM alone, R2R with the router,
    verification, speculative decoding), whose forwards the cost model replays at each shape's step costs."""
    real = result["real"]
    real_llm = None  # the default pair's LLM, loaded once if anything on the real pair is left to measure

    def the_real_llm():
        nonlocal real_llm
        if real_llm is None:
            real_llm = Recorded(load_model(None, "llm", plan.device, backend=plan.backend, llama=llama)[0])
        return real_llm

    if "steps" not in real:
        real["steps"] = {"slm": step_table(slm.inner, plan.context, plan.step_tokens, lengths),
                         "llm": step_table(the_real_llm().inner, plan.context, plan.step_tokens, lengths)}
        save(result)
    measured = real.setdefault("systems", {})
    if plan.deferred_batches:  # how often the real LLM keeps the SLM's token at a deferred routed position
        batch = max(plan.deferred_batches)
        name = system_name("r2r+continue", batch)
        if name not in measured:
            engine = systems.routed(slm, the_real_llm(), tokenizer, router, defer=plan.rule("continue"))
            measured[name] = run_system(engine, prompts[: plan.prompts_at(batch)], plan.tokens, progress,
                                        f"{DEFAULT_LLM.name} (real): {name}", batch)
            save(result)
    prompts = prompts[: plan.prompts]
    real_runs = [("slm", None, "off", None), ("llm", None, "off", None), ("r2r", router, "off", None)]
    real_runs += [(f"r2r+verify={v.value}", router, v, None) for v in plan.verify]
    real_runs += [(f"spec+k={k}", "slm", "strict", k) for k in plan.spec_k]
    for name, policy, setting, k in real_runs:
        if name in measured:
            continue
        engine = (slm_engine if name == "slm" else systems.alone(the_real_llm(), tokenizer, "llm") if name == "llm"
                  else systems.routed(slm, the_real_llm(), tokenizer, policy, verify=setting, max_unverified=k))
        measured[name] = run_system(engine, prompts, plan.tokens, progress, f"{DEFAULT_LLM.name} (real): {name}")
        save(result)


def record_build(entry: dict, build: dict) -> None:
    """Keep how long the build took when it was built (a later run finds the file and took no time)."""
    if build.get("built_s") is not None or "build" not in entry:
        entry["build"] = build
