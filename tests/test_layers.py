"""The package's architecture as a rule: sub-packages form layers, and imports only point down.

Read the layers bottom to top: shared basics (errors, files, text, hardware, progress, plots); reasoning models'
thinking told from their answer (text); the backends that run a model;
routing (policies and the router); the core decode loop; tool calls read from a reply and the grammar that holds
a reply to calls (core's structured outputs); loading models into an engine; datasets, answers and
statistics (data); then the clients of an engine
(evaluation; serving and the label pipeline; router training; benchmarks); the command line on top.
A module may import from its own sub-package and from lower layers, never from a layer above or a
sibling at its own layer. Only the command line imports its own package inside functions: that keeps
`r2r --help` from importing torch."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = "roads_to_rome"
ROOT = Path(__file__).parents[1] / PACKAGE
LAYERS = [
    {"errors", "files", "text", "hardware", "progress", "plots"},
    {"reasoning"},
    {"backends"},
    {"routing"},
    {"core"},
    {"tool_calls"},
    {"models"},
    {"data"},
    {"eval"},
    {"serving", "pipeline"},
    {"training"},
    {"bench"},
    {"cli"},
    {"__main__", "__init__"},
]
LAZY_IMPORTS_ALLOWED = {"cli", "__init__"}


def unit(module: str) -> str:
    """The layer unit of a dotted module name: its sub-package, or the top-level module's own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def rank(name: str) -> int:
    for i, layer in enumerate(LAYERS):
        if name in layer:
            return i
    raise AssertionError(f"{name} is in no layer: add it to LAYERS in {__file__}")


def modules() -> dict[str, Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(path: Path) -> list[tuple[str, bool, int]]:
    """(imported module of this package, at module level?, line) for every import in the file."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    for node in tree.body:  # imports under a module-level `if`/`try` count as module level
        if isinstance(node, (ast.If, ast.Try)):
            top |= {id(n) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PACKAGE:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found += [(n, id(node) in top, node.lineno) for n in names]
        elif isinstance(node, ast.Import):
            found += [(a.name, id(node) in top, node.lineno) for a in node.names if a.name.split(".")[0] == PACKAGE]
    return found


MODULES = modules()


def test_every_subpackage_is_in_a_layer():
    for name in MODULES:
        if name != PACKAGE:
            rank(unit(name))


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down(name):
    here = unit(name) if name != PACKAGE else "__init__"
    for target, _, line in imports(MODULES[name]):
        if target not in MODULES or target == PACKAGE:
            continue  # a name imported from a module is checked through the module; the top level is the public API
        there = unit(target) if target != PACKAGE else "__init__"
        if there == here:
            continue
        assert rank(there) < rank(here), (f"{MODULES[name].relative_to(ROOT.parent)}:{line} imports {target}: "
                                          f"{here} (layer {rank(here)}) may import only from layers below it, "
                                          f"not {there} (layer {rank(there)})")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_lazy_imports_of_the_package_outside_the_cli(name):
    here = unit(name) if name != PACKAGE else "__init__"
    if here in LAZY_IMPORTS_ALLOWED:
        return
    lazy = [f"line {line}: {target}" for target, top, line in imports(MODULES[name]) if not top]
    assert not lazy, f"{MODULES[name].relative_to(ROOT.parent)} imports its own package inside functions: {lazy}"


def test_no_import_cycles():
    """Not even for annotations (`TYPE_CHECKING`): a module that names a type from one that imports it is a circle a
    reader has to hold in mind (core's parts take a `Context`, not the `Engine` that drives them)."""
    graph = {name: {t for t, _, _ in imports(path) if t in MODULES and t != name} for name, path in MODULES.items()}
    # A package's __init__ re-exporting its own modules is not a cycle through them.
    for name in graph:
        graph[name] = {t for t in graph[name] if not (name.startswith(t + ".") and t != PACKAGE)}
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


def defined_names(path: Path) -> set[str]:
    """What a module itself defines at its top level: functions, classes and assigned names."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def test_names_are_imported_from_the_module_that_defines_them():
    """A module is no facade for names it imports itself (a package's __init__ may be): everyone imports a name from
    its home, so that a reader finds it there."""
    homes = {name: defined_names(path) for name, path in modules().items() if path.name != "__init__.py"}
    sources = [*ROOT.rglob("*.py"), *(ROOT.parent / "tests").rglob("*.py"), *(ROOT.parent / "scripts").rglob("*.py")]
    borrowed = [f"{path.relative_to(ROOT.parent)}:{node.lineno}: {name} from {node.module}"
                for path in sources for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and node.module in homes
                for name in (alias.name for alias in node.names) if name not in homes[node.module]]
    assert not borrowed


def test_help_and_argument_errors_import_no_torch():
    """`r2r --help`, every command's --help and a bad argument answer through the command's own entry point without
    importing torch, transformers or the hub's client: those take seconds to import."""
    code = ("import sys\nfrom roads_to_rome.cli.main import main\n"
            "for args in (['--help'], ['generate', '--help'], ['bench', 'steps', '--help'],\n"
            "             ['label', 'run', '--help'], ['generate'], ['serve', '--port', 'x'],\n"
            "             ['eval', 'run', '--tasks', 'gsm8k', '--bogus']):\n"
            "    sys.argv = ['r2r', *args]\n"
            "    try:\n        main()\n    except SystemExit as e:\n        print(args, e.code)\n"
            "print(sorted(m for m in ('torch', 'transformers', 'huggingface_hub') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    codes = [line for line in out.splitlines() if line.startswith("[") and line.endswith(("0", "2"))]
    assert [c.rsplit(" ", 1)[1] for c in codes] == ["0"] * 4 + ["2"] * 3, out
    assert out.strip().splitlines()[-1] == "[]"
