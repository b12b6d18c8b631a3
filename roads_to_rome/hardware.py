"""The processor this runs on: its name and instruction-set flags, for speed figures and kernel choices."""

from __future__ import annotations

import functools
import os
import platform


@functools.cache
def cpuinfo() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (none where there is no /proc)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip():  # (a blank line ends the first processor)
                    break
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu() -> tuple[str, frozenset[str]]:
    """The CPU's model name and its flags as /proc/cpuinfo lists them (no flags where there is no /proc)."""
    info = cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine()
    return name, frozenset(info.get("flags", "").split())


def vendor() -> str:
    """The CPU's maker as /proc/cpuinfo names it (GenuineIntel, AuthenticAMD), or "" where there is no /proc."""
    return cpuinfo().get("vendor_id", "")


# MKL, which runs torch's float32 matrix products on x86 CPUs, reads once, when it loads, whether to keep to one
# code path per processor (MKL_CBWR, "conditional numerical reproducibility"). On AMD processors the paths it takes
# without that run a product over a few rows (a batch's decode step, a short catch-up) at about the cost of one row
# each; its AUTO branch stays near the cost of one row, as a weight-bound product should, and costs no more over
# many rows (a prompt). A value the user set stays: MKL_CBWR= (empty) leaves MKL its own choice.
MKL_BRANCH = "MKL_CBWR"


def prefer_reproducible_mkl_on_amd() -> None:
    """Before torch loads: MKL's AUTO branch on an AMD processor, unless MKL_CBWR is already set."""
    if vendor() == "AuthenticAMD":
        os.environ.setdefault(MKL_BRANCH, "AUTO")


def has_amx() -> bool:
    return "amx_int8" in cpu()[1]


def has_native_bf16() -> bool:
    """Whether the CPU computes in bf16 itself (AVX512-BF16 or AMX-BF16). Without it torch emulates bf16 matrix work
    in float32 and converts every operand, several times slower than float32 alone."""
    return not {"avx512_bf16", "amx_bf16"}.isdisjoint(cpu()[1])


def describe_cpu() -> str:
    """Name, family and model numbers (a virtual machine's name, "AMD EPYC" or "Intel Xeon Processor", does not
    tell one generation from the next), widest vector unit (AVX-512 and AVX2-only machines differ about twofold on
    these models) and the cores this process may use."""
    name, flags = cpu()
    family, model = cpuinfo().get("cpu family"), cpuinfo().get("model")
    generation = f"family {family} model {model}" if family and model else None
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
    extra = ["AMX"] if has_amx() else []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{name} ({', '.join(filter(None, [generation, simd, *extra, f'{cores} cores']))})"


def measured_on(engine=None) -> dict:
    """Where a figure comes from, for a results file: the processor, the package's commit (when run from a git
    checkout) and, given an engine, the kernels each model ran on."""
    import subprocess

    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    record = {"processor": describe_cpu(), "commit": done.stdout.strip() if done.returncode == 0 else None}
    if engine is not None:
        record["backends"] = {role: model.kernels for role, model in (("slm", engine.slm), ("llm", engine.llm))
                              if model is not None}
    return record
