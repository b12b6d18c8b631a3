import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import tiny_model, tiny_tokenizer  # noqa: E402

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
