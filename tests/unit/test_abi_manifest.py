"""The embedding contract (kvdict_vk/spv/abi.json, docs/EMBEDDING.md): every variant's entry
agrees with its built SPIR-V's reflection, the file on disk is the declarations' manifest
(a stale one fails), it is package data, `kvdict-validate --abi` prints it, and the
comparison catches a wrong entry."""
from __future__ import annotations

import copy
import importlib.resources
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvdict_vk.cli import validate
from kvdict_vk.vk import abi, shader_build as sb, spirv

ROOT = next(d for d in Path(__file__).resolve().parents if (d / "pyproject.toml").is_file())
_CAP_SHADER = 1


def _shipped() -> dict:
    """abi.json as the package holds it (a checkout rebuilds stale SPIR-V and abi.json first)."""
    spirv._ensure_built()
    return json.loads((importlib.resources.files("kvdict_vk") / "spv" / sb.ABI_FILE).read_text())


def mismatches(entry: dict, r: spirv.Reflection) -> list[str]:
    """Where a manifest entry disagrees with its module's reflection (empty: agrees)."""
    bad = []

    def check(what, want, got):
        if want != got:
            bad.append(f"{entry.get('name')}: {what}: manifest {want!r}, SPIR-V {got!r}")

    # bindings: set 0, numbers 0..n-1, each's block, array stride (element width), writability
    binds = entry["bindings"]
    check("bindings", [(b["set"], b["binding"]) for b in binds], list(r.bindings))
    for b, (block, words, writable) in zip(binds, r.buffers):
        n = f"binding {b['binding']}"
        check(f"{n} block", b["block"], block)
        check(f"{n} element_words", b["element_words"], words)
        check(f"{n} element_bytes", b["element_bytes"], words * abi.WORD_BYTES)
        check(f"{n} readonly (NonWritable)", b["access"] == "readonly", not writable)
        check(f"{n} access", b["access"] in ("readonly", "readwrite", "writeonly"), True)
    # push constants: struct, size, each field's offset, size and type
    pc = entry["push_constants"]
    check("push struct", pc["struct"], r.push_block)
    check("push size_bytes", pc["size_bytes"], r.push_constant_bytes)
    check("push fields", [(f["offset"], abi.WORD_BYTES, f["type"]) for f in pc["fields"]], list(r.push_members))
    # specialization constants: ids and types
    spec = entry["specialization_constants"]
    check("spec constant ids", [s["constant_id"] for s in spec], list(r.spec_ids))
    check("spec constant types", [s["type"] for s in spec], list(r.spec_types))
    # workgroup size: LocalSize (the literal default) and LocalSizeId's constant
    wg = entry["workgroup_size"]
    check("LocalSize", (wg["x"] if wg["x"] is not None else wg["x_default"], wg["y"], wg["z"]), r.local_size)
    check("local_size_x_id", wg["x_constant_id"], r.local_size_spec_id)
    if wg["x_constant_id"] is not None:
        check("x_constant", spec[wg["x_constant_id"]]["name"] if wg["x_constant_id"] < len(spec) else None,
              wg["x_constant"])
    # required features: the subgroup capabilities are exactly the declared classes', the others
    # Shader and the declared features' (their capabilities and extensions)
    used = sorted(spirv.SUBGROUP_CAPABILITIES[c] for c in set(r.capabilities) if c in spirv.SUBGROUP_CAPABILITIES)
    check("subgroup_operations", sorted(entry["required_features"]["subgroup_operations"]), used)
    req = entry["required_features"]
    check("other capabilities", sorted(set(r.capabilities) - set(spirv.SUBGROUP_CAPABILITIES)),
          sorted([_CAP_SHADER] + req["spirv_capabilities"]))
    check("extensions", sorted(r.extensions), req["spirv_extensions"])
    return bad


@pytest.fixture(scope="module")
def shipped() -> dict:
    return _shipped()


def test_abi_json_on_disk_is_the_declarations_manifest(shipped):
    assert shipped == abi.manifest(), "kvdict_vk/spv/abi.json is stale: python -m kvdict_vk.vk.shader_build"
    assert (sb.SPV_DIR / sb.ABI_FILE).read_text() == sb.abi_json()  # byte for byte, as build writes it


def test_manifest_is_json_with_its_schema(shipped):
    text = sb.abi_json()
    assert json.loads(text) == shipped
    assert shipped["schema"] == "kvdict_vk.abi" and shipped["schema_version"] == abi.ABI_SCHEMA_VERSION == 2
    assert shipped["target_env"] == sb.TARGET_ENV == "vulkan1.1" and shipped["word_bytes"] == 4
    assert list(shipped["variants"]) == list(abi.DECLARATIONS) and set(shipped["variants"]) == set(sb.VARIANTS)
    for name, e in shipped["variants"].items():
        assert e["name"] == name and e["spv"] == f"{name}.spv" and e["source"] == abi.DECLARATIONS[name].source
        assert {"bindings", "push_constants", "specialization_constants", "workgroup_size",
                "required_features", "defines"} <= set(e)
        assert all(s["required"] != ("default" in s) for s in e["specialization_constants"])
        assert set(e["required_features"]["features"]) <= set(shipped["optional_features"])


@pytest.mark.parametrize("name", sorted(abi.DECLARATIONS))
def test_manifest_entry_matches_the_spirv(shipped, name):
    entry = shipped["variants"][name]
    data = (importlib.resources.files("kvdict_vk") / "spv" / entry["spv"]).read_bytes()
    assert mismatches(entry, spirv.reflect(data)) == []


def test_a_wrong_entry_is_caught(shipped):
    name = "attend_flash_sg"  # bindings of both widths, a float push field, LOCAL, subgroup ops
    good = shipped["variants"][name]
    r = spirv.reflect(spirv.load(name))
    assert mismatches(good, r) == []

    def broken(edit):
        e = copy.deepcopy(good)
        edit(e)
        return mismatches(e, r)

    edits = {
        "element_words": lambda e: e["bindings"][1].update(element_words=1, element_bytes=4),
        "binding": lambda e: e["bindings"].pop(),
        "readonly": lambda e: e["bindings"][3].update(access="readonly"),
        "block": lambda e: e["bindings"][0].update(block="Cache"),
        "push size_bytes": lambda e: e["push_constants"].update(size_bytes=36),
        "push fields": lambda e: e["push_constants"]["fields"][-1].update(offset=32),
        "push fields ": lambda e: e["push_constants"]["fields"][-1].update(type="uint32"),
        "spec constant ids": lambda e: e["specialization_constants"].pop(),
        "spec constant types": lambda e: e["specialization_constants"][4].update(type="bool"),
        "local_size_x_id": lambda e: e["workgroup_size"].update(x_constant_id=None, x=64),
        "subgroup_operations": lambda e: e["required_features"].update(subgroup_operations=["basic"]),
    }
    for what, edit in edits.items():
        found = broken(edit)
        assert any(what.strip() in m for m in found), (what, found)


def test_build_regenerates_a_stale_abi_json(tmp_path):
    assert sb.write_abi(tmp_path) is True and sb.write_abi(tmp_path) is False
    (tmp_path / sb.ABI_FILE).write_text(sb.abi_json().replace('"schema_version": 2', '"schema_version": 1'))
    assert sb.write_abi(tmp_path) is True
    assert (tmp_path / sb.ABI_FILE).read_text() == sb.abi_json()
    assert (tmp_path / sb.MANIFEST).exists() is False  # the build hashes are another file


def test_abi_json_is_package_data_and_manifest_json_is_not():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kvdict_vk"]
    assert "spv/abi.json" in data
    assert not any(p in data for p in ("spv/*.json", "spv/*", "spv/manifest.json"))


def test_validate_cli_prints_it(capsys, shipped):
    assert validate.main(["--abi"]) == 0
    assert json.loads(capsys.readouterr().out) == shipped


def test_manifest_needs_no_numpy(tmp_path):
    """setup.py's path: shader_build (and abi) loaded by file path write abi.json without numpy."""
    code = (f"import importlib.util, sys, pathlib\n"
            f"s = importlib.util.spec_from_file_location('sb', {str(ROOT / 'kvdict_vk' / 'vk' / 'shader_build.py')!r})\n"
            f"m = importlib.util.module_from_spec(s); s.loader.exec_module(m)\n"
            f"m.write_abi(pathlib.Path('out'))\n"
            f"assert 'numpy' not in sys.modules\n")
    out = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "out" / "abi.json").read_text()) == abi.manifest()


def test_embedding_page_offsets_are_the_declarations():
    """docs/EMBEDDING.md's worked attend_flash push table (``| offset | field | value |``) lists
    ATTEND_FLASH_PUSH's fields at their byte offsets, every one of them, and its barrier
    sketch pushes both blocks' sizes: a changed block cannot leave the page behind."""
    import re
    text = (ROOT / "docs" / "EMBEDDING.md").read_text()
    rows = re.findall(r"^\| (\d+)(?: … (\d+))? \| ([a-z_, ]+) \|", text, re.M)
    listed = {}
    for first, last, names in rows:
        fields = [n.strip() for n in names.split(",")]
        step = (int(last) - int(first)) // max(len(fields) - 1, 1) if last else 0
        listed.update({n: int(first) + i * step for i, n in enumerate(fields)})
    block = abi.ATTEND_FLASH_PUSH
    assert listed == {n: i * abi.WORD_BYTES for i, n in enumerate(block.field_names)}
    assert f"push(p_flash, flash_words, {block.size_bytes})" in text
    assert f"push(p_merge, merge_words, {abi.ATTEND_MERGE_HEAD_PUSH.size_bytes})" in text
