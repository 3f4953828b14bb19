"""Compile ``shaders/*.comp`` to ``kvdict_vk/spv/*.spv`` (GLSL → SPIR-V, Vulkan 1.1).

Used three ways: ``python -m kvdict_vk.vk.shader_build [--force]`` in a checkout, the
``build_py`` step of ``setup.py`` (so a wheel ships SPIR-V and needs no compiler — setup.py
loads this file by path, so it must import nothing but the standard library — the variants
come from :mod:`kvdict_vk.vk.abi`, loaded by path the same way there), and lazily by
:mod:`kvdict_vk.vk.spirv` when a checkout's SPIR-V is missing or stale.

A variant is stale when its .spv is missing, older than its source or any file the source
includes, or was built from different text/flags (a content hash in ``manifest.json`` —
checkouts do not preserve mtimes; build bookkeeping, not shipped). ``glslangValidator`` and
``spirv-val`` must be silent: any diagnostic, on either stream, or a non-zero exit is a
:class:`ShaderBuildError`.

Beside the .spv files every build writes ``abi.json`` (:data:`ABI_FILE`) — the embedding
contract, :func:`kvdict_vk.vk.abi.manifest` as JSON (docs/EMBEDDING.md) — whenever its text
differs from the declarations'; it ships in the wheel, ``manifest.json`` does not.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    from ..errors import ShaderBuildError
except ImportError:  # loaded by path from setup.py, outside the package
    class ShaderBuildError(Exception):
        pass
try:
    from . import abi
except ImportError:  # the same: load the declarations (standard library only) by path too
    def _load_abi():
        spec = importlib.util.spec_from_file_location("_kvdict_vk_abi", Path(__file__).resolve().parent / "abi.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
        return module

    abi = _load_abi()

TARGET_ENV = abi.TARGET_ENV  # "vulkan1.1"
PACKAGE_DIR = Path(__file__).resolve().parent.parent  # …/kvdict_vk
SHADER_DIR = PACKAGE_DIR.parent / "shaders"  # exists in a checkout only
SPV_DIR = PACKAGE_DIR / "spv"
MANIFEST = "manifest.json"  # build hashes (staleness), not package data
ABI_FILE = "abi.json"  # the embedding contract (abi.manifest()), package data

# output name → (source file, preprocessor defines): from the one declaration of every variant
VARIANTS: dict[str, tuple[str, dict]] = abi.VARIANTS


def in_checkout() -> bool:
    """True in a source tree (or sdist) — there the SPIR-V is built from ``shaders/``."""
    return (PACKAGE_DIR.parent / "pyproject.toml").is_file() and (SHADER_DIR / "common.glsl").is_file()


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def includes(source: Path, seen: set | None = None) -> list[Path]:
    """Every file ``source`` includes, recursively (quoted includes, relative to it)."""
    seen = set() if seen is None else seen
    out = []
    for name in _INCLUDE.findall(source.read_text()):
        inc = (source.parent / name).resolve()
        if inc in seen:
            continue
        if not inc.is_file():
            raise ShaderBuildError(f"{source.name}: included file {name} not found")
        seen.add(inc)
        out += [inc] + includes(inc, seen)
    return out


def _flags(defines: dict) -> list[str]:
    return ["-V", "--target-env", TARGET_ENV] + [f"-D{k}={v}" for k, v in sorted(defines.items())]


def _digest(source: Path, defines: dict) -> str:
    h = hashlib.sha256(" ".join(_flags(defines)).encode())
    for f in [source] + includes(source):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        raise ShaderBuildError(f"{name} not found on PATH (Debian: apt-get install "
                               f"{'glslang-tools' if name.startswith('glslang') else 'spirv-tools'})")
    return path


def _run_silent(cmd: list[str], what: str, allowed_stdout: tuple[str, ...] = ()) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    # glslangValidator echoes the input file name on stdout; anything else is a diagnostic.
    noise = [l for l in proc.stdout.splitlines() if l.strip() and l.strip() not in allowed_stdout]
    if proc.returncode != 0 or proc.stderr.strip() or noise:
        msg = "\n".join(noise + proc.stderr.strip().splitlines())
        raise ShaderBuildError(f"{what} failed (exit {proc.returncode}):\n{msg}")


def compile_variant(name: str, shader_dir: Path, out_dir: Path) -> Path:
    source_name, defines = VARIANTS[name]
    source = shader_dir / source_name
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".spv", dir=out_dir)
    os.close(fd)
    try:
        _run_silent([_tool("glslangValidator"), *_flags(defines), "-o", tmp, str(source)],
                    f"glslangValidator {source_name} ({name})", (str(source), source.name))
        _run_silent([_tool("spirv-val"), "--target-env", TARGET_ENV, tmp], f"spirv-val {name}.spv")
        target = out_dir / f"{name}.spv"
        os.replace(tmp, target)
        return target
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _manifest(out_dir: Path) -> dict:
    try:
        return json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}


def stale(shader_dir: Path = SHADER_DIR, out_dir: Path = SPV_DIR) -> list[str]:
    """Names of the variants that need (re)building."""
    manifest = _manifest(out_dir)
    out = []
    for name, (source_name, defines) in VARIANTS.items():
        source = shader_dir / source_name
        spv = out_dir / f"{name}.spv"
        if not source.is_file():
            raise ShaderBuildError(f"shader source {source} not found")
        if not spv.is_file():
            out.append(name)
            continue
        newest = max(f.stat().st_mtime for f in [source] + includes(source))
        if newest > spv.stat().st_mtime or manifest.get(name) != _digest(source, defines):
            out.append(name)
    return out


def abi_json() -> str:
    """abi.json's text: the declarations' manifest, deterministic (what build writes)."""
    return json.dumps(abi.manifest(), indent=1) + "\n"


def write_abi(out_dir: Path = SPV_DIR) -> bool:
    """Write ``out_dir/abi.json`` if its text differs from :func:`abi_json`; True if written."""
    out_dir, text = Path(out_dir), abi_json()
    target = out_dir / ABI_FILE
    try:
        if target.read_text() == text:
            return False
    except OSError:
        pass
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{ABI_FILE}.{os.getpid()}.tmp"
    tmp.write_text(text)
    os.replace(tmp, target)
    return True


def build(shader_dir: Path = SHADER_DIR, out_dir: Path = SPV_DIR, *, force: bool = False) -> list[str]:
    """(Re)build the stale variants (all with ``force``), and abi.json where it differs;
    returns the names built."""
    shader_dir, out_dir = Path(shader_dir), Path(out_dir)
    names = list(VARIANTS) if force else stale(shader_dir, out_dir)
    manifest = _manifest(out_dir)
    for name in names:
        compile_variant(name, shader_dir, out_dir)
        source_name, defines = VARIANTS[name]
        manifest[name] = _digest(shader_dir / source_name, defines)
    if names:
        (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    write_abi(out_dir)
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true", help="rebuild every variant")
    ap.add_argument("--shaders", type=Path, default=SHADER_DIR)
    ap.add_argument("--out", type=Path, default=SPV_DIR)
    args = ap.parse_args(argv)
    try:
        built = build(args.shaders, args.out, force=args.force)
    except ShaderBuildError as e:
        print(f"shader build failed: {e}", file=sys.stderr)
        return 1
    print(f"built {len(built)} of {len(VARIANTS)} SPIR-V variants into {args.out}"
          + (f": {', '.join(built)}" if built else " (all up to date)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
