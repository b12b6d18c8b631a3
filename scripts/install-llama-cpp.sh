#!/bin/sh
# Installs llama-cpp-python built for this processor: `install-llama-cpp.sh VERSION PIP [build]`. With `build` it
# only builds the wheel where this processor has none (pip wheel writes nothing into PIP's environment, so the
# set-up runs it beside the model downloads), and a later call without it installs the kept wheel.
#
# llama.cpp compiles for the CPU it is built on (-march=native), so a wheel must not be reused on another
# processor, and pip's own cache keys wheels by version only. The wheel is kept under a key made of the
# version and the CPU's flags instead, and built (minutes) only when this processor has none.
#
# On CPUs with AMX (Intel Sapphire Rapids and later), llama.cpp's AMX matmul crashes the process at the first
# decode (0.3.36); a build with AMX compiled out keeps the repacked AVX-512 layouts, which the backend then
# turns on (backends/llamacpp.py reads what the build compiled in).
#
# The multimodal library (mtmd, LLAVA_BUILD) is left out: this project reads text only. So is llama.cpp's "common"
# library, which llama-cpp-python builds but never loads (llama-cpp-without-common.cmake says how): together half
# the build.
set -eu
version=$1
pip=$2
only=${3:-}
flags=${R2R_CPU_FLAGS:-$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || uname -m)}  # (the variable: for tests)
without_common="$(cd "$(dirname "$0")" && pwd)/llama-cpp-without-common.cmake"
export CMAKE_ARGS="-DLLAVA_BUILD=OFF ${CMAKE_ARGS:-}"
# the key: a user's own build options too, and the include file's text rather than its path (a checkout's place)
key=$(printf '%s\n%s\n%s\n%s\n' "$version" "$flags" "$CMAKE_ARGS" "$(cat "$without_common")" | sha256sum | cut -c1-16)
export CMAKE_ARGS="$CMAKE_ARGS -DCMAKE_PROJECT_llama.cpp_INCLUDE='$without_common'"
dir="${XDG_CACHE_HOME:-$HOME/.cache}/r2r/wheels/llama-cpp-python-$version-$key"
if ! ls "$dir"/llama_cpp_python-*.whl >/dev/null 2>&1; then
    case "$flags" in
        *amx_int8*)
            no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
            export CMAKE_ARGS="$CMAKE_ARGS -DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'"
            echo "this CPU has AMX: building llama.cpp without it (its AMX kernels crash), repacked layouts kept";;
    esac
    echo "building llama-cpp-python $version for this processor (minutes; kept in $dir)"
    rm -rf "$dir.partial"
    "$pip" wheel --quiet --no-cache-dir --no-deps --wheel-dir "$dir.partial" "llama-cpp-python==$version"
    rm -rf "$dir" && mv "$dir.partial" "$dir"
fi
[ "$only" = build ] && exit 0
wheel=$(ls "$dir"/llama_cpp_python-*.whl)
"$pip" install --quiet --no-deps --force-reinstall "$wheel"  # this build, even over the same version
"$pip" install --quiet "$wheel"  # and what it needs (numpy, diskcache, jinja2...)
