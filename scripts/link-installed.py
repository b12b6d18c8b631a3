"""Puts a distribution installed in this environment into another virtualenv by hard-linking its files (a copy where
the two are on different file systems): `python scripts/link-installed.py NAME VENV`.

The set-up installs torch into .venv, then vLLM's venv wants the same wheel: pip would unpack it again and
byte-compile its thousands of modules again (most of its install time). The files pip recorded for it (RECORD,
compiled modules included) are linked instead, so that pip in the other venv finds it installed; pip still installs
what it depends on there. Scripts outside site-packages are left out: their first line names this environment's
python.
"""

import os
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path


def site_packages(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        sys.exit(f"error: {venv} is not a virtualenv (no bin/python): make it first (python3 -m venv {venv})")
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip())


def link_installed(name: str, target: Path) -> int:
    """Links distribution `name`'s recorded files (as this environment has it) into the site-packages folder
    `target`; returns how many."""
    found = distribution(name)
    root = Path(found.locate_file("")).resolve()
    linked = 0
    for record in found.files or []:
        source = Path(found.locate_file(record)).resolve()
        if not source.is_relative_to(root) or not source.is_file():
            continue  # a script in bin/, or a file pip recorded that is gone
        dest = target / source.relative_to(root)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.unlink(missing_ok=True)
        try:
            os.link(source, dest)
        except OSError:  # another file system
            shutil.copy2(source, dest)
        linked += 1
    return linked


def main() -> None:
    name, venv = sys.argv[1], Path(sys.argv[2])
    try:
        print(f"{name}: {link_installed(name, site_packages(venv))} files linked into {venv}")
    except PackageNotFoundError:
        sys.exit(f"error: {name} is not installed in {sys.prefix}: install it there first")


if __name__ == "__main__":
    main()
