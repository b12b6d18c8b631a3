import roads_to_rome  # noqa: F401, I001  (first: it picks MKL's code path, which MKL reads when torch loads it)
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from tiny import save_gguf, tiny_model, tiny_tokenizer  # noqa: E402

from roads_to_rome.backends.torch_backend import TorchBackend  # noqa: E402

# The modules that keep one test process busy longest in `make test`'s unit phase (two processes on two cores),
# longest first: handed out first (the Makefile turns off pytest-xdist's own order, by number of tests), so that the
# short ones fill in at the end and the two processes end together.
LONGEST_MODULES = ["test_defer.py", "test_remote.py", "test_labels.py", "test_overlap.py", "test_server_hardening.py",
                   "test_verification_in_the_loop.py", "test_evaluate.py", "test_server_network.py", "test_cli.py",
                   "test_every_request.py", "test_server.py"]


def pytest_collection_modifyitems(items):
    first = {name: rank for rank, name in enumerate(LONGEST_MODULES)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # (stable: the rest keep their order)


@pytest.fixture(autouse=True)
def one_intra_op_thread(request):
    """Tests on tiny models run torch on one thread: their matrices are too small to split, and beside a second
    model's thread (--overlap) or a server on the same cores, a team of intra-op threads per model oversubscribes
    them (each operation then waits out a scheduler slice). End-to-end tests keep every core."""
    if request.node.get_closest_marker("e2e"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def slm(tokenizer):
    return TorchBackend(tiny_model(tokenizer, hidden=32, seed=0), name="tiny-slm")


@pytest.fixture(scope="session")
def llm(tokenizer):
    return TorchBackend(tiny_model(tokenizer, hidden=64, seed=1), name="tiny-llm")


# The default pair, loaded once and shared by the end-to-end tests that drive it in this process (tests of the
# command line load their own, in the subprocess they start): on llama.cpp once per session (its weights are mapped,
# not copied); on torch once per module and in one dtype at a time, so that its gigabytes go once the module's tests
# are done, and the bf16 pair goes before the float32 one comes (the two together crowd a 24 GB machine).

class TorchPairs:
    """The default pair on torch in the dtype last asked for; asking for another drops the one held first."""

    def __init__(self):
        self.dtype, self.pair = None, None

    def get(self, dtype: str):
        import gc

        from roads_to_rome.models import load_pair
        from roads_to_rome.models.loading import pick_dtype

        dtype = pick_dtype(dtype, "cpu")
        if dtype != self.dtype:
            self.dtype, self.pair = None, None
            gc.collect()
            self.pair, self.dtype = load_pair(None, None, "cpu", backend="torch", dtype=dtype), dtype
        return self.pair


@pytest.fixture(scope="module")
def torch_pairs():
    return TorchPairs()


@pytest.fixture
def torch_pair(torch_pairs):
    """(SLM, LLM, tokenizer) on torch, in the dtype `--dtype auto` picks here: the proofs against transformers."""
    return torch_pairs.get("auto")


@pytest.fixture
def torch_pair_float32(torch_pairs):
    """The pair on torch in float32 (the same as `torch_pair` where `auto` picks float32)."""
    return torch_pairs.get("float32")


@pytest.fixture(scope="session")
def llamacpp_pair():
    """(SLM, LLM, tokenizer) on llama.cpp, as `--backend auto` runs them on a CPU."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from roads_to_rome.models import load_pair

    return load_pair(None, None, "cpu", backend="llamacpp")


@pytest.fixture
def run_cli(monkeypatch, capsys):
    """Run the `r2r` entry point in-process; returns (exit code, stdout, stderr)."""
    from roads_to_rome.cli import main as cli

    def run(*args):
        monkeypatch.setattr(sys, "argv", ["r2r", *map(str, args)])
        code = 0
        try:
            cli.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


HAS_LLAMA = importlib.util.find_spec("llama_cpp") is not None
BACKENDS = ["torch", "torch-static",
            pytest.param("llamacpp",
                         marks=pytest.mark.skipif(not HAS_LLAMA, reason="llama-cpp-python is not installed"))]


# The engine's own logic (overlap, deferral, verification in the loop) on torch, and on llama.cpp, whose chunked
# prompt reads and batch kernels give that logic cases of their own. torch-static's cache is held to torch's by the
# backend contract (test_backends: each operation the engine makes of a backend) and runs the engine's scheduling,
# sampling, structured outputs and prefix caching in the suites that use `kind` as it is.
ENGINE_LOGIC_BACKENDS = [b for b in BACKENDS if b != "torch-static"]


def kind_fixture(backends: list):
    """A `kind` fixture over `backends`: each in turn, for the tests of a module."""

    @pytest.fixture(scope="module", params=backends, name="kind")
    def kind(request):
        return request.param

    return kind


kind = kind_fixture(BACKENDS)  # every backend: the suites every backend must pass (test_backends, test_scheduler)


@pytest.fixture(scope="module")
def kind_pair(kind, slm, llm, tokenizer, tmp_path_factory):
    """The tiny SLM and LLM on the `kind` backend (the suites that run a routed pair on every backend)."""
    if kind == "torch":
        return slm, llm
    folder = tmp_path_factory.mktemp(kind)
    return (make_backend(kind, slm.model, tokenizer, folder, "slm"),
            make_backend(kind, llm.model, tokenizer, folder, "llm"))


def make_backend(kind: str, model, tokenizer, folder, name: str):
    """A tiny transformers model on the `kind` backend (llama.cpp: through a GGUF copy of its weights)."""
    if kind in ("torch", "torch-static"):  # torch-static: the fixed-capacity cache CUDA uses, here on the CPU
        return TorchBackend(model, name=name, vocab_size=len(tokenizer), static=kind == "torch-static",
                            pad_reads=kind == "torch-static")
    path = folder / f"{name}.gguf"
    save_gguf(model, tokenizer, path)
    return tiny_llamacpp(path, name=name, n_ctx=2048, max_rows=8, vocab_size=len(tokenizer))


def tiny_llamacpp(path, **options):
    """A tiny GGUF model on llama.cpp, on one thread, as torch runs the tiny models (`one_intra_op_thread`): the
    threads of a llama.cpp context meet at a barrier in every operation, and with another test process or model
    on the other core, each meeting waits out a scheduler slice."""
    from roads_to_rome.backends.llamacpp import LlamaCppBackend

    return LlamaCppBackend(path, n_threads=1, **options)


def assert_idle_soon(url: str) -> None:
    """A server at `url` is running and queueing nothing within 5 s."""
    for _ in range(100):
        load = httpx.get(url + "/health").json()
        if load["running"] == 0 and load["waiting"] == 0:
            return
        time.sleep(0.05)
    assert load["running"] == 0 and load["waiting"] == 0, load


@pytest.fixture(scope="session")
def browser():
    """Debian's Chromium, headless, driven by playwright (which downloads no browser of its own)."""
    import shutil

    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "needs Debian's chromium (make test installs it: apt-get install chromium)"
    assert (Path(__file__).parents[1] / "roads_to_rome/serving/static/vendor/katex.min.js").exists(), \
        "needs the playground's renderers: run `make web`"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        yield browser
        browser.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """scripts/llama-server.py on a GGUF file, on loopback; restartable on the same port."""

    SCRIPT = Path(__file__).parents[1] / "scripts" / "llama-server.py"

    def __init__(self, gguf: Path, slots: int = 4, ctx_per_slot: int = 512, threads: int = 1,
                 api_key: str | None = None):
        self.gguf, self.slots, self.ctx, self.threads, self.port = gguf, slots, ctx_per_slot, threads, free_port()
        self.api_key = api_key
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = None

    def start(self) -> "LlamaServer":
        self.process = subprocess.Popen([sys.executable, str(self.SCRIPT), str(self.gguf), "--port", str(self.port),
                                         "--slots", str(self.slots), "--ctx-per-slot", str(self.ctx),
                                         "--threads", str(self.threads),
                                         *(["--api-key", self.api_key] if self.api_key else [])],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        return self.wait("/health", 60)

    def wait(self, path: str, seconds: float):
        """Until GET `path` answers 200 (the server is up), or fail if the process exits first."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + path).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            assert self.process.poll() is None, f"the server at {self.url} exited"
            time.sleep(0.1)
        raise RuntimeError(f"the server at {self.url} did not start within {seconds:.0f} s")

    def stop(self) -> None:
        """Kill the server and every process it started (vLLM's engine core and workers outlive their parent)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:  # stopped already
            pass
        self.process.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def own_greedy(self, ids: list[int], n: int) -> list[int]:
        out = httpx.post(self.url + "/completion", json={"prompt": ids, "n_predict": n, "temperature": 0,
                                                         "ignore_eos": True, "return_tokens": True,
                                                         "cache_prompt": False},
                         headers=self.headers, timeout=120).json()
        return out["tokens"]


class VllmServer(LlamaServer):
    """vLLM's OpenAI-compatible server on a transformers model directory, on loopback, from its own virtualenv
    (`make vllm`: .venv-vllm); eager mode, so it starts in under a minute on a CPU, and 32-token KV blocks, as
    `make vllm-server` (its prefix cache reuses whole blocks only)."""

    PYTHON = Path(__file__).parents[1] / ".venv-vllm" / "bin" / "python"

    def __init__(self, model_dir: Path, name: str = "tiny", max_len: int = 512, threads: int = 1,
                 dtype: str = "float32", api_key: str | None = None):
        self.model_dir, self.name, self.max_len, self.threads = model_dir, name, max_len, threads
        self.api_key = api_key
        self.port = free_port()
        self.dtype = dtype
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = None

    def start(self) -> "VllmServer":
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": str(self.threads)}
        self.process = subprocess.Popen([str(self.PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model",
                                         str(self.model_dir), "--served-model-name", self.name, "--dtype", self.dtype,
                                         "--max-model-len", str(self.max_len), "--port", str(self.port),
                                         "--enforce-eager", "--block-size", "32",
                                         *(["--api-key", self.api_key] if self.api_key else [])],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                        start_new_session=True)
        return self.wait("/health", 300)  # eager mode compiles nothing, but its imports take a while

    def own_greedy(self, ids: list[int], n: int) -> list[int]:
        out = httpx.post(self.url + "/v1/completions", json={
            "model": self.name, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            "return_tokens_as_token_ids": True}, headers=self.headers, timeout=300).json()
        return [int(t.removeprefix("token_id:")) for t in out["choices"][0]["logprobs"]["tokens"]]


@pytest.fixture(scope="module")
def llm_files(tokenizer, tmp_path_factory):
    """The tiny LLM as a GGUF file (llama.cpp) and a transformers directory (vLLM), and as a local backend."""
    folder = tmp_path_factory.mktemp("remote")
    model = tiny_model(tokenizer, hidden=128, seed=1)  # head size 32: the smallest vLLM's CPU attention runs
    save_gguf(model, tokenizer, folder / "tiny-llm.gguf")
    model.save_pretrained(folder / "tiny-llm")
    tokenizer.save_pretrained(folder / "tiny-llm")
    return {"gguf": folder / "tiny-llm.gguf", "dir": folder / "tiny-llm", "model": model}
