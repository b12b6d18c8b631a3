import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import save_gguf, tiny_model, tiny_tokenizer  # noqa: E402

from r2r.torch_backend import TorchBackend  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def slm(tokenizer):
    return TorchBackend(tiny_model(tokenizer, hidden=32, seed=0), name="tiny-slm")


@pytest.fixture(scope="session")
def llm(tokenizer):
    return TorchBackend(tiny_model(tokenizer, hidden=64, seed=1), name="tiny-llm")


@pytest.fixture
def run_cli(monkeypatch, capsys):
    """Run the `r2r` entry point in-process; returns (exit code, stdout, stderr)."""
    from r2r import cli

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
BACKENDS = ["torch", pytest.param("llamacpp", marks=pytest.mark.skipif(not HAS_LLAMA, reason="llama-cpp-python "
                                                                      "is not installed"))]


@pytest.fixture(scope="module", params=BACKENDS)
def kind(request):
    """Each backend in turn, for the suites every backend must pass (test_backends, test_verify)."""
    return request.param


def make_backend(kind: str, model, tokenizer, folder, name: str):
    """A tiny transformers model on the `kind` backend (llama.cpp: through a GGUF copy of its weights)."""
    if kind == "torch":
        return TorchBackend(model, name=name, vocab_size=len(tokenizer))
    from r2r.llamacpp import LlamaCppBackend

    path = folder / f"{name}.gguf"
    save_gguf(model, tokenizer, path)
    return LlamaCppBackend(path, name=name, n_ctx=2048, max_rows=8, vocab_size=len(tokenizer))


def assert_idle_soon(url: str) -> None:
    """A server at `url` is running and queueing nothing within 5 s."""
    import time

    import httpx

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
    assert (Path(__file__).parents[1] / "r2r/static/vendor/katex.min.js").exists(), \
        "needs the playground's renderers: run `make web`"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        yield browser
        browser.close()
