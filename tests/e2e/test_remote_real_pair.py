"""The default pair's LLM on a serving engine, llama.cpp's own server (from xllamacpp), R2R's SLM and router here:
the LLM's tokens equal the server's own greedy output, and R2R runs end to end through `r2r generate`, `r2r serve`
and `r2r eval`. Needs `r2r models prepare`.

The remote backend's real-pair proof runs once, on the server that starts in seconds. vLLM's is the same protocol
with other fields (prompt logprobs, token ids in logprobs, cache salts, block-sized prefix caching), each checked
on a real vLLM server with a tiny LLM in tests/test_remote.py: the LLM alone equals its own greedy output, overlap,
deferred routing and strict verification through it; on a CPU the 1.5B's start there is minutes where float32 is
all a processor has."""

import json
import os

import httpx
import pytest
from conftest import LlamaServer

from roads_to_rome.backends.remote import RemoteBackend
from roads_to_rome.core.engine import Engine
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.data.benchmarks import gsm8k, gsm8k_prompt
from roads_to_rome.models import DEFAULT_LLM, gguf_path
from roads_to_rome.routing.policies import AlwaysLLM
from roads_to_rome.serving.background import BackgroundServer
from roads_to_rome.serving.limits import Limits
from roads_to_rome.serving.server import create_app

pytestmark = [pytest.mark.e2e]


@pytest.fixture(scope="module")
def server():
    pytest.importorskip("xllamacpp", reason="llama.cpp's server comes from the xllamacpp wheel")
    with LlamaServer(gguf_path(DEFAULT_LLM), slots=2, ctx_per_slot=4096, threads=os.cpu_count()) as srv:
        yield srv


@pytest.fixture(scope="module")
def slm(llamacpp_pair):
    return llamacpp_pair[0], llamacpp_pair[2]


def test_the_llm_through_the_remote_backend_equals_the_servers_own_greedy(server, slm):
    slm_backend, tokenizer = slm
    llm = RemoteBackend(server.url, tokenizer, slm_backend.eos_ids, vocab_size=slm_backend.vocab_size)
    engine = Engine(slm_backend, llm, tokenizer, AlwaysLLM())
    prompts = [engine.prompts.chat(gsm8k_prompt(item)) for item in gsm8k()[:2]]
    # (16 tokens: each is a call to the server)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        assert out.token_ids == server.own_greedy(ids, 16)


def test_r2r_with_the_remote_llm_end_to_end(server, slm, run_cli, tmp_path):
    code, out, err = run_cli("generate", "What is 48 / 2? Answer with the number.", "--llm", server.url,
                             "--backend", "llamacpp", "--max-new-tokens", "24")
    assert code == 0, err
    assert "24" in out.replace("[[", "").replace("]]", "")  # [[...]]: the LLM's tokens, on a plain terminal
    code, out, err = run_cli("eval", "--benchmark", "gsm8k", "--ids", "0-1", "--llm", server.url, "--backend",
                             "llamacpp", "--systems", "r2r", "--max-new-tokens", "64", "--out", tmp_path)
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "gsm8k" / "r2r.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["llm_tokens"] > 0 for r in rows)
    from roads_to_rome.models import load_engine

    engine = load_engine(llm=server.url, device="cpu", backend="llamacpp")
    with BackgroundServer(create_app(engine, "r2r", Limits(max_batch=2, max_tokens=256))) as r2r:
        body = {"messages": [{"role": "user", "content": "What is 48 / 2?"}], "max_tokens": 48, "temperature": 0}
        answer = httpx.post(r2r.url + "/v1/chat/completions", json=body, timeout=300).json()
        assert answer["usage"]["llm_tokens"] > 0 and "24" in answer["choices"][0]["message"]["content"]
