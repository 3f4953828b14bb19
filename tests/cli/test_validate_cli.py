"""kvdict-validate: passes on this device, and catches a deliberately broken shader.

The broken shader is the real reconstruct.comp with its output scaled by 1.001 — wrong by
an NMSE of ~1e-6, far above the 1e-12 tolerance but invisible to any "does it run" check —
compiled into a directory that $KVDICT_VK_SPV_DIR points at, in a child process (SPIR-V is
loaded once per process).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from kvdict_vk.cli import validate
from kvdict_vk.vk import shader_build, spirv

pytestmark = pytest.mark.gpu

STORE = "out_elems[out_elem + row * ROW_CHUNKS + chunk] = acc;"


def test_quick_grid_passes(vk_device):
    rows = validate.run_validation(vk_device, quick=True)
    assert rows and all(r["passed"] for r in rows), [r for r in rows if not r["passed"]]
    ops = {r["op"].split(" n_used")[0] for r in rows}
    assert {"append+reconstruct K", "attend dict", "attend f32", "encode (GPU OMP) error vs CPU",
            "device forward (fwd_*), f16 cache"} <= ops
    worst = validate.worst_by_metric(rows)
    # the fast builds' rows at the fast paths' gate, apart: attend_mma's (cooperative matrices: not
    # on lavapipe) and attend_flash_dot's (integer dot products: lavapipe has them)
    from kvdict_vk.vk import abi
    features = set(vk_device.features())
    mma = set(abi.MMA_FEATURES) <= features and vk_device.limit("subgroup_size") == 32
    dot = set(abi.DECLARATIONS["attend_flash_dot"].features) <= features
    fast = [r for r in rows if "attend_mma" in r["op"]]
    assert bool(fast) == mma and all(r["metric"] == "nmse_fast" for r in fast)
    assert {r["op"].split(",")[0] for r in fast} == ({"attend f16", "attend q8_0", "attend kivi"} if mma else set())
    dotted = [r for r in rows if "attend_flash_dot" in r["op"]]
    assert bool(dotted) == dot and all(r["metric"] == "nmse_fast" and r["op"].startswith("attend q8_0,")
                                       for r in dotted)
    assert worst["nmse"] <= validate.NMSE_ATTEND and worst.get("nmse_fast", 0.0) <= validate.NMSE_FAST
    assert set(worst) == {"nmse", "rel_err_diff", "nll_abs"} | ({"nmse_fast"} if mma or dot else set())
    assert worst["nll_abs"] <= validate.FORWARD_NLL


@pytest.mark.skipif(shutil.which("glslangValidator") is None, reason="glslangValidator not installed (setup.sh installs it)")
def test_broken_shader_fails_with_its_row(tmp_path, vk_device):
    src = (shader_build.SHADER_DIR / "reconstruct.comp").read_text()
    # one store per path (rows_whole: CPU drivers, rows_chunked: GPUs); both are broken
    assert src.count(STORE) == 2, "reconstruct.comp changed: update the test's broken line"
    shaders = tmp_path / "shaders"
    shaders.mkdir()
    for f in shader_build.SHADER_DIR.iterdir():
        (shaders / f.name).write_text(f.read_text())
    (shaders / "reconstruct.comp").write_text(src.replace(STORE, STORE.replace("= acc;", "= acc * 1.001;")))
    spv = tmp_path / "spv"
    for variant in ("reconstruct_vec4", "reconstruct_scalar"):
        shader_build.compile_variant(variant, shaders, spv)
    env = dict(os.environ, **{spirv.SPV_DIR_ENV: str(spv), "KVDICT_VK_DEVICE": vk_device.name})
    cmd = [sys.executable, "-m", "kvdict_vk.cli.validate", "--quick"]
    proc = subprocess.run(cmd + ["--json"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    failed = [r for r in report["rows"] if not r["passed"]]
    assert failed and all(r["op"].startswith("append+reconstruct") for r in failed)
    assert all(1e-9 < r["nmse"] < 1e-4 for r in failed)  # wrong by the 1.001 scale, not crashed
    # the human table shows the failing row
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1
    fail_lines = [ln for ln in proc.stdout.splitlines() if " FAIL " in ln]
    assert fail_lines and all(ln.startswith("append+reconstruct") for ln in fail_lines)


def test_list_devices_and_bad_device():
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-m", "kvdict_vk.cli.validate", "--list", "--json"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    devs = json.loads(proc.stdout)
    assert devs and all("name" in d and "limits" in d for d in devs)
    proc = subprocess.run([sys.executable, "-m", "kvdict_vk.cli.validate", "--device", "no-such-gpu"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "no usable Vulkan device" in proc.stderr
    assert proc.stderr.count("\n") == 1  # one clear line


def test_variants_name_the_kernel_each_cache_attends_by(vk_device, capsys):
    """kvdict-validate --variants: per cache type the SPIR-V variant the engine plans on this
    device (its declaration exists, its features the device has); the KIVI and q8_0 caches
    always attend by attend_flash's builds, the others by their device class's paths."""
    from kvdict_vk import diagnostics
    from kvdict_vk.vk import abi
    rows = diagnostics.attention_variants(vk_device, n_kv=2, gqa=3, head_dim=64, n_used=4096)
    by = {r["cache"]: r for r in rows}
    assert set(by) == set(diagnostics.VARIANT_CACHES) and all("error" not in r for r in rows), rows
    assert all(r["variant"] in abi.DECLARATIONS for r in rows)
    assert by["kivi"]["variant"].startswith("attend_flash_kivi") and by["kivi"]["path"] == "flash"
    assert by["q8_0"]["variant"] in ("attend_flash", "attend_flash_sg", "attend_flash_wide", "attend_flash_wide_sg")
    sg = vk_device.shuffle_subgroup_size() > 0
    assert by["kivi"]["variant"].endswith("_sg") == sg and (("subgroups" in by["kivi"]["needs"]) == sg)
    mma = set(abi.MMA_FEATURES) <= set(vk_device.features()) and vk_device.limit("subgroup_size") == 32
    assert by["kivi"]["on_request"] == (["attend_mma_kivi"] if mma else [])
    assert by["f16"]["on_request"] == by["q8_0"]["on_request"] == (["attend_mma"] if mma else [])
    assert by["dict"]["on_request"] == by["f32"]["on_request"] == by["dict_pre_rope"]["on_request"] == []
    # keys coded before RoPE: the K_ROPE build of the flash pass over the codes, or attend_direct's
    assert by["dict_pre_rope"]["build"] == "K_ROPE" and by["dict_pre_rope"]["variant"] == \
        ("attend_flash_coded" if by["dict"]["path"] == "flash" else "attend_direct")
    assert validate.main(["--variants"]) == 0
    out = capsys.readouterr().out
    assert all(f"{r['cache']:>5}: {r['variant']}" in out for r in rows) and "K_ROPE build" in out
