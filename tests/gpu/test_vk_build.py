"""Shader build (glslangValidator + spirv-val), staleness, SPIR-V reflection, wheel data."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdict_vk import errors as E
from kvdict_vk.vk import abi
from kvdict_vk.vk import shader_build as sb
from kvdict_vk.vk import spirv

ROOT = Path(__file__).resolve().parents[2]
needs_tools = pytest.mark.skipif(shutil.which("glslangValidator") is None or shutil.which("spirv-val") is None,
                                 reason="glslangValidator/spirv-val not installed")


@pytest.fixture
def shader_copy(tmp_path):
    src = tmp_path / "shaders"
    shutil.copytree(sb.SHADER_DIR, src)
    return src, tmp_path / "spv"


@needs_tools
def test_build_all_then_nothing_stale(shader_copy):
    src, out = shader_copy
    built = sb.build(src, out)
    assert sorted(built) == sorted(sb.VARIANTS)
    for name in sb.VARIANTS:
        data = (out / f"{name}.spv").read_bytes()
        assert int.from_bytes(data[:4], "little") == spirv.MAGIC
    assert sb.stale(src, out) == [] and sb.build(src, out) == []


@needs_tools
def test_staleness_follows_sources_and_includes(shader_copy):
    src, out = shader_copy
    sb.build(src, out)
    time.sleep(0.01)
    (src / "copy.comp").write_text((src / "copy.comp").read_text() + "\n// touched\n")
    assert sorted(sb.stale(src, out)) == ["copy_scalar", "copy_vec4"]
    sb.build(src, out)
    (src / "common.glsl").write_text((src / "common.glsl").read_text() + "\n// touched\n")
    assert sorted(sb.stale(src, out)) == sorted(sb.VARIANTS)  # every shader includes it
    # content hash, not only mtimes: an older .spv built from other text is stale too
    sb.build(src, out)
    past = time.time() - 3600
    (src / "scatter.comp").write_text((src / "scatter.comp").read_text() + "\n// older edit\n")
    os.utime(src / "scatter.comp", (past, past))
    assert sb.stale(src, out) == ["scatter"]


@needs_tools
def test_diagnostics_fail_the_build(shader_copy):
    src, out = shader_copy
    text = (src / "copy.comp").read_text()
    (src / "copy.comp").write_text(text.replace("void main() {", "void main() { undeclared_thing = 1;"))
    with pytest.raises(E.ShaderBuildError, match="undeclared_thing"):
        sb.compile_variant("copy_vec4", src, out)
    # a warning is enough to fail: glslang only warns about an unknown '#extension … : warn'
    (src / "copy.comp").write_text(text.replace("#include", "#extension GL_KVDICT_nonexistent : warn\n#include", 1))
    with pytest.raises(E.ShaderBuildError, match="WARNING"):
        sb.compile_variant("copy_vec4", src, out)
    assert not list(out.glob("*.spv")), "a failed build must leave no .spv behind"


def test_missing_compiler_is_typed(shader_copy, monkeypatch):
    src, out = shader_copy
    monkeypatch.setenv("PATH", "")
    with pytest.raises(E.ShaderBuildError, match="glslangValidator not found"):
        sb.compile_variant("scatter", src, out)


@pytest.mark.parametrize("name", sorted(sb.VARIANTS))
def test_shipped_spirv_matches_its_contract(name):
    import kvdict_vk.vk.attend.specs  # noqa: F401 (the wings register their variants)
    import kvdict_vk.vk.encode.specs  # noqa: F401
    import kvdict_vk.vk.forward.specs  # noqa: F401
    from kvdict_vk.vk.kernels import SHADERS
    code = spirv.load(name)
    r = spirv.reflect(code)
    spec = SHADERS[name]
    # Shader capability only (and the subgroup classes a variant declares), no extension, ≤ 128
    # invocations
    spirv.check_portable(name, r, subgroup_ops=spec.subgroup_ops, features=spec.features)
    if not spec.subgroup_ops and not spec.features:
        assert r.capabilities == (1,)
    for f in spec.features:  # a declared feature is one the module uses
        assert set(abi.FEATURE_CAPABILITIES[f][0]) & set(r.capabilities), (f, r.capabilities)
    assert r.local_size == (64, 1, 1)
    assert len(r.bindings) == len(spec.lanes)
    assert r.push_constant_bytes == spec.push.size_bytes
    assert r.spec_ids == tuple(range(len(spec.spec_names)))
    assert abi.SHADER_PUSH_BLOCKS[sb.VARIANTS[name][0]] is spec.push


def test_spv_dir_override_is_read_at_every_load(tmp_path, monkeypatch):
    """$KVDICT_VK_SPV_DIR replaces a variant while it is set, and only then — also after the
    shipped module was loaded in the same process and the other way round (the variants
    probes switch directories between kernels)."""
    shipped = spirv.load("scatter")
    other = spirv.load("copy_scalar")
    assert other != shipped
    (tmp_path / "scatter.spv").write_bytes(other)
    monkeypatch.setenv(spirv.SPV_DIR_ENV, str(tmp_path))
    assert spirv.load("scatter") == other
    assert spirv.load("copy_scalar") == other  # not in the directory: the shipped one
    monkeypatch.delenv(spirv.SPV_DIR_ENV)
    assert spirv.load("scatter") == shipped
    (tmp_path / "scatter.spv").write_bytes(b"\x03\x02\x23")
    monkeypatch.setenv(spirv.SPV_DIR_ENV, str(tmp_path))
    with pytest.raises(E.ShaderBuildError, match="not a SPIR-V module"):
        spirv.load("scatter")


def test_unknown_variant_is_typed():
    with pytest.raises(E.ShaderBuildError):
        spirv.load("no_such_shader")


@needs_tools
def test_setup_build_py_ships_spirv(tmp_path):
    """`setup.py build_py` compiles the shaders and puts the SPIR-V into the build tree,
    so a wheel built from it needs no compiler."""
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shipped = sorted(p.stem for p in (tmp_path / "kvdict_vk" / "spv").glob("*.spv"))
    assert shipped == sorted(sb.VARIANTS)
