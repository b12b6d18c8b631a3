"""Model-written code run apart from the user: HumanEval's checks in a subprocess of their own, in a scratch
directory that is deleted afterwards, with a time limit, limits on memory, file size and CPU time, an environment
without the user's variables, and no network where the OS allows it (a network namespace of its own through
`unshare`). Where the OS does not allow that, the code runs with the network, and `isolation()` says so."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

log = logging.getLogger(__name__)
MEMORY_BYTES = 2 << 30  # address space: enough for numpy's import, far below what could hurt the machine
FILE_BYTES = 16 << 20  # the largest file the code may write (in its scratch directory)


@dataclass(frozen=True)
class Outcome:
    passed: bool
    result: str  # "passed", "timed out", or "failed: " and the error's last line


@functools.cache
def no_network_prefix() -> tuple[str, ...]:
    """The command that runs a program without network access here (`unshare` into new user and network
    namespaces), or () where the OS refuses (no unprivileged user namespaces)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    probe = subprocess.run([unshare, "--user", "--map-root-user", "--net", sys.executable, "-c", "pass"],
                           capture_output=True, timeout=30)
    return (unshare, "--user", "--map-root-user", "--net") if probe.returncode == 0 else ()


def isolation() -> dict:
    """What the sandbox does on this machine, for an evaluation's record."""
    network = "off (own network namespace)" if no_network_prefix() else \
        "ON: this OS gives no unprivileged network namespace (unshare); run evaluations in a container without one"
    return {"process": "subprocess, own session", "scratch_dir": True, "memory_bytes": MEMORY_BYTES,
            "file_bytes": FILE_BYTES, "network": network}


@functools.cache
def warn_network() -> None:
    log.warning("model-written code runs with network access: %s", isolation()["network"])


# The child sets its own limits, then runs the program (set in the child: no preexec_fn in a threaded parent).
BOOT = """
import resource, runpy, sys
for limit, value in ((resource.RLIMIT_AS, {memory}), (resource.RLIMIT_FSIZE, {file}), (resource.RLIMIT_CPU, {cpu}),
                     (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(limit, (value, value))
runpy.run_path(sys.argv[1], run_name="__main__")
"""


def run_python(program: str, seconds: float) -> Outcome:
    """Run `program` apart (see the module's docstring); passed when it exits 0 within `seconds`."""
    if not no_network_prefix():
        warn_network()
    with tempfile.TemporaryDirectory(prefix="r2r-sandbox-") as scratch:
        path = os.path.join(scratch, "program.py")
        with open(path, "w") as f:
            f.write(program)
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "PYTHONDONTWRITEBYTECODE": "1",
               "LANG": "C.UTF-8"}
        boot = BOOT.format(memory=MEMORY_BYTES, file=FILE_BYTES, cpu=int(seconds) + 1)
        command = [*no_network_prefix(), sys.executable, "-I", "-B", "-c", boot, path]
        process = subprocess.Popen(command, cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, start_new_session=True)
        try:
            _, err = process.communicate(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
            return Outcome(False, "timed out")
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
    if process.returncode == 0:
        return Outcome(True, "passed")
    lines = err.decode(errors="replace").strip().splitlines()
    return Outcome(False, "failed: " + (lines[-1] if lines else f"exit status {process.returncode}"))
