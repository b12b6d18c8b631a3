"""The server's Prometheus metrics (`GET /metrics`), named as vLLM names the same things, with an `r2r:` prefix.

Each app has a registry of its own, so several servers in one process (tests, benchmarks) do not share counts. The
engine thread records each request's steps as it delivers them (`Metrics.step`, `Metrics.failed`); the batch's
load and the engine's LLM calls are read when scraped."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from roads_to_rome.core.engine import Engine
from roads_to_rome.core.request import COUNTERS, Sequence, Step

SOURCES = ("slm", "llm", "fix")
# A request's `llm_calls`, summed, counts rows served by calls: the engine's own `r2r:llm_calls` counts the calls.
METRIC_NAMES = {"llm_calls": "llm_call_rows"}
# Seconds; a CPU's tokens are slower than a GPU's, so the buckets reach further than vLLM's.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class EngineCollector(Collector):
    """What is read from the engine and the scheduler at scrape time: rows running and waiting, the LLM's calls."""

    def __init__(self, engine: Engine, load: Callable[[], dict]):
        self.engine, self.load = engine, load

    def collect(self):
        load = self.load()
        yield GaugeMetricFamily("r2r:num_requests_running", "Requests in the batch (decoding or reading their "
                                "prompt).", value=load["running"])
        yield GaugeMetricFamily("r2r:num_requests_waiting", "Requests waiting for a slot in the batch.",
                                value=load["waiting"])
        counters = self.engine.counters
        yield CounterMetricFamily("r2r:llm_calls", "Calls to the LLM (catch-up reads; one call serves every row "
                                  "with unread tokens).", value=counters.llm_calls)
        yield CounterMetricFamily("r2r:llm_call_routed_rows", "Routed rows the LLM's calls served, summed over "
                                  "calls (divide by r2r:llm_calls_total for rows per call).",
                                  value=counters.routed_rows)
        yield CounterMetricFamily("r2r:decode_steps", "Decode steps of the whole batch.", value=counters.steps)
        yield CounterMetricFamily("r2r:num_preemptions", "Requests taken out of the batch for more urgent ones "
                                  "(--scheduling-policy priority), to read their prompt and output again later.",
                                  value=counters.preemptions)
        yield CounterMetricFamily("r2r:prefix_cache_queries", "Prompt tokens looked up among the prompts kept for "
                                  "prefix caching.", value=counters.prefix_queries)
        yield CounterMetricFamily("r2r:prefix_cache_hits", "Prompt tokens found among the prompts kept for prefix "
                                  "caching (read from there, not again).", value=counters.prefix_hits)


class Metrics:
    def __init__(self, engine: Engine, load: Callable[[], dict]):
        self.registry = registry = CollectorRegistry()
        registry.register(EngineCollector(engine, load))
        self.success = Counter("r2r:request_success", "Requests that finished, by finish reason.",
                               ["finished_reason"], registry=registry)
        self.failure = Counter("r2r:request_failure", "Requests that did not finish: refused (queue full or "
                               "shutting down), aborted (the client went away), error.", ["reason"],
                               registry=registry)
        self.prompt_tokens = Counter("r2r:prompt_tokens", "Prompt tokens of admitted requests.", registry=registry)
        self.generation_tokens = Counter("r2r:generation_tokens", "Generated tokens, final, by the model that "
                                         "chose them: slm, llm (routed) or fix (verification).", ["source"],
                                         registry=registry)
        self.tokens = dict.fromkeys(SOURCES, 0)  # the same counts, for the share
        for source in SOURCES:
            self.generation_tokens.labels(source)
        share = Gauge("r2r:llm_token_share", "The LLM's share of the generated tokens so far (llm + fix over all).",
                      registry=registry)
        share.set_function(self.llm_share)
        # Each request's counters (`COUNTERS`), summed as requests end.
        self.counters = {name: Counter(f"r2r:{METRIC_NAMES.get(name, name)}", f"Summed over requests: {meaning}.",
                                       registry=registry) for name, meaning in COUNTERS.items()}
        self.ttft = Histogram("r2r:time_to_first_token_seconds", "From a request's arrival to its first final "
                              "token.", buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram("r2r:time_per_output_token_seconds", "A finished request's time per token after its "
                              "first.", buckets=TOKEN_BUCKETS, registry=registry)
        self.e2e = Histogram("r2r:e2e_request_latency_seconds", "From a request's arrival to its last token.",
                             buckets=LATENCY_BUCKETS, registry=registry)

    def llm_share(self) -> float:
        total = sum(self.tokens.values())
        return (self.tokens["llm"] + self.tokens["fix"]) / total if total else 0.0

    def admitted(self, sequence: Sequence) -> None:
        self.prompt_tokens.inc(len(sequence.prompt_ids))

    def refused(self) -> None:
        self.failure.labels("refused").inc()

    def step(self, step: Step, arrived: float, first_token_at: float | None) -> float | None:
        """Count a delivered step; returns when the request's first token came (now, if this step brought it)."""
        now = time.monotonic()
        for _, source, _ in step.final:
            self.generation_tokens.labels(source).inc()
            self.tokens[source] += 1
        if step.final and first_token_at is None:
            first_token_at = now
            self.ttft.observe(now - arrived)
        if step.finished:
            gen = step.sequence.generation
            self.success.labels(gen.finish_reason).inc()
            self.e2e.observe(now - arrived)
            if len(gen.token_ids) > 1 and first_token_at is not None:
                self.tpot.observe((now - first_token_at) / (len(gen.token_ids) - 1))
            self.ended(step.sequence)
        return first_token_at

    def failed(self, sequence: Sequence, aborted: bool) -> None:
        self.failure.labels("aborted" if aborted else "error").inc()
        self.ended(sequence)

    def ended(self, sequence: Sequence) -> None:
        for name, value in sequence.generation.counters().items():
            self.counters[name].inc(value)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
