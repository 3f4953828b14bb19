"""kvdict_vk.diagnostics: the one report of host, versions, devices, artifact, tuner cache and
SPIR-V — and its users (kvdict-validate --report / --list, the benchmarks' header, the SDPA
anchor's description)."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import types

import pytest

from kvdict_vk import diagnostics, runtime


def _expected_driver() -> str | None:
    return os.environ.get("KVDICT_EXPECT_DRIVER") or None


def test_report_has_every_section_and_their_keys():
    rep = diagnostics.report()
    assert tuple(rep) == diagnostics.SECTIONS
    assert {"platform", "python", "cpu", "cpus"} <= set(rep["host"])
    v = rep["versions"]
    assert {"kvdict_vk", "numpy", "kp", "driver"} <= set(v)
    assert {"version", "patched", "patch_hash", "checkout_patch_hash", "patch_current"} <= set(v["kp"])
    assert {"enabled", "active", "installed", "certificate"} <= set(rep["artifact"])
    assert {"path", "exists", "entries", "by_kind"} <= set(rep["tuner_cache"])
    s = rep["spirv"]
    assert s["variants"] > 0 and s["manifest_variants"] == s["variants"] and s["missing"] == []
    assert s["checkout"] and isinstance(s["stale"], list)  # the tests run in a checkout
    json.dumps(rep)  # JSON-ready as it is


def test_kp_patch_hash_is_the_checkouts_where_setup_built_it():
    kp = diagnostics.kp_info()
    assert len(kp["checkout_patch_hash"]) == 12
    if kp["patch_hash"] is not None:  # scripts/setup.sh's venv: built with today's patch
        assert kp["patch_current"] is True and kp["patched"] is True


def test_devices_have_limits_features_and_the_selected_one():
    driver = _expected_driver()
    try:
        devs = diagnostics.devices()
    except Exception as e:
        if driver:
            raise
        pytest.skip(f"no Vulkan loader or device here: {e}")
    if not devs and not driver:
        pytest.skip("the loader reports no device")
    assert devs and all({"name", "limits", "heaps", "features"} <= set(d) for d in devs)
    assert sum(bool(d.get("selected")) for d in devs) <= 1
    for d in devs:
        f = d["features"]
        assert f["subgroup_size"] == d["limits"]["subgroup_size"]
        assert f["subgroup_shuffle"] == ({"basic", "shuffle"} <= set(f["subgroup_operations"]))
    if driver:
        hits = [d for d in devs if driver.lower() in (d["name"] + d["driver_name"]).lower()]
        assert hits, f"{driver} not among {[d['name'] for d in devs]}"
        if driver.lower() in os.environ.get("KVDICT_VK_DEVICE", "").lower():
            assert hits[0].get("selected") and driver.lower() in (diagnostics.report()["versions"]["driver"] or "").lower()


def test_print_report_prints_every_section_and_the_device_list():
    out = io.StringIO()
    rep = diagnostics.report()
    diagnostics.print_report(file=out, rep=rep)
    text = out.getvalue()
    for title in ("host", "versions", "devices", "artifact", "tuner cache", "SPIR-V"):
        assert f"██ {title}\n" in text
    for d in rep["devices"]:
        assert ("error" in d and d["error"] in text) or diagnostics.device_line(d) in text
    if _expected_driver():
        assert _expected_driver() in text
    # the session header's lines come from the same report
    assert any(line.startswith("kvdict_vk ") for line in diagnostics.summary_lines(rep))


def test_a_section_that_fails_says_why_and_the_rest_stays(monkeypatch):
    def broken():
        raise RuntimeError("no loader")
    monkeypatch.setattr(diagnostics, "devices", broken)
    rep = diagnostics.report()
    assert rep["devices"] == [{"error": "RuntimeError: no loader"}] and rep["versions"]["driver"] is None
    out = io.StringIO()
    diagnostics.print_report(file=out, rep=rep)
    assert "RuntimeError: no loader" in out.getvalue() and "██ SPIR-V" in out.getvalue()


def test_installed_artifact_and_tuner_cache(tmp_path, monkeypatch, activate):
    from conftest import random_artifact
    import numpy as np
    activate(random_artifact(np.random.default_rng(0), 16, 8, [(2, (2, 3))]))
    a = diagnostics.artifact()
    assert a["active"] and a["certificate"] is None
    assert a["installed"] == {"head_dim": 16, "n_atoms": 8, "sparsity": 2, "layers": 1}
    store = tmp_path / "tune.json"
    monkeypatch.setenv("KVDICT_VK_TUNE_CACHE", str(store))
    assert diagnostics.tuner_cache()["exists"] is False
    from kvdict_vk.vk import choice_store
    choice_store.save("encoder", ("dev", 1), ["cpu", "gpu"], "gpu")
    choice_store.save("attend_launch_shape", ("dev", 2), [[1, 2]], [1, 2])
    choice_store.save("encoder", ("dev", 3), ["cpu", "gpu"], "cpu")
    t = diagnostics.tuner_cache()
    assert t["path"] == str(store) and t["entries"] == 3 and t["by_kind"] == {"encoder": 2, "attend_launch_shape": 1}
    store.write_text("not json")
    assert "error" in diagnostics.tuner_cache()
    assert runtime.snapshot().active  # reading the report changed nothing


def test_validate_report_and_list_print_the_diagnostics():
    env = dict(os.environ)
    proc = subprocess.run([sys.executable, "-m", "kvdict_vk.cli.validate", "--report"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "██ devices" in proc.stdout and "██ SPIR-V" in proc.stdout
    proc = subprocess.run([sys.executable, "-m", "kvdict_vk.cli.validate", "--report", "--json"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and tuple(json.loads(proc.stdout)) == diagnostics.SECTIONS
    if _expected_driver():
        assert _expected_driver() in proc.stdout
        listed = subprocess.run([sys.executable, "-m", "kvdict_vk.cli.validate", "--list"], env=env,
                                capture_output=True, text=True, timeout=120)
        assert listed.returncode == 0 and _expected_driver() in listed.stdout


def test_benchmark_header_and_anchor_description_use_it():
    from kvdict_vk.bench import common, torch_anchor
    from kvdict_vk.vk.vulkan_info import DeviceInfo
    info = DeviceInfo(0, "Fake", "discrete-gpu", 1, 2, "1.3.0", 3, "drv", "1.0",
                      {"subgroup_size": 32, "subgroup_operations": ("basic", "shuffle"), "timestamp_valid_bits": 64,
                       "timestamp_period_ns": 1.0, "compute_units": 132}, ((1 << 30, True),))
    args = types.SimpleNamespace(argv=["--x"], validation=False)
    h = common.run_header("t", args, types.SimpleNamespace(info=info), 0.0)
    assert h["device"]["name"] == "Fake" and h["device"]["features"]["subgroup_shuffle"]
    assert h["device"]["features"]["compute_units"] == 132 and h["versions"]["driver"] == "drv 1.0"
    assert {"platform", "cpus", "loadavg", "machine"} <= set(h["host"]) and h["versions"]["kp"]["version"]
    fake = types.SimpleNamespace(__version__="9.9", version=types.SimpleNamespace(cuda="12.8"),
                                 cuda=types.SimpleNamespace(get_device_name=lambda i: "Fake GPU"))
    d = torch_anchor.describe(fake)
    assert d["torch"] == "9.9" and d["cuda"] == "12.8" and d["cuda_device"] == "Fake GPU" and "timing" in d
