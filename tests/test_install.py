"""The package as users install it: the tests run the installed wheel (under `make test`), the core needs none of
the extras' dependencies, and a command whose extra is missing says which pip command adds it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import roads_to_rome
from roads_to_rome.errors import EXTRA_MODULES

OPTIONAL_MODULES = sorted({m for modules in EXTRA_MODULES.values() for m in modules})


def test_the_tests_run_the_installed_wheel_with_its_package_data():
    if not os.environ.get("R2R_TEST_INSTALLED"):
        pytest.skip("`make test` sets R2R_TEST_INSTALLED=1 and runs the installed wheel")
    package = Path(roads_to_rome.__file__).parent
    assert "site-packages" in package.parts, package
    assert list((package / "models" / "routers").glob("*/router.safetensors"))
    assert (package / "serving" / "playground.html").exists()
    assert list((package / "pipeline" / "data").glob("*.jsonl"))


BLOCK = f"""
import sys
from importlib.abc import MetaPathFinder
BLOCKED = {OPTIONAL_MODULES!r}
class Block(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: an extra's dependency)")
sys.meta_path.insert(0, Block())
"""


def run_blocked(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent)


def test_the_core_needs_no_extra():
    """The engine, backends (their Python side), routing, loading, generate and chat import without any extra."""
    done = run_blocked("""
import roads_to_rome.core.engine, roads_to_rome.backends.torch_backend, roads_to_rome.backends.remote
import roads_to_rome.backends.llamacpp, roads_to_rome.routing.policies, roads_to_rome.models.loading
from roads_to_rome import Engine, SamplingParams, load_engine, load_pair
from roads_to_rome.cli import main
sys.argv = ["r2r", "generate", "--help"]
try:
    main.main()
except SystemExit as e:
    assert e.code in (0, None), e.code
print("core ok")
""")
    assert done.returncode == 0 and "core ok" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("args, extra", [(["serve"], "serve"), (["eval", "--benchmark", "gsm8k"], "eval"),
                                         (["label", "report", "x"], "labels"), (["train", "x", "--out", "y"], "labels"),
                                         (["bench", "steps"], "eval")])
def test_a_missing_extra_is_a_one_line_error_naming_pip(args, extra):
    done = run_blocked(f"""
from roads_to_rome.cli import main
sys.argv = ["r2r", *{args!r}]
main.main()
""")
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and f'pip install "roads-to-rome[{extra}]"' in lines[0], done.stderr


def test_set_up_builds_llama_cpp_once_per_processor_and_without_amx_where_it_has_amx(tmp_path):
    """scripts/install-llama-cpp.sh with a pip that only records what it was asked: a wheel per processor (never
    one built for another CPU), AMX compiled out on AMX CPUs, the kept wheel installed without a rebuild; `build`
    only builds (what `make test` runs beside the model downloads), installing nothing; never the multimodal library
    nor llama.cpp's common one; a checkout in another folder reuses the kept wheel."""
    log = tmp_path / "pip.log"
    pip = tmp_path / "pip"
    pip.write_text(f"""#!/bin/sh
echo "$1 CMAKE_ARGS=${{CMAKE_ARGS:-}} $*" >> {log}
if [ "$1" = wheel ]; then
    while [ "$1" != --wheel-dir ]; do shift; done
    mkdir -p "$2" && touch "$2/llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl"
fi
""")
    pip.chmod(0o755)
    script = Path(__file__).parents[1] / "scripts/install-llama-cpp.sh"

    def set_up(flags, *only, script=script):
        env = {**os.environ, "R2R_CPU_FLAGS": flags, "XDG_CACHE_HOME": str(tmp_path / "cache")}
        subprocess.run(["sh", str(script), "0.3.36", str(pip), *only], env=env, check=True, capture_output=True)
        calls = log.read_text().splitlines() if log.exists() else []
        log.unlink(missing_ok=True)
        return calls

    avx512 = "flags : fpu sse2 avx2 avx512f avx512_vnni"
    amx = avx512 + " amx_tile amx_int8 amx_bf16"
    first = set_up(avx512)
    assert [c.split()[0] for c in first] == ["wheel", "install", "install"] and "-mno-amx" not in first[0]
    assert "--no-cache-dir" in first[0]  # never a wheel from pip's cache, which keys by version only
    assert "-DLLAVA_BUILD=OFF" in first[0]  # text only: llama-cpp-python's multimodal library is not built
    include = script.parent / "llama-cpp-without-common.cmake"  # nor llama.cpp's common library, which it never loads
    assert f"-DCMAKE_PROJECT_llama.cpp_INCLUDE='{include}'" in first[0]
    assert "set(LLAMA_BUILD_COMMON OFF)" in include.read_text().splitlines()
    elsewhere = tmp_path / "another checkout/scripts"  # (a space in its path, too)
    elsewhere.mkdir(parents=True)
    for file in (script, include):
        (elsewhere / file.name).write_bytes(file.read_bytes())
    assert [c.split()[0] for c in set_up(avx512, script=elsewhere / script.name)] == ["install", "install"]
    assert [c.split()[0] for c in set_up(avx512)] == ["install", "install"]  # kept for this processor: no rebuild
    on_amx = set_up(amx)  # another processor: its own build, with AMX compiled out
    assert [c.split()[0] for c in on_amx] == ["wheel", "install", "install"]
    assert "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" in on_amx[0]
    zen3 = "flags : fpu sse2 avx2 fma"
    assert [c.split()[0] for c in set_up(zen3, "build")] == ["wheel"]  # built, not installed
    assert set_up(zen3, "build") == []  # kept: nothing to do
    assert [c.split()[0] for c in set_up(zen3)] == ["install", "install"]  # then installed, not built again
    wheels = sorted(p.parent.name for p in (tmp_path / "cache/r2r/wheels").glob("*/*.whl"))
    assert len(wheels) == 3 and all(w.startswith("llama-cpp-python-0.3.36-") for w in wheels)


def test_set_up_links_torch_into_vllms_venv_as_pip_recorded_it(tmp_path):
    """scripts/link-installed.py: a distribution's recorded files, compiled modules included, hard-linked into
    another venv, whose python then finds it installed (so its pip does not unpack and compile it again); a script
    outside site-packages is left out; a distribution that is not installed is one line of error."""
    site = tmp_path / "here/lib/site-packages"
    files = {"pkg/__init__.py": "VALUE = 1\n", "pkg/__pycache__/__init__.cpython-311.pyc": "compiled",
             "pkg-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n"}
    for name, text in files.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_text(text)
    (tmp_path / "here/bin").mkdir()
    (tmp_path / "here/bin/pkg-run").write_text("#!/here/bin/python\n")
    record = [*files, "pkg-1.0.dist-info/RECORD", "../../bin/pkg-run"]
    (site / "pkg-1.0.dist-info/RECORD").write_text("".join(f"{name},,\n" for name in record))
    venv = tmp_path / "vllm venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    script = Path(__file__).parents[1] / "scripts/link-installed.py"
    env = {**os.environ, "PYTHONPATH": str(site)}

    def link(name):
        return subprocess.run([sys.executable, str(script), name, str(venv)], env=env, capture_output=True, text=True)

    done = link("pkg")
    assert done.returncode == 0 and "4 files linked" in done.stdout, done.stderr
    python = venv / "bin/python"
    target = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, check=True).stdout.strip())
    for name in [*files, "pkg-1.0.dist-info/RECORD"]:
        assert (target / name).stat().st_ino == (site / name).stat().st_ino, name  # the same file, not a copy
    assert not list(venv.rglob("pkg-run"))
    found = subprocess.run([python, "-c", "import importlib.metadata as m, pkg; print(m.version('pkg'), pkg.VALUE)"],
                           capture_output=True, text=True, check=True).stdout.split()
    assert found == ["1.0", "1"]
    assert link("pkg").returncode == 0  # again, over its own links
    missing = link("no-such-dist")
    assert missing.returncode == 1 and missing.stderr.strip().splitlines() == [
        f"error: no-such-dist is not installed in {sys.prefix}: install it there first"]
