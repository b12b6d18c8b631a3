"""The code's shape as rules (beside test_layers.py's): functions a reader takes in at once, classes and modules of
one concern, the records a decode step's phases hand each other small, and one spelling of verification."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1] / "roads_to_rome"
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 300
MAX_MODULE_LINES = {"serving": 350, "bench": 500, "cli": 450}
MAX_STEP_RECORD_FIELDS = 10  # what one phase of a decode step hands the next (core/batch.py)
FILES = sorted(ROOT.rglob("*.py"))


def name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


@pytest.mark.parametrize("path", FILES, ids=name)
def test_functions_and_classes_stay_small(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert lines(node) <= MAX_FUNCTION_LINES, (
                f"{name(path)}:{node.lineno} {node.name} is {lines(node)} lines, past {MAX_FUNCTION_LINES}: "
                "split it into named steps")
        if isinstance(node, ast.ClassDef):
            assert lines(node) <= MAX_CLASS_LINES, (
                f"{name(path)}:{node.lineno} class {node.name} is {lines(node)} lines, past {MAX_CLASS_LINES}: give a "
                "concern of it a class of its own")


@pytest.mark.parametrize("path", [p for p in FILES if p.relative_to(ROOT).parts[0] in MAX_MODULE_LINES], ids=name)
def test_modules_stay_within_their_layers_size(path):
    limit = MAX_MODULE_LINES[path.relative_to(ROOT).parts[0]]
    count = len(path.read_text().splitlines())
    assert count <= limit, f"{name(path)} is {count} lines, past {limit}: split it by concern"


def test_verify_is_compared_with_a_string_only_in_its_parser():
    """A verification setting is a `Verify`, parsed once: code asks it `.on` or `.strict`, never its spelling."""
    import re

    spelled = re.compile(r"verify\w*(\.\w+)?\s*[!=]=\s*['\"]|['\"](off|strict)['\"]\s*[!=]=\s*\w*verify")
    found = [f"{name(p)}:{i}" for p in FILES for i, line in enumerate(p.read_text().splitlines(), 1)
             if spelled.search(line)]
    assert not found, f"verification compared with its spelling (ask the Verify .on or .strict): {found}"


def test_a_steps_records_stay_small():
    """Each phase of a decode step returns a small record the next takes as an argument (core/batch.py): a record
    that every phase writes and reads grows until no one can say which phase set what."""
    path = ROOT / "core" / "batch.py"
    records = {node.name: [n for n in node.body if isinstance(n, ast.AnnAssign)]
               for node in ast.parse(path.read_text()).body if isinstance(node, ast.ClassDef)
               and any("dataclass" in ast.unparse(d) for d in node.decorator_list)}
    assert {"Proposal", "Routing", "LLMWord", "Decisions"} <= set(records), sorted(records)
    large = {name: len(fields) for name, fields in records.items() if len(fields) > MAX_STEP_RECORD_FIELDS}
    assert not large, f"records of a step past {MAX_STEP_RECORD_FIELDS} fields (split them by phase): {large}"
