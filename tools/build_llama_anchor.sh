#!/usr/bin/env bash
# Builds llama.cpp's test-backend-ops and llama-bench with its Vulkan backend: for
# kvdict_vk.bench.llama_fa (the anchor: ggml-vulkan's flash attention on the device our
# attention runs on) and kvdict_vk.bench.generate (its tokens/s on the same GGUF and depth).
#
#   bash tools/build_llama_anchor.sh [OUT_DIR]     # default .llama/ (git-ignored)
#
# The source is the llama.cpp that PyPI's llama-cpp-python sdist vendors (LLAMA_PY_VERSION),
# built on Debian 12 (apt-get install cmake g++ glslc spirv-headers libvulkan-dev) into one
# stripped binary with libstdc++ linked in, so it runs on a machine that has only a Vulkan
# loader (the H200's: carry OUT_DIR beside .bundle). Two edits, both applied here:
#  * test-backend-ops' perf cases get the decode cases kvdict_vk.bench.llama_fa's presets time
#    (its decode_cases(): one query row, no mask, K and V of one type), which it selects by mask=0;
#  * with the system's headers on Debian 12 (1.3.239), ggml-vulkan's instance creation drops
#    VK_EXT_layer_settings' structure (only used with its validation option), undeclared there.
# Debian 12's glslc (shaderc 2023.2) compiles none of ggml-vulkan's cooperative-matrix or
# integer-dot shaders (its cmake says which), and its Vulkan headers (1.3.239) declare none of
# the C++ side of them: a build with them leaves ggml-vulkan's scalar paths only. So by default
# (LLAMA_SHADER_TOOLS=trixie) glslc 2025.2 and the Vulkan 1.4.309 headers come from Debian 13
# (apt-get download into the build directory, nothing installed; glslc runs through Debian 13's
# own loader and libc, unpacked beside it) and every shader path ggml-vulkan has is built: it
# picks among them per device as it does for any user (the binary prints its choice, "matrix
# cores: …", which the benchmark records). LLAMA_SHADER_TOOLS=system builds with the
# machine's glslc and headers instead (scalar paths on Debian 12).
set -euo pipefail
LLAMA_PY_VERSION=${LLAMA_PY_VERSION:-0.3.36}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$(mkdir -p "${1:-$root/.llama}" && cd "${1:-$root/.llama}" && pwd)
work=${LLAMA_BUILD_DIR:-/tmp/llama-anchor-build}
mkdir -p "$work"
py=${PYTHON:-$root/.venv/bin/python}  # imports kvdict_vk (numpy) for the cases
if [ ! -d "$work/llama_cpp_python-$LLAMA_PY_VERSION" ]; then
  "$py" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_PY_VERSION" -d "$work"
  tar -xzf "$work/llama_cpp_python-$LLAMA_PY_VERSION.tar.gz" -C "$work"
fi
src="$work/llama_cpp_python-$LLAMA_PY_VERSION/vendor/llama.cpp"
tools_args=()
if [ "${LLAMA_SHADER_TOOLS:-trixie}" = trixie ]; then
  t="$work/trixie"
  if [ ! -x "$t/glslc" ]; then
    mkdir -p "$t/lists/partial" "$t/cache/archives/partial" "$t/debs" "$t/root"
    echo "deb http://deb.debian.org/debian trixie main" > "$t/sources.list"
    apt_opts=(-o "Dir::Etc::sourcelist=$t/sources.list" -o Dir::Etc::sourceparts=- -o "Dir::State::Lists=$t/lists"
              -o "Dir::Cache=$t/cache" -o APT::Get::List-Cleanup=0)
    apt-get "${apt_opts[@]}" update > "$t/apt.log"
    (cd "$t/debs" && apt-get "${apt_opts[@]}" download glslc libshaderc1 libc6 libstdc++6 libgcc-s1 \
        libvulkan-dev spirv-headers >> "$t/apt.log")
    for deb in "$t"/debs/*.deb; do dpkg-deb -x "$deb" "$t/root"; done
    lib="$t/root/lib/x86_64-linux-gnu:$t/root/usr/lib/x86_64-linux-gnu"
    printf '#!/bin/sh\nexec "%s" --library-path "%s" "%s" "$@"\n' \
      "$t/root/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" "$lib" "$t/root/usr/bin/glslc" > "$t/glslc"
    chmod +x "$t/glslc"
  fi
  "$t/glslc" --version | sed -n 1p >&2  # sed reads it all: head would end it by SIGPIPE (pipefail)
  tools_args=("-DVulkan_GLSLC_EXECUTABLE=$t/glslc" "-DVulkan_INCLUDE_DIR=$t/root/usr/include"
              "-DSPIRV-Headers_DIR=$t/root/usr/share/cmake/SPIRV-Headers")  # newer ggml-vulkan finds it by cmake
fi
"$py" - "$src" "${LLAMA_SHADER_TOOLS:-trixie}" "$root" <<'EOF'
import sys
from pathlib import Path
src = Path(sys.argv[1])
sys.path.insert(0, sys.argv[3])
from kvdict_vk.bench.llama_fa import decode_cases
ops = src / "tests" / "test-backend-ops.cpp"
s = ops.read_text()
mark = "// kvdict_vk's decode shapes"
anchor = "    for (int col : {8192, 16384, 32768, 65536, 131072, 262144, 524288}) {"
assert s.count(anchor) == 1, "test-backend-ops.cpp changed: find make_test_cases_perf's place again"
if mark in s:  # an earlier run's cases: replaced by this script's
    s = s[:s.index("    " + mark)] + s[s.index(anchor):]
cases = f"    {mark} (one query row, no mask: kvdict_vk.bench.llama_fa selects them by mask=0)\n"
for cache, n_kv, gqa, d, n in decode_cases():
    t = "GGML_TYPE_" + cache.upper()
    cases += (f"    test_cases.emplace_back(new test_flash_attn_ext({d}, {d}, {n_kv}, {{{gqa}, 1}}, {n}, 1, false, false, "
              f"0, 0, GGML_PREC_F32, {t}, {t}, {{0, 1, 2, 3}}, false, false));\n")
cases += "\n"
ops.write_text(s.replace(anchor, cases + anchor))
vk = src / "ggml" / "src" / "ggml-vulkan" / "ggml-vulkan.cpp"
s = vk.read_text()
head = "    VkBool32 enable_best_practice = layer_settings;"
tail = "vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions, &layer_setting_info);"
if head in s and sys.argv[2] == "system":
    a, b = s.index(head), s.index(tail) + len(tail)
    s = s[:a] + ("    // Debian 12's Vulkan headers lack VK_EXT_layer_settings' types (kvdict_vk's anchor build)\n"
                 "    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions);") + s[b:]
    vk.write_text(s)
EOF
cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_VULKAN=ON -DLLAMA_BUILD_TESTS=ON \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON \
  "-DCMAKE_EXE_LINKER_FLAGS=-static-libstdc++ -static-libgcc" "${tools_args[@]}" > "$work/cmake.log"
grep -E "not supported by glslc|supported by glslc" "$work/cmake.log" >&2 || true
cmake --build "$src/build" --target test-backend-ops llama-bench -j "$(nproc)" > "$work/build.log"
strip -o "$out/test-backend-ops" "$src/build/bin/test-backend-ops"
strip -o "$out/llama-bench" "$src/build/bin/llama-bench"
echo "$out/test-backend-ops  (llama-cpp-python $LLAMA_PY_VERSION; set KVDICT_LLAMA_TEST_BACKEND_OPS to it)"
echo "$out/llama-bench  (the same build; kvdict_vk.bench.generate --llama-bench)"
