"""The prompts routing labels are made from: a file's (`load_prompts`), reasoning-gym's domains
(`build_prompt_set`), math word problems (`math_prompt_set`, and ones an LLM writes, kept only where they
copy no GSM8K test question), and lines of code to fill in (`infill_prompt_set`, from Python's standard library)."""

from __future__ import annotations

import ast
import json
import random
import re
import sysconfig
import textwrap
from pathlib import Path

from roads_to_rome.core.request import Request
from roads_to_rome.core.sampling import SamplingParams
from roads_to_rome.data.benchmarks import MATH_INSTRUCTION, gsm8k
from roads_to_rome.errors import R2RError
from roads_to_rome.progress import QUIET

DOMAINS = {
    # reasoning-gym generators per domain; never gsm_symbolic (built from GSM8K test questions)
    "math": ["basic_arithmetic", "chain_sum", "decimal_arithmetic", "fraction_simplification", "gcd", "lcm",
             "prime_factorization", "simple_equations", "polynomial_equations", "number_sequence"],
    "logic": ["knights_knaves", "syllogism", "propositional_logic", "zebra_puzzles", "self_reference"],
    "code": ["codeio"],
    "qa": ["family_relationships", "aiw", "letter_counting", "time_intervals", "calendar_arithmetic"],
}


def load_prompts(path: Path) -> list[dict]:
    """A JSONL prompt set: {"id", "domain", "prompt", optional "reference", "suffix" and "stop"} per line. A prompt
    with a suffix asks for the text between the two, in the model's fill-in-the-middle format; `stop`: strings that
    end its response (as a request's stop strings do)."""
    if not path.exists():
        raise R2RError(f"prompt set {path} does not exist")
    prompts, seen = [], set()
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise R2RError(f"{path}:{n}: not JSON ({e})") from None
        missing = [k for k in ("id", "domain", "prompt") if not isinstance(row.get(k), str) or not row.get(k)]
        if missing:
            raise R2RError(f"{path}:{n}: needs non-empty string fields {missing}")
        if row["id"] in seen:
            raise R2RError(f"{path}:{n}: duplicate id {row['id']!r}")
        if "suffix" in row and not isinstance(row["suffix"], str):
            raise R2RError(f"{path}:{n}: suffix must be a string (the code after the text to fill in)")
        stop = row.get("stop", [])
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise R2RError(f"{path}:{n}: stop must be a list of non-empty strings")
        seen.add(row["id"])
        prompts.append({"id": row["id"], "domain": row["domain"], "prompt": row["prompt"],
                        "reference": str(row.get("reference", ""))}
                       | ({"suffix": row["suffix"]} if "suffix" in row else {}) | ({"stop": stop} if stop else {}))
    if not prompts:
        raise R2RError(f"prompt set {path} is empty")
    return prompts


def build_prompt_set(per_domain: int, seed: int = 0) -> list[dict]:
    """The default training prompts from reasoning-gym: `per_domain` prompts in each of DOMAINS."""
    import reasoning_gym

    prompts = []
    for domain, generators in DOMAINS.items():
        per_generator = -(-per_domain // len(generators))
        rows = []
        for name in generators:
            for i, entry in enumerate(reasoning_gym.create_dataset(name, size=per_generator, seed=seed)):
                rows.append({"id": f"{domain}/{name}/{seed}/{i}", "domain": domain, "prompt": entry["question"],
                             "reference": str(entry.get("answer", ""))})
        # interleave generators so a smaller per_domain still covers all of them
        rows.sort(key=lambda r: (int(r["id"].rsplit("/", 1)[1]), r["id"]))
        prompts += rows[:per_domain]
    return prompts


# Math prompts with checkable answers, for the answer judge: reasoning-gym generators that ask a worded
# question with one answer (never gsm_symbolic), CHAMP's competition problems, and word problems the LLM
# writes itself in GSM8K's style. Each ends with the evaluation's instruction, so answers say "The answer is".
WORD_GENERATORS = ["leg_counting", "aiw", "time_intervals", "simple_geometry", "basic_arithmetic", "chain_sum",
                   "decimal_arithmetic", "fraction_simplification", "simple_equations", "gcd", "lcm"]
TOPICS = ["a bakery", "a school trip", "a farm", "saving money", "a garden", "a road trip", "a bookshop",
          "a football team", "a birthday party", "painting a house", "a fruit stall", "a library", "a zoo",
          "a train journey", "a lemonade stand", "knitting scarves", "a car wash", "a science fair", "a pet shop",
          "a swimming pool", "a toy factory", "a pizza order", "a marathon", "a movie theatre", "a flower shop"]
WRITE_PROMPT = ("Write one new grade-school math word problem about {topic}. Solving it should take {steps} steps "
                "of arithmetic with whole numbers. Write only the problem, ending with its question.")
OVERLAP_WORDS = 8  # a written problem sharing a run of this many words with a GSM8K test question is dropped


def math_prompt_set(n_generated: int, seed: int = 0, champ: bool = True) -> list[dict]:
    """Math prompts from packages: `n_generated` from reasoning-gym's worded generators, plus CHAMP's 270."""
    import reasoning_gym

    rows = []
    per_generator = -(-n_generated // len(WORD_GENERATORS))
    for name in WORD_GENERATORS:
        for i, entry in enumerate(reasoning_gym.create_dataset(name, size=per_generator, seed=seed)):
            rows.append({"id": f"math/{name}/{seed}/{i}", "domain": "math",
                         "prompt": f"{entry['question']}\n{MATH_INSTRUCTION}", "reference": str(entry["answer"])})
    rows.sort(key=lambda r: (int(r["id"].rsplit("/", 1)[1]), r["id"]))  # every generator, whatever n is
    rows = rows[:n_generated]
    if champ:
        import champ_dataset

        for problem in champ_dataset.load("v0").problems.values():
            rows.append({"id": f"math/champ/{problem.identifier}", "domain": "math",
                         "prompt": f"{problem.text}\n{MATH_INSTRUCTION}", "reference": problem.answer})
    return rows


def word_ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def longest_shared_run(text: str, others: list[str]) -> int:
    """The longest run of words `text` shares with any of `others` (how close it comes to copying one)."""
    longest = 0
    while longest < 64 and any(word_ngrams(text, longest + 1) & word_ngrams(o, longest + 1) for o in others):
        longest += 1
    return longest


def new_problem(problem: str, seen: set[str], test_grams: set) -> bool:
    """A written problem is kept when it asks a question, is not one already kept (same words), and shares no
    run of OVERLAP_WORDS words with a GSM8K test question (`test_grams`); kept ones join `seen`."""
    key = " ".join(re.findall(r"[a-z0-9]+", problem.lower()))
    if "?" not in problem or key in seen or word_ngrams(problem, OVERLAP_WORDS) & test_grams:
        return False
    seen.add(key)
    return True


def write_word_problems(llm_engine, count: int, seed: int = 0, batch_size: int = 8, progress=QUIET) -> list[dict]:
    """Word problems in GSM8K's style that the LLM writes itself (sampled, seeded: the same seed gives the same
    problems), deduplicated, without any that shares a run of OVERLAP_WORDS words with a GSM8K test question.
    Each row records its longest shared run with those questions."""
    test = [q["question"] for q in gsm8k()]
    test_grams = set().union(*(word_ngrams(q, OVERLAP_WORDS) for q in test))
    rows, seen, attempt = [], set(), 0
    task = progress.add_task("writing word problems (LLM)", total=count)
    while len(rows) < count and attempt < 4 * count:
        asks = [WRITE_PROMPT.format(topic=TOPICS[(attempt + k) % len(TOPICS)], steps=3 + (attempt + k) % 3)
                for k in range(batch_size)]
        requests = [Request(llm_engine.prompts.chat(ask), SamplingParams(
            max_new_tokens=160, temperature=0.8, top_p=0.95, seed=seed * 100_003 + attempt + k))
            for k, ask in enumerate(asks)]  # a seed per problem: a topic comes round again with another
        gens = llm_engine.run(requests)
        attempt += batch_size
        for gen in gens:
            problem = gen.text.strip().strip('"').strip()
            problem = problem[: problem.find("?") + 1] or problem  # the problem ends with its question; no solution
            if gen.finish_reason != "stop" or not new_problem(problem, seen, test_grams):
                continue
            rows.append({"id": f"math/written/{seed}/{len(rows)}", "domain": "math",
                         "prompt": f"{problem}\n{MATH_INSTRUCTION}", "reference": "",
                         "gsm8k_overlap_words": longest_shared_run(problem, test)})
            progress.advance(task)
            if len(rows) == count:
                break
    return rows


# Parts of the standard library that are tests, demos, vendored copies or installed packages, not its own code.
NOT_LIBRARY = {"test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "site-packages", "__pycache__",
               "tkinter", "pydoc_data", "config-3"}


def library_functions(root: Path, min_lines: int = 6, max_lines: int = 40) -> list[tuple[str, str, list[int]]]:
    """(qualified name, dedented source, `hole_lines`) of each function and method of `min_lines`..`max_lines`
    lines in the standard library's modules under `root`, in file order (not those a string keeps from being
    dedented, nor those with no line to ask for)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if NOT_LIBRARY.intersection(path.relative_to(root).parts[:-1]) or path.name.startswith("test_"):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        for owner in [tree, *(node for node in tree.body if isinstance(node, ast.ClassDef))]:
            prefix = f"{module}.{owner.name}" if isinstance(owner, ast.ClassDef) else module
            for node in owner.body:
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                if not min_lines <= node.end_lineno - first + 1 <= max_lines:
                    continue
                function = textwrap.dedent("".join(lines[first - 1 : node.end_lineno]))
                try:
                    holes = hole_lines(function)
                except SyntaxError:
                    continue
                if holes:
                    found.append((f"{prefix}.{node.name}", function, holes))
    return found


def hole_lines(function: str) -> list[int]:
    """The lines of a function's body worth asking for: code (not blank, not only a comment), after its signature
    and docstring."""
    node = ast.parse(function).body[0]
    body = node.body[1:] if (isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
                             and isinstance(node.body[0].value.value, str)) else node.body
    if not body:
        return []
    lines = function.splitlines()
    return [k for k in range(body[0].lineno - 1, len(lines))
            if lines[k].strip() and not lines[k].strip().startswith("#")]


def infill_prompt_set(count: int, seed: int = 0, root: Path | None = None) -> list[dict]:
    """`count` fill-in-the-middle prompts from the functions of Python's standard library (the interpreter's own
    `Lib/`, no evaluation set): per function drawn with the seed, one line of its body taken out, the code before
    it the prompt and the code after it the suffix, the response stopped at the line's end, as `humaneval-infill`
    asks (its reference: the line)."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    functions = library_functions(root)
    if len(functions) < count:
        raise R2RError(f"the standard library under {root} has {len(functions)} functions to fill in, not {count}")
    rng = random.Random(seed)
    rows = []
    for i, (name, function, holes) in enumerate(rng.sample(functions, count)):
        k = rng.choice(holes)
        lines = function.splitlines(keepends=True)
        rows.append({"id": f"infill/{name}/{seed}/{i}", "domain": "infill", "prompt": "".join(lines[:k]),
                     "suffix": "\n" + "".join(lines[k + 1 :]), "stop": ["\n"],
                     "reference": lines[k].rstrip("\n")})
    return rows
