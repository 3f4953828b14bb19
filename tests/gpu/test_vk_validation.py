"""The validation-layer gate really captures messages.

Each check runs in a subprocess with its own settings file and log, configured exactly as
conftest configures this session — a deliberate error here must not pollute (or, since the
layer truncates its log per instance, erase) the session's log.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import conftest

pytestmark = pytest.mark.gpu

_SCRIPT = textwrap.dedent("""
    import numpy as np, sys
    from kvdict_vk.vk import spirv
    from kvdict_vk.vk.device import get_device, kp
    from kvdict_vk.vk.kernels import Buffer, Kernel, run
    dev = get_device()
    a = Buffer(dev, 64, "storage", "a")
    b = Buffer(dev, 64, "storage", "b")
    if sys.argv[1] == "clean":
        k = Kernel(dev, "copy_vec4", [a, b], max_items=16)
        run(dev, k.op(src_word=0, dst_word=0, n_words=64))
    else:
        # Bypass kvdict_vk's checks on purpose: a pipeline layout without the push-constant
        # range the shader uses (VUID-VkComputePipelineCreateInfo-layout-00703).
        dev.manager.algorithm([a.tensor, b.tensor], spirv.load("copy_vec4"), [1, 1, 1],
                              np.array([], np.uint32), np.array([], np.uint32))
    print("done")
""")


def _run(tmp_path: Path, mode: str) -> str:
    if not conftest.VALIDATION:
        msg = "the Khronos validation layer is not installed (or KVDICT_NO_VALIDATION is set)"
        if conftest.device_required():
            pytest.fail(msg)
        pytest.skip(msg)
    log = tmp_path / f"{mode}.log"
    settings = tmp_path / mode
    settings.mkdir()
    (settings / "vk_layer_settings.txt").write_text(conftest.layer_settings(log))
    env = {**os.environ, "VK_LAYER_SETTINGS_PATH": str(settings), "VK_INSTANCE_LAYERS": conftest.LAYER}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, mode], env=env, capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stdout + proc.stderr
    assert log.exists(), "the validation layer did not open its log: is it loaded?"
    return log.read_bytes().replace(b"\0", b"").decode(errors="replace")


def test_deliberate_error_lands_in_the_log(tmp_path):
    text = _run(tmp_path, "provoke")
    assert "VUID-VkComputePipelineCreateInfo-layout-00703" in text, text


def test_clean_dispatch_logs_nothing(tmp_path):
    assert _run(tmp_path, "clean").strip() == ""


def test_in_session_messages_reach_the_gate(vk_device):
    """The session's own instance logs where the gate reads: provoke one error in-process
    and consume it as expected (otherwise this test, and the session, would fail)."""
    if not conftest.VALIDATION:
        pytest.skip("validation layer not configured")
    import numpy as np
    from kvdict_vk.vk import spirv
    from kvdict_vk.vk.kernels import Buffer
    a, b = Buffer(vk_device, 64, "storage", "a"), Buffer(vk_device, 64, "storage", "b")
    conftest.LOG.new_text()
    algo = vk_device.manager.algorithm([a.tensor, b.tensor], spirv.load("copy_scalar"), [1, 1, 1],
                                       np.array([], np.uint32), np.array([], np.uint32))
    text = conftest.LOG.new_text(expected=True)
    assert "VUID-VkComputePipelineCreateInfo-layout-00703" in text, text
    algo.destroy()
    a.destroy()
    b.destroy()


def test_session_gate_is_armed():
    if not conftest.VALIDATION:
        pytest.skip("validation layer not configured")
    assert conftest.LAYER in os.environ["VK_INSTANCE_LAYERS"].split(":")
    assert (Path(os.environ["VK_LAYER_SETTINGS_PATH"]) / "vk_layer_settings.txt").is_file()
    assert conftest.VALIDATION_LOG.exists(), "the session's instance should have opened the log"
    settings = (Path(os.environ["VK_LAYER_SETTINGS_PATH"]) / "vk_layer_settings.txt").read_text()
    assert "VK_VALIDATION_FEATURE_ENABLE_SYNCHRONIZATION_VALIDATION_EXT" in settings


def test_missing_barrier_is_reported(vk_device):
    """Synchronization validation is really on: a dispatch that reads what the previous
    one wrote, with no barrier between them, is reported — and kernels.barrier silences it."""
    from kvdict_vk.vk import kernels
    if not conftest.VALIDATION:
        pytest.skip("validation layer not configured")
    if conftest.device_required():
        assert kernels.HAS_COMPUTE_BARRIER, "kp lacks OpComputeBarrier: scripts/setup.sh's patch did not apply"
    a = kernels.Buffer(vk_device, 64, "storage", "a")
    b = kernels.Buffer(vk_device, 64, "storage", "b")
    c = kernels.Buffer(vk_device, 64, "storage", "c")
    first = kernels.Kernel(vk_device, "copy_scalar", [a, b], max_items=64)
    second = kernels.Kernel(vk_device, "copy_scalar", [b, c], max_items=64)
    try:
        kernels.run(vk_device, first.op(src_word=0, dst_word=0, n_words=64),
                    second.op(src_word=0, dst_word=0, n_words=64))
        text = conftest.LOG.new_text(expected=True)
        assert "SYNC-HAZARD-READ-AFTER-WRITE" in text, text
        kernels.run(vk_device, first.op(src_word=0, dst_word=0, n_words=64), kernels.barrier(b),
                    second.op(src_word=0, dst_word=0, n_words=64))
        assert "SYNC-HAZARD" not in conftest.LOG.new_text(expected=True)
    finally:
        for x in (first, second):
            x.destroy()
        for x in (a, b, c):
            x.destroy()
