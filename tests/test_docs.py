"""Every `r2r` command shown in the README and docs/ names a command that exists and only options it takes; the README
stays a page users read: short, with table cells a line or two long."""

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
WORD = re.compile(r"[a-z][a-z-]*")


def shown_commands() -> list[tuple[str, str]]:
    """(page, command line) for each line of a bash block that runs `r2r` (continuations joined)."""
    found = []
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" # ")[0].strip()
                if line.startswith("r2r "):
                    found.append((str(page.relative_to(ROOT)), line))
    return found


COMMANDS = shown_commands()


README_LINES, CELL_CHARS = 240, 250


def test_the_readme_stays_short():
    """Details have their pages under docs/: the README says what R2R is, how to start and where to read on."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_LINES, f"README.md is past {README_LINES} lines: move details to docs/"
    cells = [cell.strip() for line in text.splitlines() if line.startswith("|") for cell in line.strip("|").split("|")]
    long = [cell[:60] for cell in cells if len(cell) > CELL_CHARS]
    assert not long, f"README table cells past {CELL_CHARS} characters (give the detail on its results page): {long}"


def test_the_readme_shows_commands():
    assert sum(page == "README.md" for page, _ in COMMANDS) >= 10


@pytest.mark.parametrize("page, line", COMMANDS, ids=[f"{p}: {c[:60]}" for p, c in COMMANDS])
def test_a_shown_command_exists_and_takes_its_options(run_cli, page, line):
    words = shlex.split(line)[1:]
    path, help_text = [], None
    for word in words:  # the deepest command the leading words name
        if not WORD.fullmatch(word):
            break
        code, out, _ = run_cli(*path, word, "--help")
        if code != 0 or "Usage:" not in out:
            break
        path.append(word)
        help_text = out
    code, out, err = run_cli(*path, "--help")
    assert code == 0, (line, err)
    help_text = help_text or out
    if "Commands" in help_text and len(words) > len(path):  # a group given arguments runs its default command
        code, out, _ = run_cli(*path, "run", "--help")
        help_text = out if code == 0 else help_text
    for option in (w.split("=")[0] for w in words if w.startswith("--")):
        assert option in help_text, f"{page}: `{line}` uses {option}, which `r2r {' '.join(path)}` does not take"
