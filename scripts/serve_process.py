"""Starting a server for the scripts that drive one as a client would (soak.py, server-checks.py)."""

import subprocess
import time
from pathlib import Path

import httpx


def start_process(command: list[str], health: str, log: Path, seconds: float = 300,
                  cwd: Path | None = None) -> subprocess.Popen:
    """`command` started in a process group of its own (in `cwd`), its output appended to `log`, once `health`
    answers."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                   cwd=cwd)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if httpx.get(health, timeout=5).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise SystemExit(f"{command[:3]} exited with {process.returncode} (its output: {log})")
        time.sleep(0.25)
    process.kill()
    raise SystemExit(f"{command[:3]} did not start within {seconds:.0f} s (its output: {log})")
