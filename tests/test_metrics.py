"""`GET /metrics`: Prometheus's text format, parsed with prometheus_client's own parser, whose counters equal the
sums of the requests' `usage` and provenance."""

import collections

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from roads_to_rome.core.engine import Engine
from roads_to_rome.routing.policies import RandomPolicy
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.limits import Limits
from roads_to_rome.serving.server import create_app

KEY = "metrics-test-key"


@pytest.fixture(scope="module")
def server(slm, llm, tokenizer):
    # Verification at a tolerance makes "fix" tokens and rollbacks; a random policy makes routed ones.
    engine = Engine(slm, llm, tokenizer, RandomPolicy(0.3, seed=0), verify=0.5)
    app = create_app(engine, "tiny-r2r", Limits(max_batch=4, max_tokens=64, context_length=256), api_key=KEY)
    with BackgroundServer(app) as srv:
        yield srv.url


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """{sample name: {sorted labels: value}}."""
    reply = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/plain")
    samples = collections.defaultdict(dict)
    for family in text_string_to_metric_families(reply.text):
        for s in family.samples:
            samples[s.name][tuple(sorted(s.labels.items()))] = s.value
    return samples


def test_metrics_need_the_api_key(server):
    assert httpx.get(server + "/metrics").status_code == 401
    assert httpx.get(server + "/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_counters_equal_the_requests_usage_sums(server):
    before = scrape(server)
    assert before["r2r:num_requests_running"][()] == 0 and before["r2r:num_requests_waiting"][()] == 0
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)
    usages, sources, finish = [], [], collections.Counter()
    for n, prompt in enumerate(["What is 48 / 2?", "def add(a, b):", "Name three colours.", "Count to five."]):
        messages = [{"role": "user", "content": prompt}]
        if n % 2:  # streamed: the provenance comes a token at a time, the usage with the last one
            chunks = list(client.chat.completions.create(model="tiny-r2r", messages=messages, max_tokens=24,
                                                         temperature=0, stream=True,
                                                         stream_options={"include_usage": True}))
            sources += [c.model_extra["r2r"]["source"] for c in chunks if c.model_extra.get("r2r")]
            usages.append(chunks[-1].usage)
            finish[next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)] += 1
        else:
            out = client.chat.completions.create(model="tiny-r2r", messages=messages, max_tokens=24, temperature=0)
            sources += out.model_extra["r2r"]["sources"]
            usages.append(out.usage)
            finish[out.choices[0].finish_reason] += 1
    after = scrape(server)

    def grew(name, labels=()):
        return after[name].get(labels, 0) - before[name].get(labels, 0)

    assert grew("r2r:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    for source in ("slm", "llm", "fix"):
        assert grew("r2r:generation_tokens_total", (("source", source),)) == sources.count(source)
    assert sources.count("llm") > 0 and sources.count("slm") > 0
    assert sum(grew("r2r:generation_tokens_total", (("source", s),)) for s in ("slm", "llm", "fix")) == \
        sum(u.completion_tokens for u in usages)
    assert grew("r2r:rollbacks_total") == sum(u.model_extra["rollbacks"] for u in usages)
    # One request at a time: each LLM call served exactly one request.
    assert grew("r2r:llm_calls_total") == sum(u.model_extra["llm_calls"] for u in usages) > 0
    for reason, count in finish.items():
        assert grew("r2r:request_success_total", (("finished_reason", reason),)) == count
    for histogram in ("r2r:time_to_first_token_seconds", "r2r:e2e_request_latency_seconds"):
        assert grew(histogram + "_count") == len(usages)
        assert grew(histogram + "_sum") > 0
    llm = after["r2r:generation_tokens_total"][(("source", "llm"),)] + \
        after["r2r:generation_tokens_total"][(("source", "fix"),)]
    total = sum(after["r2r:generation_tokens_total"][(("source", s),)] for s in ("slm", "llm", "fix"))
    assert after["r2r:llm_token_share"][()] == pytest.approx(llm / total)


def test_refusals_and_bad_requests(server):
    before = scrape(server)
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError):  # refused before it is a request: not counted
        client.chat.completions.create(model="tiny-r2r", messages=[{"role": "user", "content": "hi"}], max_tokens=0)
    after = scrape(server)
    assert after["r2r:prompt_tokens_total"] == before["r2r:prompt_tokens_total"]
    assert sum(after["r2r:request_failure_total"].values()) == sum(before["r2r:request_failure_total"].values())
